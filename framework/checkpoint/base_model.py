"""Which base model a LoRA run's adapters belong to. With adapters a checkpoint holds them (and
their optimizer state) only, megabytes against the base's gigabytes, and names its base in
framework.json: a resume (and an export) loads that base again, and the launcher refuses one
whose base differs.

A base is one of three: a Hugging Face directory (identified by a fingerprint of its config.json
and weight files, so a moved copy is the same base and a retrained one is not), a framework
checkpoint given as checkpoint.init_from (its step and the time it was saved), or the weights
trainer.seed draws for the model config (the config but for activation_checkpointing, which
changes no weight; and the device the weights were drawn on, whose generator differs).
"""
import glob
import hashlib
import os
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.layout import read_meta, resolve

_SAMPLES, _SAMPLE_BYTES = 64, 4096  # read of each weight file: its header and 63 blocks spread through it
_WEIGHTLESS_KEYS = ("activation_checkpointing",)


def weights_fingerprint(directory: str) -> str:
    """A digest of config.json and a spread of bytes of each *.safetensors file (the header, with
    every tensor's name, shape and offset, then blocks across the data): fast on a 100 GB model,
    and any retraining changes blocks everywhere."""
    digest = hashlib.sha256()
    with open(os.path.join(directory, "config.json"), "rb") as f:
        digest.update(f.read())
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(i * size // _SAMPLES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def base_model(cfg: DictConfig, checkpoint_dir: str, hf_path: Optional[str]) -> dict:
    """The identity of this run's base weights (`hf_path`: the model's Hugging Face directory)."""
    if cfg.checkpoint.init_from:
        path = resolve(cfg.checkpoint.init_from, checkpoint_dir)
        meta = read_meta(path)
        return {"checkpoint": path, "step": meta["step"], "saved_unix": meta["saved_unix"]}
    if hf_path:
        return {"hf": os.path.abspath(hf_path), "fingerprint": weights_fingerprint(hf_path)}
    model = OmegaConf.to_container(cfg.model, resolve=True)
    return {"model": {k: v for k, v in model.items() if k not in _WEIGHTLESS_KEYS}, "seed": cfg.trainer.seed,
            "device": cfg.mesh.device_type}


def same_base(saved: dict, now: dict) -> bool:
    """Equal but for where it lies: a moved Hugging Face directory is the same base."""
    return {k: v for k, v in saved.items() if k != "hf"} == {k: v for k, v in now.items() if k != "hf"}


def describe(base: dict) -> str:
    if "checkpoint" in base:
        return f"the checkpoint {base['checkpoint']} (step {base['step']})"
    if "hf" in base:
        return f"the Hugging Face model {base['hf']} (weights fingerprint {base['fingerprint']})"
    return (f"the {base['model'].get('_target_', 'model')} that trainer.seed={base['seed']} draws on "
            f"{base['device']} for model={base['model']}")
