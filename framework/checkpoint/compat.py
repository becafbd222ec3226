"""What a run may take from a checkpoint, checked in the launcher before any rank starts: the
path resolves to a complete checkpoint, its model keys and shapes are this model's, and a
resume keeps the global batch order (or says checkpoint.reset_data). The mesh shape, plan,
TP size and optimizer options may all differ: DCP reshards on load."""
import os
import tempfile
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.checkpoint.base_model import base_model, describe, same_base
from framework.checkpoint.layout import CheckpointError, read_meta, resolve
from framework.models.adapter_names import is_adapter
from framework.config.errors import ConfigError
from framework.config.checked import Checked
from framework.models.protocol import offered

# Keys whose change reorders the global batches a resumed position points into.
DATA_ORDER_KEYS = ("data.global_batch_size", "data.dataset", "data.streaming", "sampler.seed", "sampler.shuffle",
                   "sampler.drop_last")


def check_checkpoint_keys(cfg: DictConfig) -> None:
    c = cfg.checkpoint
    for key in ("every", "keep_last"):
        if c[key] is not None and c[key] < 1:
            raise ConfigError(f"checkpoint.{key}", c[key], "must be >= 1, or null")
    # (A LoRA run's init_from is its base, which a resume of its adapters loads again.)
    if c.resume not in (None, "auto") and c.init_from and cfg.adapter.kind == "none":
        raise ConfigError("checkpoint.init_from", c.init_from,
                          "a run either resumes checkpoint.resume or starts from init_from's weights; set "
                          "checkpoint.resume=auto (init_from applies when it finds nothing) or drop init_from")
    if cfg.launcher.max_restarts < 0:
        raise ConfigError("launcher.max_restarts", cfg.launcher.max_restarts, "must be >= 0")
    # (a restarted torchft replica group takes a live group's state instead)
    if cfg.launcher.max_restarts and not c.every and not cfg.launcher.get("fault_tolerance"):
        raise ConfigError("launcher.max_restarts", cfg.launcher.max_restarts,
                          "a restart resumes from the newest checkpoint; set checkpoint.every too")


def _resolved(key: str, source: Optional[str], directory: str) -> Optional[str]:
    if not source:
        return None
    try:
        return resolve(source, directory)
    except CheckpointError as error:
        raise ConfigError(key, source, str(error)) from None


def check_checkpoint_sources(c: Checked) -> None:
    """The checkpoint a run starts from (checkpoint.resume, else init_from) fits this config."""
    cfg, checkpoint_dir, model = c.cfg, c.checkpoint_dir, c.model
    if checkpoint_dir is None:  # (the ranks: the launcher checked it)
        return
    c = cfg.checkpoint
    resume = _resolved("checkpoint.resume", c.resume, checkpoint_dir)
    path, key = (resume, "checkpoint.resume") if resume else (_resolved("checkpoint.init_from", c.init_from,
                                                                        checkpoint_dir), "checkpoint.init_from")
    if path is None:
        return
    value = getattr(c, key.split(".")[1])
    try:
        meta = read_meta(path)
        if "base" in meta:
            check_adapter_checkpoint(cfg, checkpoint_dir, model, path, meta["base"], resume is not None)
        check_model_keys(path, model, "adapters" if "base" in meta else "all" if resume else "base")
    except CheckpointError as error:
        raise ConfigError(key, value, str(error)) from None
    if resume and not c.reset_data:
        check_data_order(cfg, path, meta["config"])


def check_adapter_checkpoint(cfg: DictConfig, checkpoint_dir: str, model: nn.Module, path: str, saved: dict,
                             resume: bool) -> None:
    """A checkpoint of LoRA adapters alone: only a LoRA run on the base they were trained on
    resumes it; none starts from its weights (it has no base weights)."""
    if not resume:
        raise CheckpointError(path, "holds LoRA adapters alone, no base weights to start from; export them "
                                    "(python -m framework.export CKPT OUT --format peft) and start from adapter.init_from=OUT")
    if not any(is_adapter(name) for name in model.state_dict()):
        raise CheckpointError(path, f"holds LoRA adapters alone (of {describe(saved)}); resume it with adapter=lora "
                                    f"and the adapter keys it was saved with")
    now = base_model(cfg, checkpoint_dir, offered(model).hf_path)
    if not same_base(saved, now):
        raise CheckpointError(path, f"holds LoRA adapters of {describe(saved)}, but this run's base model is "
                                    f"{describe(now)}; resume with the base they were trained on")


def nothing_to_train(cfg: DictConfig, checkpoint_dir: str) -> Optional[str]:
    """The line to say, instead of starting ranks, when the checkpoint the run resumes is at or
    past trainer.max_steps; None when steps are left (or nothing is resumed)."""
    resume = _resolved("checkpoint.resume", cfg.checkpoint.resume, checkpoint_dir)
    if resume is None:
        return None
    step = read_meta(resume)["step"]
    if step < cfg.trainer.max_steps:
        return None
    return (f"nothing to train: {resume} is at step {step} and trainer.max_steps={cfg.trainer.max_steps}; raise "
            f"trainer.max_steps to train on, or set checkpoint.resume=null to start afresh")


def check_data_order(cfg: DictConfig, path: str, saved_config: dict) -> None:
    saved = OmegaConf.create(saved_config)
    if cfg.data.get("streaming") and list(saved.mesh.shape) != list(cfg.mesh.shape):
        raise ConfigError("mesh.shape", list(cfg.mesh.shape),
                          f"checkpoint {path} holds each rank's place in a stream (data.streaming) for the mesh "
                          f"{list(saved.mesh.shape)}; resume it on that mesh, or set checkpoint.reset_data=true to "
                          f"start the stream again")
    for key in DATA_ORDER_KEYS:
        now, then = (OmegaConf.select(c, key) for c in (cfg, saved))
        now, then = (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in (now, then))
        if now != then:
            raise ConfigError(key, now, f"checkpoint {path} was saved with {then!r}, and a change reorders the global "
                                        f"batches it resumes into; restore it, or set checkpoint.reset_data=true to "
                                        f"restart the data at the next epoch")


def check_model_keys(path: str, model: nn.Module, which: str = "all") -> None:
    """The model's state_dict keys and shapes against the checkpoint's (DCP's .metadata, read
    without loading a tensor): name the first key missing on either side, or both shapes.
    `which` keys: "all"; "base" (checkpoint.init_from: the LoRA adapters of neither side, as
    framework.checkpoint.weights.load_base loads none); "adapters" (a LoRA run's checkpoint holds those)."""
    from framework.checkpoint.safe_load import read_checkpoint_metadata  # only when a checkpoint is given

    metadata = read_checkpoint_metadata(path).state_dict_metadata
    saved = {k.removeprefix("model."): list(v.size) for k, v in metadata.items()
             if k.startswith("model.") and hasattr(v, "size")}
    kept = {"all": lambda k: True, "base": lambda k: not is_adapter(k), "adapters": is_adapter}[which]
    expected = {k: list(t.shape) for k, t in model.state_dict().items() if kept(k)}
    saved = {k: v for k, v in saved.items() if kept(k)}
    for name, shape in expected.items():
        if name not in saved:
            raise CheckpointError(path, f"has no model key {name!r} (shape {shape} in this model): another model's "
                                        f"checkpoint?")
        if saved[name] != shape:
            raise CheckpointError(path, f"model key {name!r} has shape {saved[name]} there but {shape} in this model")
    extra = [name for name in saved if name not in expected]
    if extra:
        raise CheckpointError(path, f"model key {extra[0]!r} (shape {saved[extra[0]]}) is not in this model: another "
                                    f"model's checkpoint?")


def checkpoint_dir(cfg: DictConfig, out_dir: str) -> str:
    return os.path.abspath(os.path.expanduser(cfg.checkpoint.dir or os.path.join(out_dir, "checkpoints")))


def check_checkpoint_writable(c: Checked) -> None:
    """A run that saves (checkpoint.every) can make its checkpoint directory: a file can be
    written (and removed) in the nearest part of it that exists. Tried, not asked of os.access,
    which tells root that /proc is writable. Found before launch, not at the first save."""
    if c.checkpoint_dir is None or not c.cfg.checkpoint.every:
        return
    existing = c.checkpoint_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".writable-"):
            pass
    except OSError as error:
        raise ConfigError("checkpoint.dir", c.cfg.checkpoint.dir,
                          f"checkpoints go to {c.checkpoint_dir}, but {existing} is not a writable directory; "
                          f"point checkpoint.dir at one (a file written there: {error.strerror})") from None
