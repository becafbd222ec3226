"""The names by which LoRA adapters are found, read by the adapters (framework.models.lora), the
NF4 base they wrap (framework.models.nf4) and the Hugging Face names (framework.models.hf):
PEFT's `<layer>.lora_A.weight` / `.lora_B.weight` under each targeted nn.Linear."""
from typing import Iterator, List, Tuple

from torch import nn

from framework.config.errors import ConfigError

ADAPTER_PARAMETERS = (".lora_A.", ".lora_B.")
CHILDREN = ("lora_A", "lora_B", "lora_dropout")  # what add_adapters puts under a layer


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARAMETERS)


def adapter_layers(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    return ((name, m) for name, m in model.named_modules() if hasattr(m, "lora_A"))


def targets_of(model: nn.Module, targets: List[str]) -> List[Tuple[str, nn.Linear]]:
    """The model's linear layers whose name ends in one of `targets`, or one line naming the
    target that matches nothing and the candidates."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for target in targets:
        if not any(name.rsplit(".", 1)[-1] == target for name, _ in linears):
            candidates = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
            raise ConfigError("adapter.targets", list(targets), f"{target!r} names no linear layer of "
                                                                f"{type(model).__name__}; its linear layers end in "
                                                                f"{candidates}")
    return [(name, m) for name, m in linears if name.rsplit(".", 1)[-1] in targets]

