"""Tensor-parallel plan checks: does each entry name a known style with options it takes,
match a module it can apply to, and shard sizes the TP degree divides.

A plan maps a module FQN (with `*` wildcards per name segment, as parallelize_module accepts)
to a style name and its options. Layouts are written `replicate`, `shard(D)` or null (or a list
of those, one per input). Checking needs no DTensor import, so the launcher stays light;
framework.parallel.tensor_parallel turns a checked plan into ParallelStyle objects.
"""
import fnmatch
import inspect
import re
from typing import Any, List, Mapping, Optional, Tuple

import torch.fx
from torch import nn

from framework.config.errors import ConfigError

# style name -> the options it accepts (torch's keyword arguments). Options left null are not passed.
STYLE_OPTIONS = {
    "colwise": ("input_layouts", "output_layouts", "use_local_output"),
    "rowwise": ("input_layouts", "output_layouts", "use_local_output"),
    "sequence_parallel": ("sequence_dim", "use_local_output"),
    "prepare_module_input": ("input_layouts", "desired_input_layouts", "use_local_output"),
    "prepare_module_output": ("output_layouts", "desired_output_layouts", "use_local_output"),
    "prepare_module_input_output": ("input_layouts", "desired_input_layouts", "output_layouts",
                                    "desired_output_layouts", "use_local_output"),
}
LAYOUT_OPTIONS = {"input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts"}
ALL_OPTIONS = LAYOUT_OPTIONS | {"use_local_output", "sequence_dim"}
# Styles that shard a weight: only these module types have a sharding rule in torch.
SHARDING_STYLES = {"colwise", "rowwise"}
SHARDABLE_MODULES = (nn.Linear, nn.Embedding)

LAYOUT = re.compile(r"^(replicate|shard\((-?\d+)\))$")


def check_layout(key: str, value: Any) -> None:
    """A layout is `replicate`, `shard(D)`, null, or a list of those."""
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            check_layout(key, v)
    elif not LAYOUT.match(str(value).strip().lower()):
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
        if style not in STYLE_OPTIONS:
            raise ConfigError(f"{key}.style", style, f"use one of: {', '.join(STYLE_OPTIONS)}")
        accepted = STYLE_OPTIONS[style]
        for option in ALL_OPTIONS - set(accepted):
            if entry.get(option) is not None:
                raise ConfigError(f"{key}.{option}", entry.get(option),
                                  f"{style} does not take {option}; it takes: {', '.join(accepted)}")
        for option in LAYOUT_OPTIONS & set(accepted):
            check_layout(f"{key}.{option}", entry.get(option))
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


def _option(entry: Mapping[str, Any], key: str, default: Any) -> Any:
    return default if entry.get(key) is None else entry[key]


def final_output_layout(entry: Mapping[str, Any]) -> Tuple[Any, bool]:
    """The layout a style leaves its module's output in, with torch's defaults, and whether it
    hands on a local tensor (use_local_output) rather than a DTensor."""
    style = entry["style"]
    if style == "colwise":
        return _option(entry, "output_layouts", "shard(-1)"), _option(entry, "use_local_output", True)
    if style == "rowwise":
        return _option(entry, "output_layouts", "replicate"), _option(entry, "use_local_output", True)
    if style == "sequence_parallel":
        return f"shard({_option(entry, 'sequence_dim', 1)})", _option(entry, "use_local_output", False)
    if style in ("prepare_module_output", "prepare_module_input_output"):
        return entry.get("desired_output_layouts"), _option(entry, "use_local_output", True)
    return None, True


def vocabulary_sharded(plan: Optional[Mapping[str, Any]], tp_size: int) -> bool:
    """Whether the logits reach the loss as a DTensor sharded on the vocabulary: the plan's
    `output` entry leaves them shard(-1) (or shard(2)) and hands on the DTensor (use_local_output
    false). Such a loss runs under torch's loss_parallel, forward and backward: the one place that
    decides it (the Trainer enters it)."""
    entry = (plan or {}).get("output")
    if tp_size <= 1 or not entry:
        return False
    layout, local = final_output_layout(entry)
    return not local and str(layout).replace(" ", "").lower() in ("shard(-1)", "shard(2)")


def output_module(model: nn.Module) -> Optional[str]:
    """The module whose forward returns the model's output, from torch.fx's symbolic trace (no
    tensors, milliseconds); None when the trace fails (data-dependent control flow, say) or the
    output is computed outside a module."""
    # arguments with defaults (a decoding cache, say) are traced as their defaults
    defaults = {name: p.default for name, p in inspect.signature(model.forward).parameters.items()
                if p.default is not inspect.Parameter.empty}
    try:
        graph = torch.fx.symbolic_trace(model, concrete_args=defaults).graph
    except Exception:  # noqa: BLE001 - untraceable models skip the check; their loss shows the layout
        return None
    (returned,) = [node for node in graph.nodes if node.op == "output"][0].args
    return returned.target if isinstance(returned, torch.fx.Node) and returned.op == "call_module" else None


def check_output_layout(plan: Mapping[str, Mapping[str, Any]], model: nn.Module, tp_size: int) -> None:
    """The model's output reaches the loss whole, or as a DTensor sharded on the vocabulary (the
    loss then runs under torch's loss_parallel). Output left as local shards gives the loss a
    slice of the logits: a shape error at best, a wrong loss at worst."""
    if tp_size == 1 or not plan:
        return
    output = output_module(model)
    for pattern, entry in plan.items():
        if pattern != ROOT and output not in matching_modules(model, pattern):
            continue
        layout, local = final_output_layout(entry)
        if local and isinstance(layout, str) and layout.strip().lower().startswith("shard"):
            raise ConfigError(f"plan.{pattern}", dict(entry),
                              f"{entry['style']} leaves the model's output ({output if pattern != ROOT else 'the model'}) "
                              f"as local shards ({layout}) on each of the {tp_size} TP ranks, so the loss would see "
                              f"only a slice of it; set output_layouts: replicate, or output_layouts: shard(-1) with "
                              f"use_local_output: false to compute the loss on the sharded logits (loss_parallel)")


def shards_sequence(plan) -> bool:
    """Whether the plan has sequence parallelism: activations split on the sequence between
    blocks, so every forward's sequence must divide by the TP size."""
    return any((entry or {}).get("style") == "sequence_parallel" for entry in (plan or {}).values())
