"""LoRA adapters (Hu et al. 2021) in PEFT's layout, added before any parallelism (the
`adapters` stage) so every later stage sees them as ordinary parameters.

Each targeted nn.Linear keeps its weight (frozen, as every other base parameter) and gains two
children, `lora_A` (rank x in) and `lora_B` (out x rank), and a forward hook that adds
(alpha / rank) * lora_B(lora_A(dropout(x))) to its output: parameter names end in
`<layer>.lora_A.weight` / `.lora_B.weight`, PEFT's, so the export (framework.export --format
peft) only maps the layer's path. A starts as PEFT's (kaiming-uniform with a = sqrt(5)) from a
generator seeded with trainer.seed and the layer's name, the same on every mesh whatever the model's device (a
Hugging Face model is allocated only after sharding: `init_adapters` runs again then); B starts
at zero, so step 0's model is the base model.
"""
import json
import math
import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from framework.config.errors import ConfigError
from framework.config.checked import Checked
from framework.models.adapter_names import adapter_layers, is_adapter, targets_of
from framework.models.vision import outside_language_pattern
from framework.models.hf import hf_name
from framework.models.initialization import parameter_generator
from framework.models.nf4 import dequantized
from framework.models.protocol import from_hugging_face, offered
from framework.parallel.dtensors import place_whole

def _add_update(layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    if layer.lora_off:
        return output
    return output + layer.lora_B(layer.lora_A(layer.lora_dropout(args[0]))) * layer.lora_scaling


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone: every adapter skipped (DPO's reference, as TRL's and torchtune's
    `disable_adapter`: no second copy of the weights)."""
    layers = [layer for _, layer in adapter_layers(model)]
    for layer in layers:
        layer.lora_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_off = False


def add_adapters(model: nn.Module, rank: int, alpha: float, dropout: float, targets: List[str], seed: int) -> None:
    """LoRA on every targeted layer, the base frozen (checks in check_adapter)."""
    for param in model.parameters():
        param.requires_grad_(False)
    for _, layer in targets_of(model, targets):
        device = layer.weight.device
        layer.lora_A = nn.Linear(layer.in_features, rank, bias=False, device=device)
        layer.lora_B = nn.Linear(rank, layer.out_features, bias=False, device=device)
        layer.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        layer.lora_scaling, layer.lora_off = alpha / rank, False
        layer.register_forward_hook(_add_update)
    init_adapters(model, seed)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """A as PEFT initializes it (drawn whole on CPU from a generator seeded by `seed` and the
    layer's name, then placed like the parameter: the same values on every mesh, and on a
    pipeline stage that holds only some of the layers), B zero."""
    for name, layer in adapter_layers(model):
        generator = parameter_generator(seed, name, "cpu")
        full = torch.empty(layer.lora_A.weight.shape)
        bound = 1 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), times sqrt(3 / fan_in)
        full.uniform_(-bound, bound, generator=generator)
        place_whole(layer.lora_A.weight, full)
        place_whole(layer.lora_B.weight, torch.zeros(layer.lora_B.weight.shape))


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state dict (whole tensors, one process) with each adapted weight merged,
    W + (alpha / rank) B A (W a QLoRA weight's NF4 values), and the adapters left out: a plain
    model that computes the same."""
    state = {name: t for name, t in model.state_dict().items() if not is_adapter(name)}
    for name, layer in adapter_layers(model):
        weight = dequantized(layer.weight)
        state[f"{name}.weight"] = weight + layer.lora_scaling * layer.lora_B.weight @ layer.lora_A.weight
    return state


def peft_adapter(model: nn.Module, adapter) -> Tuple[Dict[str, torch.Tensor], dict]:
    """PEFT's adapter_model.safetensors tensors and adapter_config.json for the model's adapters
    (whole tensors, one process; names from peft_names)."""
    params = dict(model.named_parameters())
    tensors = {theirs: params[ours].detach().contiguous() for theirs, ours in peft_names(model).items()}
    modules = {theirs.split(".lora_")[0].rsplit(".", 1)[-1] for theirs in tensors}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank, "lora_alpha": adapter.alpha,
              "lora_dropout": adapter.dropout, "target_modules": sorted(modules), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "base_model_name_or_path": offered(model).hf_path}
    if getattr(offered(model), "vision", False):  # (the vision tower's layers share the targets' names)
        config["exclude_modules"] = outside_language_pattern()
    return tensors, config


def peft_names(model: nn.Module) -> Dict[str, str]:
    """PEFT's tensor name -> our parameter name, for this model's adapters:
    `base_model.model.<the layer's path>.lora_A.weight`, the path Hugging Face's for a model
    loaded from one, else the framework's."""
    hf = _hf_naming(model)
    return {f"base_model.model.{hf(name + '.weight')[:-len('.weight')] if hf else name}.{part}.weight":
            f"{name}.{part}.weight" for name, _ in adapter_layers(model) for part in ("lora_A", "lora_B")}


def _hf_naming(model: nn.Module):
    if not from_hugging_face(model) or offered(model).hf_names:  # (transformers' classes: the names are theirs)
        return None
    return lambda name: hf_name(name, offered(model).model_type)


def read_peft_adapter(path: str, key: str = "adapter.init_from") -> Tuple[dict, Dict[str, torch.Tensor]]:
    """adapter_config.json and adapter_model.safetensors of a PEFT adapter directory (given as `key`)."""
    from safetensors.torch import load_file

    files = [os.path.join(path, name) for name in ("adapter_config.json", "adapter_model.safetensors")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ConfigError(key, path, f"holds no {os.path.basename(missing[0])}: not a PEFT adapter directory (PEFT's "
                                     f"save_pretrained, or framework.export --format peft, writes both files)")
    with open(files[0]) as f:
        return json.load(f), load_file(files[1])


def check_init_from(adapter, model: nn.Module, key: str = "adapter.init_from") -> None:
    """The PEFT adapter fits this run's: LoRA, its rank and alpha, and exactly our adapters'
    tensors with their shapes (so its targets are ours)."""
    config, tensors = read_peft_adapter(adapter.init_from, key)
    for name, ours in (("peft_type", "LORA"), ("r", adapter.rank), ("lora_alpha", adapter.alpha)):
        if config.get(name) != ours:
            setting = {"peft_type": "adapter.kind", "r": "adapter.rank", "lora_alpha": "adapter.alpha"}[name]
            raise ConfigError(key, adapter.init_from, f"its adapter_config.json has {name}={config.get(name)!r}, and "
                                                      f"this run's {setting} means {ours!r}; set it to match")
    names = peft_names(model)
    params = dict(model.named_parameters())
    if set(tensors) != set(names):
        extra, lacking = sorted(set(tensors) - set(names)), sorted(set(names) - set(tensors))
        raise ConfigError(key, adapter.init_from,
                          f"its tensors are not this run's adapters (adapter.targets={list(adapter.targets)}): "
                          f"{len(lacking)} missing (e.g. {lacking[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
    for theirs, ours in names.items():
        if list(tensors[theirs].shape) != list(params[ours].shape):
            raise ConfigError(key, adapter.init_from, f"{theirs} is {list(tensors[theirs].shape)}, this model's "
                                                      f"{list(params[ours].shape)}")


def add_peft_adapter(model: nn.Module, path: str, key: str) -> None:
    """A PEFT adapter directory's LoRA layers (its targets, rank and alpha; checked to hold its
    tensors, which load_peft_adapter then loads) on a model that has none: framework.generate
    --adapter."""
    config, _ = read_peft_adapter(path, key)
    wanted = config.get("target_modules")
    if not isinstance(wanted, list) or config.get("peft_type") != "LORA":
        raise ConfigError(key, path, "its adapter_config.json is not LoRA with a list of target_modules, the adapters "
                                     "this framework reads")
    hf = _hf_naming(model) or (lambda name: name)
    targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                      if isinstance(m, nn.Linear) and hf(f"{name}.weight")[:-len(".weight")].rsplit(".", 1)[-1] in wanted})
    if not targets:
        raise ConfigError(key, path, f"its target_modules {sorted(wanted)} name no linear layer of this model")
    add_adapters(model, config["r"], config["lora_alpha"], 0.0, targets, seed=0)
    check_init_from(SimpleNamespace(init_from=path, rank=config["r"], alpha=config["lora_alpha"], targets=targets),
                    model, key)


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str) -> None:
    """A PEFT adapter's tensors into the adapters (each rank its own shards)."""
    _, tensors = read_peft_adapter(path)
    params = dict(model.named_parameters())
    for theirs, ours in peft_names(model).items():
        if ours in params:  # (a pipeline stage holds only its own layers)
            place_whole(params[ours], tensors[theirs].float())


def check_adapter(cfg, model: nn.Module) -> None:
    """Before launch, on the base model (validation adds the adapters after it): a kind it knows,
    targets that exist, a rank they can hold, a positive alpha, a dropout probability."""
    adapter = cfg.adapter
    if adapter.kind == "none":
        return
    if adapter.kind not in ("lora", "qlora"):
        raise ConfigError("adapter.kind", adapter.kind, "use none, lora or qlora (conf/adapter/)")
    if not adapter.targets:
        raise ConfigError("adapter.targets", [], "names no layer; name the linear layers to adapt, e.g. [wq, wv]")
    layers = targets_of(model, list(adapter.targets))
    smallest = min(min(layer.in_features, layer.out_features) for _, layer in layers)
    if not 1 <= adapter.rank <= smallest:
        raise ConfigError("adapter.rank", adapter.rank, f"must be between 1 and {smallest}, the smallest dimension of "
                                                        f"the targeted layers")
    if not adapter.alpha > 0:
        raise ConfigError("adapter.alpha", adapter.alpha, "must be > 0: the update is scaled by alpha / rank")
    if not 0 <= adapter.dropout < 1:
        raise ConfigError("adapter.dropout", adapter.dropout, "must be in [0, 1): the probability of zeroing an input")


def check_adapter_init_from(c: Checked) -> None:
    """adapter.init_from's PEFT adapter fits the run's adapted model."""
    if c.cfg.adapter.kind != "none" and c.cfg.adapter.get("init_from"):
        check_init_from(c.cfg.adapter, c.model)
