"""Tensor-parallel plan: YAML entries -> torch ParallelStyle objects, plus the checks
that need the model (does a key match a module, can the style apply to it, does it divide).

A plan maps a module FQN (with `*` wildcards per name segment, as parallelize_module accepts)
to a style name and its options. Layouts are written `replicate`, `shard(D)` or null.
"""
import fnmatch
import re
from typing import Any, Dict, List, Mapping, Optional

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from framework.errors import ConfigError

# style name -> (class, options it accepts). Options left null in YAML are not passed.
STYLES = {
    "colwise": (ColwiseParallel, ("input_layouts", "output_layouts", "use_local_output")),
    "rowwise": (RowwiseParallel, ("input_layouts", "output_layouts", "use_local_output")),
    "sequence_parallel": (SequenceParallel, ("sequence_dim", "use_local_output")),
    "prepare_module_input": (
        PrepareModuleInput,
        ("input_layouts", "desired_input_layouts", "use_local_output"),
    ),
    "prepare_module_output": (
        PrepareModuleOutput,
        ("output_layouts", "desired_output_layouts", "use_local_output"),
    ),
    "prepare_module_input_output": (
        PrepareModuleInputOutput,
        ("input_layouts", "desired_input_layouts", "output_layouts", "desired_output_layouts", "use_local_output"),
    ),
}
LAYOUT_OPTIONS = {"input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts"}
ALL_OPTIONS = {"input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts",
               "use_local_output", "sequence_dim"}
# Styles that shard a weight: only these module types have a sharding rule in torch.
SHARDING_STYLES = {"colwise", "rowwise"}
SHARDABLE_MODULES = (nn.Linear, nn.Embedding)

_SHARD = re.compile(r"^shard\((-?\d+)\)$")


def parse_layout(key: str, value: Any) -> Optional[Placement] | tuple:
    """`replicate` -> Replicate(), `shard(d)` -> Shard(d), null -> None, a list -> tuple of those."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(parse_layout(key, v) for v in value)
    text = str(value).strip().lower()
    if text == "replicate":
        return Replicate()
    match = _SHARD.match(text)
    if match:
        return Shard(int(match.group(1)))
    raise ConfigError(key, value, "write a layout as replicate, shard(D) or null")


ROOT = "."  # the plan key that names the model itself


def matching_modules(model: nn.Module, pattern: str) -> List[str]:
    """Module FQNs matched by `pattern`, segment by segment, as parallelize_module matches them."""
    if pattern == ROOT:
        return [""]
    parts = pattern.split(".")
    return [
        name
        for name, _ in model.named_modules()
        if name and len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(n, p) for n, p in zip(name.split("."), parts))
    ]


def _check_divisible(key: str, name: str, module: nn.Module, style: str, tp_size: int) -> None:
    if isinstance(module, nn.Linear):
        dim_name, size = ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
    else:  # nn.Embedding: colwise shards the embedding dim, rowwise the vocabulary
        dim_name, size = ("embedding_dim", module.embedding_dim) if style == "colwise" else ("num_embeddings", module.num_embeddings)
    if size % tp_size:
        raise ConfigError(
            key, style,
            f"{style} shards {name}.{dim_name}={size}, which the TP size {tp_size} does not divide; "
            f"pick a TP size that divides {size} or change the model's sizes",
        )


def check_plan(plan: Mapping[str, Mapping[str, Any]], model: nn.Module, tp_size: int) -> None:
    """Every entry names a known style with known options and matches a module it can apply to."""
    modules = dict(model.named_modules())
    if ROOT in plan and len(plan) > 1:
        raise ConfigError(f"plan.{ROOT}", plan[ROOT], "a plan for the model itself (key '.') must be its only entry")
    for pattern, entry in plan.items():
        key = f"plan.{pattern}"
        if not isinstance(entry, Mapping):
            raise ConfigError(key, entry, "give a mapping such as {style: colwise}")
        unknown = set(entry) - ALL_OPTIONS - {"style"}
        if unknown:
            raise ConfigError(f"{key}.{sorted(unknown)[0]}", entry[sorted(unknown)[0]],
                              f"not a plan option; options are: style, {', '.join(sorted(ALL_OPTIONS))}")
        style = entry.get("style")
        if style not in STYLES:
            raise ConfigError(f"{key}.style", style, f"use one of: {', '.join(STYLES)}")
        accepted = STYLES[style][1]
        for option in ALL_OPTIONS - set(accepted):
            if entry.get(option) is not None:
                raise ConfigError(f"{key}.{option}", entry.get(option),
                                  f"{style} does not take {option}; it takes: {', '.join(accepted)}")
        for option in LAYOUT_OPTIONS & set(accepted):
            parse_layout(f"{key}.{option}", entry.get(option))
        names = matching_modules(model, pattern)
        if not names:
            known = ", ".join(n for n in modules if n) + f" (or {ROOT} for the model itself)"
            raise ConfigError(key, pattern, f"it matches no module of the model; its modules are: {known}")
        if style in SHARDING_STYLES:
            for name in names:
                module = modules[name]
                if not isinstance(module, SHARDABLE_MODULES):
                    raise ConfigError(
                        f"{key}.style", style,
                        f"{name or 'the model'} is a {type(module).__name__}; {style} applies only to nn.Linear and "
                        f"nn.Embedding: point it at a Linear/Embedding or use another style",
                    )
                _check_divisible(key, name, module, style, tp_size)


def build_plan(plan: Mapping[str, Mapping[str, Any]]) -> ParallelStyle | Dict[str, ParallelStyle]:
    """What parallelize_module takes: FQN pattern -> ParallelStyle, or one style for the root."""
    built = {}
    for pattern, entry in plan.items():
        cls, accepted = STYLES[entry["style"]]
        kwargs = {}
        for option in accepted:
            value = entry.get(option)
            if value is not None:
                kwargs[option] = parse_layout(f"plan.{pattern}.{option}", value) if option in LAYOUT_OPTIONS else value
        built[pattern] = cls(**kwargs)
    return built.pop(ROOT) if ROOT in built else built
