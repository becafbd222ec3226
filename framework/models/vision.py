"""What a vision-language model adds to transformers' classes (framework.models.transformers_model):
its parts by role, freezing them (`model.freeze`), and a batch's images as the model's own inputs.

The roles are read off transformers' module names, which its VLM classes share: the vision tower
(`vision_tower`, Qwen's `visual`), the projector into the language model's embeddings
(`multi_modal_projector`) and the language model (everything else: `language_model`, `lm_head`).
LoRA adapts the language model's layers alone (framework.models.adapter_names.targets_of).

A batch's images come per sample (framework.data.vision): `pixels` [batch, slots, ...] with
`image_counts` [batch] of them real, the rest padding. The model takes the real ones in the
samples' order, as its processor would have stacked them. A micro-batch without an image still
runs the vision tower once, on a padding slot, and adds its output times 0: under FSDP2 every
rank must gather the tower's weights as its peers do, and DDP must see its gradient, whichever
samples a rank drew.
"""
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from framework.config.errors import ConfigError

ROLES = ("vision", "projector", "language")
_ROLE_MODULES = {"vision": ("vision_tower", "visual", "vision_model"),
                 "projector": ("multi_modal_projector", "mm_projector")}


def role_of(name: str) -> str:
    """The role of the parameter or module `name` (Hugging Face's dotted name)."""
    parts = name.split(".")
    for role in ("projector", "vision"):  # (Qwen's projector, `visual.merger`, sits inside its tower)
        if any(module in parts for module in _ROLE_MODULES[role]) or (role == "projector" and "merger" in parts):
            return role
    return "language"


def outside_language_pattern() -> str:
    """A regex that fully matches the module names outside the language model (PEFT's
    exclude_modules: its adapters are the language model's alone, as the run's)."""
    return rf"(.*\.)?({'|'.join(_ROLE_MODULES['vision'] + _ROLE_MODULES['projector'])})(\..*)?"


def freeze(model: nn.Module, roles: Sequence[str], path: str) -> Dict[str, int]:
    """`roles`' parameters frozen (no gradient, no optimizer state); the parameters each role
    holds, for the run's line on what trains."""
    unknown = [role for role in roles if role not in ROLES]
    if unknown:
        raise ConfigError("model.freeze", list(roles), f"no such part {unknown[0]!r}; the parts are {', '.join(ROLES)}")
    counts = dict.fromkeys(ROLES, 0)
    for name, param in model.named_parameters():
        role = role_of(name)
        counts[role] += param.numel()
        if role in roles:
            param.requires_grad_(False)
    empty = [role for role in roles if counts[role] == 0]
    if empty:
        raise ConfigError("model.freeze", list(roles), f"the model in {path} has no {empty[0]} parameters")
    return counts


def _features(output) -> torch.Tensor:
    """A get_image_features result as one tensor (a tensor, a tuple or list of them, or a model
    output with its pooled or last hidden state)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return torch.cat([_features(o).flatten() for o in output])
    pooled = getattr(output, "pooler_output", None)
    return _features(pooled if pooled is not None else output.last_hidden_state)


def image_inputs(base: nn.Module, pixels: Optional[torch.Tensor], image_counts: Optional[torch.Tensor],
                 token_types: Optional[torch.Tensor]) -> tuple:
    """The model's keyword inputs for a micro-batch's images, and the term (0 or a 0-valued tensor
    of the tower's output) the forward adds to its output so every rank used the tower."""
    inputs = {} if token_types is None else {"token_type_ids": token_types}
    if pixels is None:  # a text-only dataset: the tower unused on every rank alike
        return inputs, 0
    real = torch.arange(pixels.shape[1], device=pixels.device)[None] < image_counts[:, None]
    if bool(real.any()):
        return {**inputs, "pixel_values": pixels[real]}, 0
    return inputs, _features(base.get_image_features(pixel_values=pixels[:1, 0])).sum() * 0


def parts_line(counts: Dict[str, int], frozen: List[str]) -> str:
    """What trains, by part: `vision 1.2M frozen, projector 0.1M, language 30.5M`."""
    return ", ".join(f"{role} {counts[role] / 1e6:.2f}M{' frozen' if role in frozen else ''}" for role in ROLES)


def check_vision(c) -> None:
    """Before launch: data=vision's records for a vision-language model, by SFT, and
    data=vision_preferences' pairs by DPO or SimPO (the objectives that read images so far); a
    vision-language model on text alone only when asked (its tower and projector frozen). (Its
    meshes: framework.models.transformers_model's checks.)"""
    model, cfg = c.model, c.cfg
    target = str((cfg.data.get("dataset") or {}).get("_target_", ""))
    vision_data = target.endswith(("VisionDataset", ".VisionPreferenceDataset"))  # (data=vision, hf_vision, pairs)
    if vision_data and not getattr(model, "vision", False):
        raise ConfigError("data", "vision", f"needs a vision-language model (transformers' classes, a config.json with "
                                            f"a vision_config); {type(model).__name__} is not one: for text, use "
                                            f"data=hf_instructions")
    frozen = set(getattr(model, "frozen", ()))
    if getattr(model, "vision", False) and not vision_data and not {"vision", "projector"} <= frozen:
        data = cfg.data.dataset._target_.rpartition(".")[2]
        raise ConfigError("data.dataset", data, f"holds no images, and {model.model_type} is a vision-language model: "
                                                f"use data=vision, or train its language model on text alone with "
                                                f"model.freeze=[vision,projector]")
    pairs = target.endswith(".VisionPreferenceDataset")
    objective = str(cfg.objective.get("_target_", "")).rpartition(".")[2]
    if vision_data and not pairs and objective != "NextTokenCrossEntropy":
        raise ConfigError("objective", objective, "data=vision trains by SFT (objective=lm); for objective=dpo or "
                                                  "simpo give pairs with data=vision_preferences")
    if pairs and objective not in ("DirectPreference", "SimplePreference"):
        raise ConfigError("objective", objective, "data=vision_preferences trains by objective=dpo or simpo so far")
    if pairs and cfg.objective.get("reference") == "precomputed":
        raise ConfigError("objective.reference", "precomputed", "is stored beside prepared token data, and "
                                                                "data=vision_preferences is read as it is: use "
                                                                "frozen_copy or adapters_off")
