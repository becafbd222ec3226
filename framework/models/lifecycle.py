"""A model's steps from its config to its starting weights, written once for every command that
builds one (the builder's stages, export, generate, DPO's frozen copy): built seeded (a Hugging
Face model on meta, so no rank ever holds it whole), adapted, then, after whatever parallel
stages the caller applies, given storage, and loaded from the source framework.checkpoint.weights
names."""
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from framework.models.hf import materialize
from framework.models.lora import add_adapters, init_adapters


def new_model(model_cfg: DictConfig, device: str, seed: int, build=instantiate) -> nn.Module:
    """Seeded, so every rank (and a later export) draws the same weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        return build(model_cfg)


def adapt(model: nn.Module, adapter_cfg: DictConfig, seed: int) -> None:
    """adapter=lora / qlora: LoRA adapters on the targeted layers, the base frozen."""
    if adapter_cfg["kind"] != "none":
        add_adapters(model, adapter_cfg["rank"], adapter_cfg["alpha"], adapter_cfg["dropout"],
                     list(adapter_cfg["targets"]), seed)


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def allocate(model: nn.Module, device: str, seed: int) -> None:
    """Storage for a model (or this rank's shards of it) still on meta, whose weights load next;
    its LoRA adapters drawn again (to_empty leaves them garbage). A model with storage stays."""
    if on_meta(model):
        materialize(model, device)
        init_adapters(model, seed)
