"""What a model offers the framework, declared in one place (torchtitan's TrainSpec, as a base
class): the framework's models subclass ModelProtocol and override what they offer; any other
torch.nn module (a config may name torch.nn.Linear, or a user's model) trains with the defaults,
which `offered` stands in for. The framework asks `offered(model)`, never whether an attribute
happens to exist: framework.parallel and framework.training.compile import nothing else of the
models, so a model the framework did not write declares what they use the same way."""
from contextlib import nullcontext
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from framework.models.adapter_names import adapters_set_aside
from framework.models.nf4 import is_nf4


class ModelProtocol:
    """The defaults: built from the config (no Hugging Face source), no tied weights, nothing a
    TP plan must cover, no FLOPs count (no MFU), nothing more to log, no context parallelism, no
    blocks to compile, no experts. They read the model as a module (self.children(), ...)."""

    hf_path: Optional[str] = None    # the Hugging Face directory the weights come from (framework.models.hf)
    model_type: str = "llama"        # its config.json's model_type: how its parameter names map to HF's
    tie_word_embeddings: bool = False  # the output projection is the embedding matrix
    supports_context_parallel: bool = False  # use_context_parallel splits its sequences over CP ranks
    declares_init: bool = False  # init_weights draws its starting weights: it is built on meta
    hf_names: bool = False  # its parameter names are Hugging Face's (transformers' own modules)
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

    def init_buffers(self) -> None:
        """The buffers no weight file holds, computed again once the model built on meta has
        storage (garbage until then); by default none."""

    def own_decoder(self, pad: torch.Tensor) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The model's own KV-cache decoding, for the framework's decoder (framework.models.decode)
        to sample from: a function of the next tokens (rows, k), which follow those it was given
        before in rows left-padded by `pad` (rows,), to the logits at the last of them (rows,
        vocab). None: the decoder runs the framework's Transformer with its own StaticCache."""
        return None

    def input_embeddings(self) -> Optional[nn.Module]:
        """The token embedding (its rows are the vocabulary the model reads); None: none."""
        return None

    def stored_layout(self, shapes: Dict[str, List[int]]) -> Any:
        """Where an hf_names model's tensors are in Hugging Face files holding `shapes` (stored
        name -> shape): framework.models.hf_conversions.StoredLayout, the names renamed and the
        tensors transformers converts on load."""
        raise NotImplementedError(f"{type(self).__name__} maps its names itself (framework.models.hf)")

    def stored_state(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """An hf_names model's whole `state` as its Hugging Face files store it (export)."""
        return state

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

    def fsdp_units(self) -> List[nn.Module]:
        """What FSDP2 all-gathers and reshards as one piece each, before the root, which holds the
        rest (framework.parallel.fully_shard): by default each top-level child with parameters."""
        return [child for child in self.children() if any(True for _ in child.parameters())]

    def compile_units(self) -> List[Tuple[nn.Module, bool]]:
        """The repeated blocks trainer.compile=blocks compiles one by one (one graph, compiled once
        and reused: framework.training.compile), each with whether it traces whole (fullgraph).
        None listed: compiling is refused before launch."""
        return []

    def expert_modules(self) -> List[nn.Module]:
        """Each mixture-of-experts layer's experts, which expert parallelism shards over its ranks
        and FSDP2 over their replicas (framework.parallel.expert_parallel): a module whose
        parameters stack its `n_experts` experts on dim 0, whose `slots_per_expert(expert_ids)`
        counts the token slots routed to each, and whose call `experts(slots, counts)` runs its
        own experts on slots sorted by expert. None listed: a dense model."""
        return []

    def use_expert_parallel(self, token_group: Any, dispatch: Optional[Callable]) -> None:
        """Pool the routing statistics over `token_group` (the ranks holding other tokens) and,
        with `dispatch`, send each layer's token slots through it to their experts' ranks:
        dispatch(experts, slots, expert_ids) -> the slots' outputs in their order. Only a model
        with expert_modules is asked."""
        raise NotImplementedError(f"{type(self).__name__} has no experts to spread")

    def optimizer_step_hook(self) -> Optional[Callable[[], None]]:
        """What the model moves after each optimizer step, outside the gradient (DeepSeek-V3's
        expert biases, by the step's global load); None: nothing."""
        return None

    def uncounted_forwards(self) -> ContextManager[None]:
        """Around forwards that train nothing (a pipeline's shape inference): nothing they do
        counts toward what the training steps keep (a mixture of experts' routing load)."""
        return nullcontext()

    def tp_set_aside(self) -> ContextManager[None]:
        """Around parallelize_module: what the model holds that a TP plan must not shard, out of
        it, then back, placed for its layers' layouts; by default the LoRA adapters, wherever the
        adapters stage put them (framework.models.adapter_names.adapters_set_aside)."""
        return adapters_set_aside(self)

    def alike_on_every_rank(self) -> List[torch.Tensor]:
        """Tensors each rank makes alike itself, which replicate's DataParallel does not broadcast
        from the first replica: by default QLoRA's NF4 weights (quantized from the same weights on
        every rank; no flat tensor a bucket holds)."""
        return [t for t in [*self.parameters(), *self.buffers()] if is_nf4(t)]


class _Undeclared(ModelProtocol):
    """The defaults for a module that declares no protocol: what they read of the model (its
    children, parameters, modules) they read of `module`."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __getattr__(self, name: str) -> Any:  # (asked only for names the protocol does not define)
        return getattr(self.module, name)


def offered(model: nn.Module) -> ModelProtocol:
    """The model's protocol: its own when it declares one, else the defaults, over the model."""
    return model if isinstance(model, ModelProtocol) else _Undeclared(model)


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
