"""Any Hugging Face causal LM through transformers' own modeling code (`model=hf
model.backend=transformers`, and `auto` for a model type the native path does not implement).

The model is transformers' `AutoModelForCausalLM` for the directory's config.json, built on the
meta device; its children are this module's, under their own names, so parameter names are
Hugging Face's (the checkpoint stage reads each rank's slices of the safetensors by those names,
export writes them back unchanged). What the framework's stages need is declared through
ModelProtocol: FSDP2 / compile units are the classes transformers itself keeps whole
(`_no_split_modules`: the decoder layers), TP is the model's own tp_plan mapped to DTensor
styles (validation writes it into the run's plan), the output projection is the model's `lm_head` when
its logits are that projection alone (else the loss reads the logits the model computes), and
the buffers transformers computes at init (rotary frequencies, Gemma's embedding scale) are
computed again by transformers' own `_init_weights` once the model has storage.
"""
import inspect
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.hf_conversions import StoredLayout, stored_layout, stored_state
from framework.models.nf4 import torchao_quietly
from framework.models.protocol import ModelProtocol
from framework.models.vision import freeze, image_inputs
from framework.parallel.plan import matching_modules

# transformers' TP styles (a model's tp_plan) as the framework's plan entries (framework.parallel.plan)
TP_STYLES = {
    "colwise": {"style": "colwise"},
    "rowwise": {"style": "rowwise"},
    "colwise_gather_output": {"style": "colwise", "output_layouts": "replicate"},
    "rowwise_split_input": {"style": "rowwise", "input_layouts": "replicate"},
    "embedding_rowwise": {"style": "rowwise", "input_layouts": "replicate"},
    # a norm of each rank's own heads (q/k norms): its weight a replicated DTensor whose gradient TP
    # sums; the heads' dim declared sharded is any but the normalized last one (the norm is pointwise
    # across them), and the output goes on as the local tensor the attention expects
    "replicated_with_grad_allreduce": {"style": "sequence_parallel", "sequence_dim": 0, "use_local_output": True},
}
# config.json keys by which a causal LM's logits are more than lm_head(hidden): the loss then
# reads the logits transformers computes (no chunked head)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _transformers():
    try:
        with torchao_quietly():  # (its modeling_utils' quantizers load torchao where installed)
            import transformers
    except ImportError:
        raise ConfigError("model.backend", "transformers", "needs transformers: pip install "
                                                           "'framework[transformers]'") from None
    return transformers


@dataclass
class _Decoding:
    """One decode's state: the rows' left padding, transformers' cache, the positions so far, and
    what the prompt's forward alone takes besides its tokens (a VLM's images)."""
    pad: torch.Tensor
    cache: Any = None
    length: int = 0
    prompt_inputs: Dict[str, torch.Tensor] = field(default_factory=dict)

    def forward(self, causal: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        total = self.length + tokens.shape[1]
        places = torch.arange(total, device=tokens.device)[None]
        # (transformers 5.25 renamed past_key_values to cache; older 5.x know the first alone)
        cache_key = "cache" if "cache" in inspect.signature(causal.forward).parameters else "past_key_values"
        out = causal(input_ids=tokens, attention_mask=(places >= self.pad[:, None]).long(),
                     position_ids=(places - self.pad[:, None]).clamp(min=0)[:, self.length:],
                     use_cache=True, logits_to_keep=1, **{cache_key: self.cache},
                     **(self.prompt_inputs if self.length == 0 else {}))
        cache = getattr(out, "cache", None)
        self.cache, self.length = out.past_key_values if cache is None else cache, total
        return out.logits[:, -1]


def _load_balancing(causal: nn.Module) -> Optional[Callable[[Any], torch.Tensor]]:
    """The model's own load-balancing loss of a forward's router logits (its modeling module's
    load_balancing_loss_func, as its forward adds it); None for a model without one."""
    function = getattr(sys.modules[type(causal).__module__], "load_balancing_loss_func", None)
    if function is None or not hasattr(causal, "num_experts"):
        return None
    return lambda router_logits: function(router_logits, causal.num_experts, causal.num_experts_per_tok, None)


class TransformersModel(ModelProtocol, nn.Module):
    """transformers' causal LM for config.json in `path`, on the meta device until the framework
    gives it storage and loads its weights (framework.checkpoint.weights.load_hf_weights)."""

    hf_names = True
    chosen_because = "model.backend=transformers"  # (framework.models.hf_backend says why auto chose it)

    def __init__(self, path: str, activation_checkpointing: str = "none", max_positions: Optional[int] = None,
                 freeze_parts: Sequence[str] = ()):
        super().__init__()
        transformers = _transformers()
        path = os.path.abspath(os.path.expanduser(str(path)))
        try:
            config = transformers.AutoConfig.from_pretrained(path)
            # a vision-language model (a vision_config beside its text config) as its image-and-text class
            self.vision = getattr(config, "vision_config", None) is not None
            auto = transformers.AutoModelForImageTextToText if self.vision else transformers.AutoModelForCausalLM
            with torch.device("meta"), torchao_quietly():
                # (attention: transformers' default for the class, SDPA where it has it, else eager)
                causal = auto.from_config(config, dtype=torch.float32)
        except (ValueError, KeyError) as error:  # an unknown model_type, a config no causal LM takes
            raise ConfigError("model.path", path, f"transformers {transformers.__version__} has no causal LM for its "
                                                  f"config.json: {str(error).splitlines()[0]}") from None
        object.__setattr__(self, "causal", causal)  # (not a child: its children are this module's)
        for name, child in causal.named_children():
            self.add_module(name, child)
        text = config.get_text_config()
        self.hf_path, self.model_type = path, config.model_type
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))
        self.attention_window = None  # (transformers runs the model's own sliding windows)
        self.max_positions = max_positions or getattr(text, "max_position_embeddings", None)
        self.max_positions_key = "model.max_positions" if max_positions else "config.json's max_position_embeddings"
        self.plain_head = not any(getattr(text, key, None) not in (None, 1, 1.0) for key in LOGIT_TRANSFORMS)
        self.load_balancing = _load_balancing(causal) if getattr(text, "output_router_logits", False) else None
        if getattr(text, "output_router_logits", False) and self.load_balancing is None:
            raise ConfigError("model.path", path, f"config.json sets output_router_logits: true, and {config.model_type}'s "
                                                  f"modeling code has no load_balancing_loss_func the framework can "
                                                  f"add; set it to false in config.json")
        if self.load_balancing is not None:  # transformers adds it to the loss only with output_router_logits
            self.auxiliary_losses = {}  # (the last training forward's: framework.training.objectives)
            self.aux_coefficients = {"load_balance": float(text.router_aux_loss_coef)}
        if freeze_parts and not self.vision:
            raise ConfigError("model.freeze", list(freeze_parts), f"{config.model_type} is a language model alone (its "
                                                                  f"config.json has no vision_config); set model.freeze=[]")
        self.frozen = list(freeze_parts)
        self.part_sizes = freeze(self, freeze_parts, path) if self.vision else None
        if activation_checkpointing == "full":
            causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif activation_checkpointing != "none":
            raise ConfigError("model.activation_checkpointing", activation_checkpointing, "use none or full")

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                skip_output: bool = False, decoding: Optional["_Decoding"] = None, pixels: Optional[torch.Tensor] = None,
                image_counts: Optional[torch.Tensor] = None, token_types: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (batch, seq, vocab), or with `skip_output` the final hidden states the output
        layer projects (only asked of a model whose output_layer is its lm_head); with `decoding`
        (own_decoder's) the logits at the last of `tokens`, after the cache. A vision-language
        model's images come as `pixels` per sample (framework.models.vision.image_inputs)."""
        if decoding is not None:
            return decoding.forward(self.causal, tokens)
        balancing = self.load_balancing is not None and torch.is_grad_enabled()  # (training: not decoding)
        inputs = dict(input_ids=tokens, position_ids=positions, use_cache=False,
                      **({"output_router_logits": True} if balancing else {}))
        unused_tower = 0
        if self.vision:
            images, unused_tower = image_inputs(self.causal.model, pixels, image_counts, token_types)
            inputs.update(images)
        out = self.causal.model(**inputs) if skip_output else self.causal(**inputs)
        if balancing:  # transformers' term for the forward's tokens, as a sum over them (the objective's unit)
            self.auxiliary_losses = {"load_balance": self.load_balancing(out.router_logits) * tokens.numel()}
        return (out.last_hidden_state if skip_output else out.logits) + unused_tower

    def tp_plan(self) -> Dict[str, Dict[str, Any]]:
        """transformers' own TP plan of the model (its tp_plan: the base model's, and lm_head's) as
        the framework's plan; a style the framework does not map is refused naming it."""
        plan = {}
        for pattern, style in (self.causal.tp_plan or {}).items():
            # (some models' plans, Llama 4's, name the base model's modules without its prefix)
            pattern = next((p for p in (pattern, *(f"{child}.{pattern}" for child, _ in self.named_children()))
                            if matching_modules(self, p)), pattern)
            if style not in TP_STYLES:
                raise ConfigError("model.path", self.hf_path,
                                  f"{self.model_type}'s tp_plan gives {pattern} the style {style!r}, which the "
                                  f"framework does not map to a DTensor style (it maps {', '.join(TP_STYLES)}); give "
                                  f"the tp ranks to dp / fsdp")
            plan[pattern] = dict(TP_STYLES[style])
        return plan

    def tp_sharded_counts(self) -> Dict[str, int]:
        text = self.causal.config.get_text_config()
        return {f"config.json's {key}": getattr(text, key) for key in ("num_attention_heads", "num_key_value_heads")
                if getattr(text, key, None)}

    def output_layer(self) -> Optional[nn.Module]:
        return self.causal.get_output_embeddings() if self.plain_head else None

    def own_decoder(self, pad: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Decoding through the model's own cache (the one its forward makes for it: a sliding
        window's, a linear attention's state), the rows' left padding masked and their positions
        counted from each row's first token, as transformers' generate does; each call goes
        through this module's forward (an FSDP2 root gathers its weights there)."""
        decoding = _Decoding(pad, prompt_inputs=getattr(self, "_prompt_images", {}))
        return lambda tokens: self(tokens, decoding=decoding)

    @contextmanager
    def prompt_images(self, inputs: Dict[str, torch.Tensor]) -> Iterator[None]:
        """Decodes in this block give their prompt's forward a VLM processor's image inputs
        (pixel_values, token_type_ids), as transformers' generate gives its first step."""
        self._prompt_images = inputs
        try:
            yield
        finally:
            self._prompt_images = {}

    def input_embeddings(self) -> nn.Module:
        return self.causal.get_input_embeddings()

    def stored_layout(self, shapes: Dict[str, List[int]]) -> StoredLayout:
        return stored_layout(self.causal, shapes)

    def stored_state(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return stored_state(self.causal, state)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.causal.get_output_embeddings().weight = self.causal.get_input_embeddings().weight

    def init_buffers(self) -> None:
        """The buffers transformers computes at init and no file holds (rotary frequencies, an
        embedding's scale), computed again by its own _init_weights on the modules that own
        them: given storage by to_empty, they hold garbage. (Their parameters, drawn again
        there too, are loaded next.) Each module's is its innermost model's (a VLM's vision tower
        is a model of its own, whose _init_weights knows its position ids)."""
        owner = {}
        for model in self.causal.modules():  # outer models first: an inner one takes its own modules over
            if isinstance(getattr(model, "config", None), _transformers().PretrainedConfig) and \
                    hasattr(model, "_init_weights"):
                owner.update(dict.fromkeys(model.modules(), model))
        for module in self.modules():
            if module._non_persistent_buffers_set:
                owner.get(module, self.causal)._init_weights(module)

    def fsdp_units(self) -> List[nn.Module]:
        return self.decoder_layers()

    def compile_units(self) -> List[Tuple[nn.Module, bool]]:
        return [(layer, False) for layer in self.decoder_layers()]

    def decoder_layers(self) -> List[nn.Module]:
        """The modules transformers keeps whole when it splits a model (_no_split_modules)."""
        kept = set(getattr(self.causal, "_no_split_modules", None) or ())
        return [module for module in self.modules() if type(module).__name__ in kept]

    def extra_repr(self) -> str:
        return f"transformers {type(self.causal).__name__} from {self.hf_path}"


def check_transformers_model(c: Checked) -> None:
    """What transformers' classes do not do here yet, refused in one line naming the model type
    and that the native path lacks it (framework.models.hf_backend)."""
    model, cfg, roles = c.model, c.cfg, c.roles
    if not isinstance(model, TransformersModel):
        return
    why = f"{model.model_type} runs on transformers' own classes ({model.chosen_because})"
    refusals = [
        (model.vision and roles.tp_size > 1, "mesh.shape", list(cfg.mesh.shape),
         "TP does not split a vision-language model yet; give the tp ranks to dp / fsdp"),
        (roles.pp_size > 1, "parallel.pp_dim", cfg.parallel.get("pp_dim"),
         "pipeline parallelism does not split them yet; give the ranks to dp / fsdp"),
        (roles.cp_size > 1, "parallel.cp_dim", cfg.parallel.get("cp_dim"),
         "context parallelism does not split their attention yet; give the ranks to dp / fsdp"),
        (bool(roles.ep_dims), "parallel.ep_dims", list(roles.ep_dims),
         "expert parallelism does not spread their experts yet; set it to null (FSDP2 shards them)"),
        (roles.tp_size > 1 and bool(c.plan) and c.plan != model.tp_plan(), "plan", sorted(c.plan),
         "a TP plan names the native model's modules; use plan=none (TP takes the model's own tp_plan)"),
        (bool(cfg.data.get("document_masking")) or bool((cfg.data.get("dataset") or {}).get("document_masking")),
         "data.document_masking", True, "their attention is not proven to keep packed documents apart (per-document "
                                        "positions alone leak in some); set data.document_masking=false"),
        (cfg.objective.get("compile_decode") is True, "objective.compile_decode", True,
         "the compiled decode step is the native model's; they decode through transformers' own cache: set it to "
         "null"),
    ]
    for refused, key, value, fix in refusals:
        if refused:
            raise ConfigError(key, value, f"{why}: {fix}")
