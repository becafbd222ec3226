"""`python -m framework.export CHECKPOINT OUT.pt`: a checkpoint's model as one plain state_dict;
`python -m framework.export CHECKPOINT OUT_DIR --format hf`: a Hugging Face model directory
(framework/models/hf_export.py) that transformers' from_pretrained loads, for a model that came
from one (model=hf).

CHECKPOINT is a step_N dir (or a checkpoints dir, meaning its newest). The model its saved
config names is built in this one process, DCP loads the sharded weights into it with no
process group (resharding whatever mesh and plan saved them into whole tensors), and OUT.pt
gets `model.state_dict()`: the model's own keys, loadable with
`model.load_state_dict(torch.load("OUT.pt"))` anywhere. Nothing is overwritten: OUT.pt must be new,
OUT_DIR new or an empty directory, and the directory that holds either must exist. Bad input
exits 2 with one line.
"""
import argparse
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator, List, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.atomic import atomic_file
from framework.checkpoint.compat import check_model_keys
from framework.checkpoint.layout import CheckpointError, read_meta, resolve
from framework.checkpoint.safe_load import load_checkpoint
from framework.cli import parsed_status
from framework.config.errors import ConfigError
from framework.config.schema import Config
from framework.config.trust import check_targets
from framework.config.checked import instantiate_checked
from framework.checkpoint.base_model import base_model, describe, same_base
from framework.checkpoint.weights import load_base
from framework.models.lifecycle import adapt, allocate, new_model
from framework.models.hf import check_hf_out
from framework.models.hf_export import DEFAULT_MAX_SHARD_BYTES, save_hf, save_peft
from framework.models.adapter_names import is_adapter
from framework.models.nf4 import dequantized, quantize_base
from framework.models.protocol import offered


@contextmanager
def saved_config_errors(path: str) -> Iterator[None]:
    """A ConfigError about a value of the checkpoint's saved config (a model.path since moved)
    says the value came from there: the user never typed it."""
    try:
        yield
    except ConfigError as error:
        raise CheckpointError(path, f"{error.key}={error.value!r}, read from its saved config: {error.fix}") from None


def load_model(checkpoint: str) -> Tuple[nn.Module, DictConfig, str]:
    """The checkpoint's model, built in this process with whole tensors; its saved config; the
    checkpoint dir used."""
    path = resolve(checkpoint, directory="")
    meta = read_meta(path)
    cfg = OmegaConf.create(meta["config"])
    # The saved config names the model class: checked against your allowlist (the default, and
    # FRAMEWORK_ALLOWED_TARGETS), never the one the checkpoint carries.
    cfg.allowed_targets = Config().allowed_targets
    check_targets(cfg)
    base = meta.get("base")  # a LoRA run's checkpoint: its adapters alone, and which base they adapt
    if base is not None and "model" in base and base["device"] != "cpu":
        raise CheckpointError(path, f"its base model is the one trainer.seed drew on {base['device']}, which this "
                                    f"process (on cpu) cannot draw again; export where that device is")
    with saved_config_errors(path):  # a base drawn from the seed is drawn again
        model = new_model(cfg.model, "cpu", base["seed"] if base is not None and "model" in base else 0,
                          instantiate_checked)
    adapter = cfg.get("adapter") or {"kind": "none"}
    adapt(model, adapter, 0)  # the run's adapters, as its `adapters` stage added them
    allocate(model, "cpu", 0)  # a Hugging Face model comes on meta
    check_model_keys(path, model, "all" if base is None else "adapters")
    if base is not None:
        _load_base(model, cfg, path, base)
    if adapter["kind"] == "qlora":  # the base the run trained on: its NF4 values (written dequantized)
        quantize_base(model, adapter["block_size"], adapter["scaler_block_size"])
    state = model.state_dict()
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint({"model": state if base is None else {k: v for k, v in state.items() if is_adapter(k)}},
                        path, no_dist=True)
    return model, cfg, path


def _load_base(model: nn.Module, cfg: DictConfig, path: str, base: dict) -> None:
    """The base weights of an adapter checkpoint, from where the run took them (still the same)."""
    if "checkpoint" in base:
        meta = read_meta(base["checkpoint"])
        now = {"checkpoint": base["checkpoint"], "step": meta["step"], "saved_unix": meta["saved_unix"]}
    else:
        now = base_model(cfg, os.path.dirname(path), offered(model).hf_path)
    if not same_base(base, now):
        raise CheckpointError(path, f"its adapters belong to {describe(base)}, but that is now {describe(now)}")
    load_base(model, base.get("checkpoint"), base.get("hf") and offered(model).hf_path)


def check_out(out: str, format: str) -> None:
    """Before the model is loaded: the output is new (an hf OUT_DIR may be an empty directory),
    in a directory that exists, so nothing is overwritten and no write fails half-way."""
    key = "OUT_DIR" if format in ("hf", "peft") else "OUT"
    if format in ("hf", "peft"):
        check_hf_out(out)
    elif os.path.isdir(out) or out.endswith(os.sep):
        raise ConfigError(key, out, "names a directory; name the file to write (OUT.pt), or add --format hf to write "
                                    "a Hugging Face directory")
    elif os.path.exists(out):
        raise ConfigError(key, out, "exists; name a new file (export overwrites nothing)")
    parent = os.path.dirname(os.path.abspath(out.rstrip(os.sep)))
    if not os.path.isdir(parent):
        raise ConfigError(key, out, f"its directory {parent} does not exist; create it first")


def export(checkpoint: str, out_path: str, format: str = "pt", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write the checkpoint's full model to out_path (atomically): a state_dict file, or a
    Hugging Face directory; return the checkpoint dir used."""
    check_out(out_path, format)
    model, cfg, path = load_model(checkpoint)
    if format == "peft":
        save_peft(model, cfg.adapter if "adapter" in cfg else OmegaConf.create({"kind": "none"}), out_path)
        return path
    if format == "hf":
        save_hf(model, out_path, max_shard_bytes)
        return path
    with atomic_file(out_path, "wb") as f:
        torch.save({k: dequantized(v) for k, v in model.state_dict().items()}, f)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_N dir, or a checkpoints dir (its newest)")
    p.add_argument("out", help="OUT.pt (--format pt) or OUT_DIR (--format hf, peft)")
    p.add_argument("--format", choices=["pt", "hf", "peft"], default="pt",
                   help="pt: one state_dict file (the default); hf: a Hugging Face model directory (LoRA adapters "
                        "merged into their weights); peft: the LoRA adapters as PEFT's adapter directory")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**30,
                   help="hf: split the safetensors into files of at most this size, with an index")
    return p


def _run(args: argparse.Namespace) -> int:
    path = export(args.checkpoint, args.out, args.format, int(args.max_shard_gb * 2**30))
    print(f"exported the model of {path} to {args.out}")
    return 0


def main(argv: List[str]) -> int:
    return parsed_status(parser(), argv, _run, "export failed")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
