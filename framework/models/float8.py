"""float8: the model's linear layers computing in float8 (torchao's Float8Linear), as
torchtitan's float8 converter does. Each converted layer casts its input, weight and output
gradient to float8 e4m3 with a dynamic scale (one per tensor: `tensorwise`; one per row:
`rowwise`) and multiplies them with torch._scaled_mm; its weight stays a high-precision
parameter, so the optimizer, checkpoints and the parallel stages see an nn.Linear's weight.

Converted: every nn.Linear whose two dims are multiples of 16 (the float8 GEMM's tile), but the
output projection (`output`, a Hugging Face model's `lm_head`), whose logits float8 would
coarsen most (torchtitan keeps it too). The conversion runs before the parallel stages, as
torchtitan converts before TP, compile and FSDP2. Under FSDP2 a tensorwise weight is cast to
float8 before its all-gather (torchao's enable_fsdp_float8_all_gather), halving its bytes.

torchao is an optional extra (pip install -e '.[float8]'), imported here only, when used.
"""
import dataclasses
import logging
import re
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.nf4 import torchao_quietly

RECIPES = ("tensorwise", "rowwise")
KEPT = ("output", "lm_head")  # the output projections, kept in high precision
TILE = 16  # float8 GEMMs need both dims of a weight a multiple of this

log = logging.getLogger("framework")


def float8_recipe(cfg: Any) -> Optional[str]:
    """float8's recipe name; None when off (null)."""
    value = cfg.get("float8")
    return None if value is None or value is False else str(value)


def _torchao() -> Tuple[Any, Callable]:
    """torchao's Float8LinearConfig and convert_to_float8_training, imported quietly."""
    with torchao_quietly():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return Float8LinearConfig, convert_to_float8_training


def convertible(module: nn.Module, fqn: str) -> bool:
    """A linear layer float8 can multiply (both dims whole tiles) that is not an output projection."""
    return (isinstance(module, nn.Linear) and module.in_features % TILE == 0 and module.out_features % TILE == 0
            and fqn.split(".")[-1] not in KEPT)


def float8_config(recipe: str, fsdp_all_gather: bool = False) -> Any:
    """torchao's config of the recipe; with `fsdp_all_gather` (tensorwise only: torchao casts
    rowwise weights after the gather) FSDP2 gathers the weights in float8."""
    Float8LinearConfig, _ = _torchao()
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def apply_float8(model: nn.Module, recipe: str, fsdp_all_gather: bool = False) -> List[str]:
    """Swap the convertible linear layers for Float8Linear in place (weights kept, meta ones too);
    return their names."""
    _, convert = _torchao()
    converted: List[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        chosen = convertible(module, fqn)
        if chosen:
            converted.append(fqn)
        return chosen

    convert(model, config=float8_config(recipe, fsdp_all_gather), module_filter_fn=keep)
    say_converted(model, recipe, converted)
    return converted


def say_converted(model: nn.Module, recipe: str, converted: List[str]) -> None:
    """Log what became Float8Linear (the count; the names, a layer index as *), or that nothing did."""
    if not converted:
        log.warning("float8=%s converted no layer of %s: float8 takes an nn.Linear (not the output "
                    "projection) whose dims are both multiples of %d, and it has none; it trains unconverted",
                    recipe, type(model).__name__, TILE)
        return
    names = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in converted)
    log.info("float8=%s: %d linear layers as Float8Linear: %s", recipe, len(converted), ", ".join(names))


def check_float8(c: Checked) -> None:
    """Before launch (float8 set): a known recipe, torchao installed, and a device whose
    float8 matmuls exist (CUDA sm_89+: Ada, Hopper, Blackwell; the CPU's run, slowly)."""
    recipe = float8_recipe(c.cfg)
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ConfigError("float8", recipe, "unknown recipe; choose tensorwise or rowwise (null: off)")
    try:
        _torchao()
    except ImportError:
        raise ConfigError("float8", recipe, "needs torchao (pip install -e '.[float8]')") from None
    if c.cfg.mesh.device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError("float8", recipe, f"float8 matmuls need a CUDA device of compute capability "
                                                        f"8.9 or newer (Ada, Hopper); this one is sm_{major}{minor}; "
                                                        f"use float8=null")
