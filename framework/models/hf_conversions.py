"""Hugging Face files whose tensors transformers converts on load (the per-expert tensors of
Mixtral, DeepSeek-V3 or Qwen3.5-MoE stacked into one weight, say), read as transformers reads
them: its own conversion mapping for the model says which stored tensors make which model tensor,
and its own operations make it. Only transformers-backed models (framework.models.transformers_model)
take this path; the framework's native models map their names themselves (framework.models.hf)."""
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

Read = Callable[[str], torch.Tensor]  # a stored tensor by its name in the files


@dataclass
class Converted:
    """Model tensors made from stored ones by transformers' operations (a stack of experts)."""
    target: str  # the first model tensor it makes: transformers' name for the group
    sources: List[Tuple[str, str]]  # (the conversion's source pattern, a stored name), in transformers' order
    converter: Any  # transformers' WeightConverter for the group (a fresh copy runs each time)

    def make(self, read: Read, causal: nn.Module) -> Dict[str, torch.Tensor]:
        """The model tensors this group makes, each whole, by name."""
        converter = deepcopy(self.converter)
        for pattern, name in self.sources:
            converter.add_tensor(self.target, name, pattern, partial(read, name))
        return converter.convert(self.target, model=causal, config=causal.config)

    def stored_names(self) -> List[str]:
        return [name for _, name in self.sources]


@dataclass
class StoredLayout:
    """How a transformers model's tensors are stored: `renamed[model name] = stored name` (one
    stored tensor each, read slice by slice), `converted` groups (read whole, then sliced), and
    the stored names no model tensor takes."""
    causal: nn.Module
    renamed: Dict[str, str] = field(default_factory=dict)
    converted: List[Converted] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    made: Dict[str, Tuple[int, List[int]]] = field(default_factory=dict)  # converted: (group, shape) by model name

    def group_of(self, name: str) -> Converted:
        return self.converted[self.made[name][0]]

    def make(self, group: Converted, read: Read) -> Dict[str, torch.Tensor]:
        return group.make(read, self.causal)


def stored_layout(causal: nn.Module, shapes: Dict[str, List[int]]) -> StoredLayout:
    """Where each of `causal`'s tensors is in files holding `shapes` (stored name -> shape), by
    transformers' conversion mapping for the model, grouped as its loader groups them; what each
    group makes is found by running it on meta tensors (the files are not read)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(causal)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    names = causal.state_dict(keep_vars=True)
    layout, groups = StoredLayout(causal), {}
    for stored in sorted(shapes, key=dot_natural_key):
        name, pattern = rename_source_key(stored, renamings, converters, causal.base_model_prefix, names)
        if name not in names and stored in names:  # (transformers' loader: a name the model has stays)
            name, pattern = stored, None
        if name not in names:
            layout.unexpected.append(stored)
        elif pattern is None:
            layout.renamed[name] = stored
        else:
            groups.setdefault(name, Converted(name, [], by_pattern[pattern])).sources.append((pattern, stored))
    layout.converted = list(groups.values())
    on_meta = lambda stored: torch.empty(shapes[stored], device="meta")  # noqa: E731
    for index, group in enumerate(layout.converted):
        for name, tensor in layout.make(group, on_meta).items():
            layout.made[name] = (index, list(tensor.shape))
    return layout


def stored_state(causal: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`state` (whole tensors by the model's names) as the files store it: transformers' own
    reversal of its conversions, what save_pretrained writes (the experts one tensor each again)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(causal, state)
