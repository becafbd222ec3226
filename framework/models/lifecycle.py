"""A model's steps from its config to its starting weights, written once for every command that
builds one (the builder's stages, export, generate, DPO's frozen copy): built seeded (a Hugging
Face model on meta, so no rank ever holds it whole), adapted, then, after whatever parallel
stages the caller applies, given storage, and loaded from the source framework.checkpoint.weights
names."""
import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig
from torch import nn

from framework.models.hf import materialize
from framework.models.lora import add_adapters, init_adapters
from framework.models.protocol import ModelProtocol, from_hugging_face, offered


def new_model(model_cfg: DictConfig, device: str, seed: int, build=instantiate) -> nn.Module:
    """Seeded, so every rank (and a later export) draws the same weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        return build(model_cfg)


def born_on_meta(model_cfg: DictConfig) -> bool:
    """Whether the configured model draws its own starting weights once sharded
    (ModelProtocol.declares_init): the builder makes it on meta, and allocate draws each rank's
    part. Any other module (a seed MLP, a torch.nn layer) is built whole, seeded."""
    target = model_cfg.get("_target_") if isinstance(model_cfg, (dict, DictConfig)) else None
    try:
        built = get_object(target) if target else None
    except Exception:  # noqa: BLE001 - an unimportable target fails where it is built, with its own error
        return False
    return isinstance(built, type) and issubclass(built, ModelProtocol) and built.declares_init


def adapt(model: nn.Module, adapter_cfg: DictConfig, seed: int) -> None:
    """adapter=lora / qlora: LoRA adapters on the targeted layers, the base frozen."""
    if adapter_cfg["kind"] != "none":
        add_adapters(model, adapter_cfg["rank"], adapter_cfg["alpha"], adapter_cfg["dropout"],
                     list(adapter_cfg["targets"]), seed)


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def allocate(model: nn.Module, device: str, seed: int) -> None:
    """Storage for a model (or this rank's shards of it) still on meta, with its declared starting
    weights drawn (ModelProtocol.init_weights; not for a Hugging Face model, whose weights load
    next) and its LoRA adapters drawn again (to_empty leaves them garbage). A model with storage
    stays."""
    if on_meta(model):
        materialize(model, device)
        if offered(model).declares_init and not from_hugging_face(model):
            model.init_weights(seed)
        init_adapters(model, seed)
