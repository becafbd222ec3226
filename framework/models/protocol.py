"""What a model offers the framework, declared in one place (torchtitan's TrainSpec, as a base
class): the framework's models subclass ModelProtocol and override what they offer; any other
torch.nn module (a config may name torch.nn.Linear, or a user's model) trains with the defaults,
which `offered` stands in for. The framework asks `offered(model)`, never whether an attribute
happens to exist."""
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn


class ModelProtocol:
    """The defaults: built from the config (no Hugging Face source), no tied weights, nothing a
    TP plan must cover, no FLOPs count (no MFU), nothing more to log, no context parallelism."""

    hf_path: Optional[str] = None    # the Hugging Face directory the weights come from (framework.models.hf)
    model_type: str = "llama"        # its config.json's model_type: how its parameter names map to HF's
    tie_word_embeddings: bool = False  # the output projection is the embedding matrix
    supports_context_parallel: bool = False  # use_context_parallel splits its sequences over CP ranks
    declares_init: bool = False  # init_weights draws its starting weights: it is built on meta
    # Auxiliary loss terms (a mixture of experts' load balancing): the last training forward's, by
    # name, each a sum over its micro-batch's tokens (None: the model reports none), and each
    # term's own weight (objective.aux_coefficients wins; a term without either is refused).
    auxiliary_losses: Optional[Dict[str, Any]] = None
    aux_coefficients: Mapping[str, float] = MappingProxyType({})

    def init_weights(self, seed: int) -> None:
        """The declared starting weights of the parameters (or shards) this rank holds, drawn once
        the model, built on meta, was sharded and given storage (framework.models.lifecycle): a
        model that declares it (declares_init) is never whole on a rank."""
        raise NotImplementedError(f"{type(self).__name__} declares no starting weights of its own")

    def output_layer(self) -> Optional[nn.Module]:
        """The output projection (final hidden states -> logits), which the loss owns: it scores
        it whole, at chosen positions or by chunks (framework.training.objectives.head). With one,
        `forward(..., skip_output=True)` returns the hidden states it projects; None: the loss
        reads the forward's own outputs."""
        return None

    def tie_weights(self) -> None:
        """Tie what tie_word_embeddings ties again (after TP replaced the parameters)."""

    def tp_sharded_counts(self) -> Dict[str, int]:
        """Counts a TP plan splits whole across ranks, by config key (checked before launch)."""
        return {}

    def tp_plan_must_cover(self) -> Dict[str, str]:
        """Modules a TP plan must name, each with why (checked before launch)."""
        return {}

    def flops_per_token(self, seq_len: int) -> Optional[int]:
        """Training FLOPs per token (MFU, the planner's step time); None: not counted."""
        return None

    def logged_metrics(self) -> Dict[str, float]:
        """What TensorBoard shows of the model at a logging step (every rank calls it)."""
        return {}

    def use_context_parallel(self, cp: Any) -> None:
        """Split each sequence over the CP ranks `cp` describes (framework.parallel.context_parallel);
        only a model whose supports_context_parallel says so is asked."""
        raise NotImplementedError(f"{type(self).__name__} has no attention to split sequences for")


_DEFAULTS = ModelProtocol()


def offered(model: nn.Module) -> ModelProtocol:
    """The model's protocol: its own when it declares one, else the defaults."""
    return model if isinstance(model, ModelProtocol) else _DEFAULTS


def from_hugging_face(model: nn.Module) -> bool:
    """Whether the model's weights come from a Hugging Face directory (loaded after sharding)."""
    return offered(model).hf_path is not None


def project(output: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`output` (a model's output_layer) on hidden states a forward returned with skip_output. Out
    of autocast, in the layer's own dtype (FSDP2's bf16 parameters, whose root casts what its
    forward returns to fp32), the logits back in the hidden states' dtype, as that root would."""
    weight = getattr(output, "weight", None)
    dtype = weight.dtype if weight is not None and weight.dtype.is_floating_point else hidden.dtype
    if dtype == hidden.dtype or torch.is_autocast_enabled(hidden.device.type):
        return output(hidden)
    return output(hidden.to(dtype)).to(hidden.dtype)
