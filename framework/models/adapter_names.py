"""The names by which LoRA adapters are found, read by the adapters (framework.models.lora), the
NF4 base they wrap (framework.models.nf4) and the Hugging Face names (framework.models.hf):
PEFT's `<layer>.lora_A.weight` / `.lora_B.weight` under each targeted nn.Linear; and the adapters
set aside while TP shards their layers, on any model (ModelProtocol.tp_set_aside's default)."""
from contextlib import contextmanager
from typing import Iterator, List, Tuple

from torch import nn

from framework.config.errors import ConfigError
from framework.models.vision import role_of
from framework.parallel.dtensors import dtensor_api, is_dtensor

ADAPTER_PARAMETERS = (".lora_A.", ".lora_B.")
CHILDREN = ("lora_A", "lora_B", "lora_dropout")  # what add_adapters puts under a layer


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARAMETERS)


def adapter_layers(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    return ((name, m) for name, m in model.named_modules() if hasattr(m, "lora_A"))


def targets_of(model: nn.Module, targets: List[str]) -> List[Tuple[str, nn.Linear]]:
    """The model's linear layers whose name ends in one of `targets` (of a vision-language model,
    its language model's alone), or one line naming the target that matches nothing and the
    candidates."""
    language_only = getattr(model, "vision", False)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and not (language_only and role_of(name) != "language")]
    for target in targets:
        if not any(name.rsplit(".", 1)[-1] == target for name, _ in linears):
            candidates = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
            raise ConfigError("adapter.targets", list(targets), f"{target!r} names no linear layer of "
                                                                f"{type(model).__name__}; its linear layers end in "
                                                                f"{candidates}")
    return [(name, m) for name, m in linears if name.rsplit(".", 1)[-1] in targets]


@contextmanager
def adapters_set_aside(model: nn.Module) -> Iterator[None]:
    """The adapters out of their layers while parallelize_module shards the layers (a style
    shards every parameter, and expects a weight, under its layer), then back, placed for their layer's layout
    (torchtitan's rule): under a colwise layer A replicated and B colwise, under a rowwise one A
    rowwise and B replicated, so the update has the layer's own output layout (sharded on the
    features, or partial sums reduced with the layer's). The base is frozen again after: torch's
    SequenceParallel registers its norms' weights anew, trainable."""
    held = [(layer, {name: layer._modules.pop(name) for name in CHILDREN}) for _, layer in adapter_layers(model)]
    try:
        yield
    finally:
        if held:  # torch's SequenceParallel makes new Parameters that train: the base stays frozen
            for param in model.parameters():
                param.requires_grad_(False)
        for layer, children in held:
            for name, child in children.items():
                setattr(layer, name, child)
            if is_dtensor(layer.weight):
                _place_for(layer)


def _place_for(layer: nn.Linear) -> None:
    Replicate, Shard, distribute_tensor = (getattr(dtensor_api(), name) for name in ("Replicate", "Shard",
                                                                                     "distribute_tensor"))
    placement = layer.weight.placements[0]
    a, b = ((Replicate(), Shard(0)) if placement == Shard(0) else (Shard(1), Replicate()) if placement == Shard(1)
            else (Replicate(), Replicate()))
    for module, where in ((layer.lora_A, a), (layer.lora_B, b)):
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), layer.weight.device_mesh, [where]))
