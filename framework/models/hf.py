"""Hugging Face Llama-family models and their mixtures of experts (Qwen2-MoE, Qwen3-MoE,
Mixtral): the architecture from config.json, the weights from *.safetensors, both read directly
(transformers is not needed at run time).

`model=hf model.path=DIR` builds framework.models.Transformer (HFTransformer) on the meta device with what
config.json says; the parallel stages shard it, and the checkpoint stage loads each rank's own
slices through DCP's HuggingFaceStorageReader (framework.checkpoint.weights.load_hf_weights), so no rank holds the whole
model. Parameter names map one to one (`hf_name`), except a block's stacked experts, which the
files hold one tensor per expert (`hf_state_dict`); export writes them back (framework.export).
Anything in config.json that changes the math and is not implemented is refused, never ignored.
"""
import json
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.meta import SkipRandomInit
from framework.models.adapter_names import is_adapter
from framework.models.stored_tensors import stored_shapes
from framework.models.transformer import Transformer
from framework.models.protocol import from_hugging_face, offered
from framework.parallel.dtensors import dtensor_api, global_offset, is_dtensor

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
# Files a Hugging Face model directory carries besides its weights (export copies them).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json",
              # a vision-language model's processor: its image processor, its chat template
              "processor_config.json", "preprocessor_config.json", "chat_template.jinja", "chat_template.json")

# our parameter name -> Hugging Face's (a layer's index is \1)
_NAMES = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.attention\.([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
]
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# each mixture of experts' module in the files, and its experts' names of our w1 (gate), w2 (down), w3 (up)
_MOE_LAYOUT = {"qwen2_moe": ("mlp", _SWIGLU), "qwen3_moe": ("mlp", _SWIGLU),
               "mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"})}
EXPERT = "{expert}"  # where an expert's index goes in the Hugging Face name of a stacked expert weight


def _moe_names(kind: str) -> List[Tuple[str, str]]:
    """A mixture of experts' names (the router, the stacked experts, Qwen2-MoE's gated shared expert)."""
    block, experts = _MOE_LAYOUT[kind]
    ours, theirs = r"layers\.(\d+)\.feed_forward", rf"model.layers.\1.{block}"
    return [(rf"{ours}\.gate\.weight", rf"{theirs}.gate.weight"),
            (rf"{ours}\.shared_expert_gate\.weight", rf"{theirs}.shared_expert_gate.weight"),
            *[(rf"{ours}\.experts\.{w}", rf"{theirs}.experts.{EXPERT}.{name}.weight") for w, name in experts.items()],
            *[(rf"{ours}\.shared_expert\.{w}\.weight", rf"{theirs}.shared_expert.{name}.weight")
              for w, name in _SWIGLU.items()]]


def hf_name(name: str, kind: str = "llama") -> str:
    """Hugging Face's name of our parameter `name` in a `kind` (model_type) model; a stacked
    expert weight's holds EXPERT where each expert's index goes."""
    for ours, theirs in _NAMES + (_moe_names(kind) if kind in _MOE_LAYOUT else []):
        if re.fullmatch(ours, name):
            return re.sub(ours, theirs, name)
    raise KeyError(f"{name} has no Hugging Face name")


def expert_slices(stack: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
    """(global expert index, its matrix: a view of this rank's storage) for each expert this rank
    holds of a stacked expert weight: all of a plain tensor's, a DTensor's local ones when it is
    sharded on the expert dim (expert parallelism, FSDP), so each rank reads and writes only
    its own experts."""
    if not is_dtensor(stack):
        return ((e, stack[e]) for e in range(len(stack)))
    api = dtensor_api()
    if not all(p == api.Shard(0) or isinstance(p, api.Replicate) for p in stack.placements):
        raise NotImplementedError(f"expert weights laid out as {stack.placements}: only sharded on the expert dim "
                                  f"(Shard(0)) or replicated")
    local, offset = stack.to_local(), global_offset(stack)
    return ((offset[0] + e, local[e]) for e in range(len(local)))


def hf_state_dict(state: Dict[str, Any], tied: bool, kind: str = "llama") -> Dict[str, Any]:
    """Our state_dict under Hugging Face's names, one entry per expert of a stacked expert
    weight (the files' layout); a tied output projection is left out (it is the embedding, and
    Hugging Face files store it once)."""
    named = {}
    for key, value in state.items():
        if (tied and key == "output.weight") or is_adapter(key):  # (adapters: framework.export --format peft)
            continue
        name = hf_name(key, kind)
        if EXPERT in name:
            named.update((name.replace(EXPERT, str(e)), matrix) for e, matrix in expert_slices(value))
        else:
            named[name] = value
    return named


def model_state_dict(model: nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """`state` (model's state dict, or its shards') under Hugging Face's names for `model`'s type:
    a model whose names are Hugging Face's already (hf_names) as it is, less its adapters and a
    tied output (which the files store once, as the embedding)."""
    declared = offered(model)
    if declared.hf_names:
        tied = {f"{name}.weight" for name, module in model.named_modules() if module is declared.output_layer()}
        return {key: value for key, value in state.items()
                if not is_adapter(key) and not (declared.tie_word_embeddings and key in tied)}
    return hf_state_dict(state, declared.tie_word_embeddings, declared.model_type)


def read_config(path: str) -> Dict[str, Any]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        problem = "holds no config.json" if os.path.isdir(path) else "no such directory"
        raise ConfigError("model.path", path, f"{problem}; point it at a Hugging Face model directory "
                                              f"(config.json, *.safetensors, tokenizer.json)")
    try:
        with open(config_file) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError("model.path", path, f"config.json cannot be read: {error}") from None


def _rope(config: Dict[str, Any], path: str) -> Tuple[float, Any]:
    """(theta, llama3 scaling or None) from rope_parameters (transformers 5) or rope_theta and
    rope_scaling (4.x)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")}
    raise ConfigError("model.path", path, f"config.json's rope scaling type {kind!r} is not implemented "
                                          f"(supported: default, llama3)")


def refuse_unimplemented(config: Dict[str, Any], path: str) -> None:
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError("model.path", path, f"config.json's model_type {kind!r} is not supported; supported: "
                                              f"{', '.join(SUPPORTED)}")
    checks = [
        (config.get("hidden_act", "silu") == "silu", f"hidden_act {config.get('hidden_act')!r} (only silu)"),
        (not config.get("mlp_bias"), "mlp_bias: true"),
        (not config.get("use_sliding_window"), "use_sliding_window: true"),
        (all(t == "full_attention" for t in config.get("layer_types") or []), "layer_types other than full_attention"),
        (not config.get("router_jitter_noise"), f"router_jitter_noise: {config.get('router_jitter_noise')} (noise on "
                                                f"the experts' input in training)"),
    ]
    for ok, what in checks:
        if not ok:
            raise ConfigError("model.path", path, f"config.json sets {what}, which this framework does not implement")
    _rope(config, path)


def _n_experts(config: Dict[str, Any]) -> int:
    """Qwen's num_experts (transformers 5 saves Qwen3-MoE's as num_local_experts), Mixtral's num_local_experts."""
    return config.get("num_experts", config.get("num_local_experts", 0))


def sparse_layers(config: Dict[str, Any]) -> List[int]:
    """The blocks whose feed-forward is the mixture: every one of Mixtral's; Qwen's every
    decoder_sparse_step-th but those of mlp_only_layers (the others are dense, intermediate_size wide)."""
    layers = range(config["num_hidden_layers"])
    if config["model_type"] == "mixtral":
        return list(layers)
    dense, step = set(config.get("mlp_only_layers") or []), config.get("decoder_sparse_step", 1)
    return [i for i in layers if _n_experts(config) > 0 and i not in dense and (i + 1) % step == 0]


def aux_loss_coef(config: Dict[str, Any]) -> float:
    """The load-balancing loss's weight in training, as transformers adds it to the loss: its
    router_aux_loss_coef when output_router_logits is true, else 0 (reported, not trained)."""
    return float(config.get("router_aux_loss_coef", 0.001)) if config.get("output_router_logits") else 0.0


def moe_args(config: Dict[str, Any], path: str) -> Optional[Dict[str, Any]]:
    """Transformer's `moe` for a mixture of experts' config.json (None: no block has experts).
    Mixtral renormalizes its top-k weights and its experts are intermediate_size wide; Qwen2-MoE
    adds a shared expert gated by sigmoid(shared_expert_gate) to every sparse block."""
    kind, layers = config["model_type"], sparse_layers(config)
    if kind not in _MOE_LAYOUT or not layers:
        return None
    n_experts, top_k = _n_experts(config), config["num_experts_per_tok"]
    if top_k > n_experts:
        raise ConfigError("model.path", path, f"config.json's num_experts_per_tok={top_k} exceeds its {n_experts} "
                                              f"experts")
    qwen2 = kind == "qwen2_moe"
    return dict(n_experts=n_experts, top_k=top_k, layers=layers, aux_loss_coef=aux_loss_coef(config),
                hidden_dim=config["intermediate_size" if kind == "mixtral" else "moe_intermediate_size"],
                norm_topk_prob=kind == "mixtral" or bool(config.get("norm_topk_prob", False)),
                shared_hidden_dim=config["shared_expert_intermediate_size"] if qwen2 else None, shared_gate=qwen2)


def _attention_bias(config: Dict[str, Any]) -> Tuple[bool, bool]:
    """(q/k/v bias, o_proj bias): Qwen2's q/k/v bias always, Qwen2-MoE's as qkv_bias says (default
    true), o_proj's never; the others' attention_bias: all four."""
    kind = config["model_type"]
    if kind in ("qwen2", "qwen2_moe"):
        return kind == "qwen2" or bool(config.get("qkv_bias", True)), False
    return (bool(config.get("attention_bias")),) * 2


def transformer_args(config: Dict[str, Any], path: str) -> Dict[str, Any]:
    """framework.models.Transformer's arguments for a supported config.json."""
    refuse_unimplemented(config, path)
    theta, scaling = _rope(config, path)
    qkv_bias, o_bias = _attention_bias(config)
    return dict(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"], n_kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"), hidden_dim=config["intermediate_size"], norm_eps=config["rms_norm_eps"],
        rope_theta=theta, rope_scaling=scaling, rope_halves=True, qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=config["model_type"] in ("qwen3", "qwen3_moe"), moe=moe_args(config, path),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))


def attention_window(config: Dict[str, Any]) -> Any:
    """Mistral's and Mixtral's sliding window (None: every position sees all earlier ones). The
    framework runs full attention, which equals the window's only for sequences no longer than it."""
    return config.get("sliding_window") if config.get("model_type") in ("mistral", "mixtral") else None


class HFTransformer(Transformer):
    """The model config.json in `path` describes, built on the meta device (no memory);
    `hf_path` tells the builder to shard it, allocate it and load the weights from `path`.
    `max_positions` (default: config.json's max_position_embeddings) is the longest sequence it
    is run on (check_length): set it to train past what the model was trained on."""

    def __init__(self, path: str, activation_checkpointing: str = "none", max_positions: Optional[int] = None):
        path = os.path.abspath(os.path.expanduser(str(path)))
        config = read_config(path)
        with torch.device("meta"), SkipRandomInit():
            super().__init__(**transformer_args(config, path), activation_checkpointing=activation_checkpointing)
        self.hf_path, self.model_type = path, config["model_type"]
        self.attention_window = attention_window(config)
        self.max_positions = max_positions or config.get("max_position_embeddings")
        self.max_positions_key = "model.max_positions" if max_positions else "config.json's max_position_embeddings"


# model=hf's _target_ (framework.models.hf_backend), and before it this module's HFTransformer
# (which checkpoints of older runs name): what reads a Hugging Face directory
HF_TARGETS = ("framework.models.hf_backend.hugging_face_model", f"{__name__}.{HFTransformer.__name__}")


def check_model_path(cfg: DictConfig) -> None:
    """model=hf's model.path, before anything reads it (recipes/finetune_hf.yaml's data.tokenizer
    is ${model.path}): given, holding a config.json, and made absolute in the config the ranks
    run and checkpoints save, so export and generate find the model from any directory."""
    model = cfg.model
    if model.get("_target_") not in HF_TARGETS:
        return
    if OmegaConf.is_missing(model, "path"):
        raise ConfigError("model.path", "???", "not given; name the Hugging Face model directory on the command "
                                               "line: model.path=DIR (config.json, *.safetensors, tokenizer.json)")
    model.path = os.path.abspath(os.path.expanduser(model.path))
    read_config(model.path)


def check_vocab(model: HFTransformer, vocab: int, tokenizer: str) -> None:
    """Every id of the tokenizer has a row of the embedding (else the first one past it fails
    every rank mid-run: an IndexError in the embedding or the loss)."""
    rows = offered(model).input_embeddings().num_embeddings
    if vocab > rows:
        raise ConfigError("model.path", model.hf_path, f"config.json's vocab_size={rows} is smaller than the "
                                                       f"vocabulary ({vocab}) of {tokenizer}: its ids from {rows} "
                                                       f"on have no embedding; use a tokenizer of at most {rows} "
                                                       f"tokens, the one the model was trained with")


def check_length(model: HFTransformer, key: str, value: int, before: int = 0, opt_out: bool = False) -> None:
    """`value` tokens after `before` others (a prompt) fit the model: within Mistral's sliding
    window (full attention equals it only that far) and max_positions (the rotary embedding
    runs past it, on positions the model never saw: refused, unless `opt_out` names the key that
    allows it)."""
    length, path = before + value, model.hf_path
    past = (f", or set +model.max_positions={length} to go past it (the rotary embedding extrapolates to "
            f"positions the model never saw)") if opt_out else ""
    limits = [(model.attention_window, f"the model's sliding_window={model.attention_window} (config.json in "
                                       f"{path}), which this framework does not implement", ""),
              (model.max_positions, f"{model.max_positions_key}={model.max_positions} (in {path}), the longest "
                                    f"sequence the model was trained on", past)]
    for limit, what, allow in limits:
        if limit is not None and length > limit:
            prompt = f"with the prompt's {before} tokens, " if before else ""
            fix = f"use at most {limit - before} tokens" if limit > before else "shorten the prompt"
            raise ConfigError(key, value, f"{prompt}exceeds {what}; {fix}{allow}")


def check_weights(model: Transformer) -> None:
    """The safetensors hold exactly the tensors the model needs, with its shapes (headers only:
    milliseconds; what transformers converts on load is converted on meta). Run before launch."""
    path, declared = model.hf_path, offered(model)
    expected = {name: list(t.shape) for name, t in model_state_dict(model, model.state_dict()).items()}
    stored = dict(stored_shapes(path))
    found, unexpected = {name: (name, shape) for name, shape in stored.items()}, set(stored) - set(expected)
    if declared.hf_names:
        layout = declared.stored_layout(stored)
        found = {**{name: (theirs, stored[theirs]) for name, theirs in layout.renamed.items()},
                 **{name: (f"{name} (made from the stored {', '.join(n for _, n in layout.group_of(name).sources)})",
                           shape) for name, (_, shape) in layout.made.items()}}
        unexpected = set(layout.unexpected)
    for name, shape in expected.items():
        if name not in found:
            raise ConfigError("model.path", path, f"the safetensors lack {name} (shape {shape}), which config.json "
                                                  f"implies")
        theirs, stored_shape = found[name]
        if stored_shape != shape:
            raise ConfigError("model.path", path, f"the safetensors' {theirs} has shape {stored_shape}, config.json "
                                                  f"implies {shape}")
    unexpected = sorted(unexpected - {"lm_head.weight"})
    if unexpected:
        raise ConfigError("model.path", path, f"the safetensors hold {unexpected[0]}, which config.json's "
                                              f"architecture has no place for")


def materialize(model: nn.Module, device) -> None:
    """Storage for a model built on meta (garbage until its weights are loaded)."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own new tensor
    offered(model).init_buffers()


def check_hf_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError("OUT_DIR", out, "exists and is not an empty directory; name a new directory")


def check_final_hf(c: Checked) -> None:
    model, out_dir = c.model, c.out_dir
    if not c.cfg.checkpoint.final_hf:
        return
    if not from_hugging_face(model):
        raise ConfigError("checkpoint.final_hf", True, f"writes a Hugging Face directory, which needs a model loaded "
                                                       f"from one (model=hf); this one is a {type(model).__name__}")
    if out_dir is not None:
        check_hf_out(os.path.join(out_dir, "hf"))
