"""Tiny random Hugging Face models of each supported architecture, made with transformers' own
classes and save_pretrained (the reference the framework is checked against; no download)."""
import json
import os
from typing import Optional

import torch

VOCAB = 256  # byte-level data (conf/data/byte_corpus.yaml) fits

ARCHITECTURES = {
    # Llama 3 with GQA (2 key/value heads for 4 query heads) and its rope scaling
    "llama": dict(num_key_value_heads=2, rope_theta=50000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama_bias": dict(num_key_value_heads=2, attention_bias=True),  # q/k/v and o_proj bias
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(num_key_value_heads=2),  # q/k/v bias
    "qwen3": dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),  # q/k norm, tied output
}
# Mixtures of experts, kept apart: the TP and pipeline tests that iterate ARCHITECTURES do not run experts yet.
# 4 experts of 32, top 2; each makes one choice that transformers' own defaults would not.
MOE_ARCHITECTURES = {
    # weights renormalized, layer 1 dense (mlp_only_layers), the aux loss in transformers' loss
    "qwen3_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], output_router_logits=True,
                      router_aux_loss_coef=0.02),
    # weights not renormalized, a gated shared expert, every 2nd of 4 layers sparse
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=4, decoder_sparse_step=2),
    # every layer sparse, experts intermediate_size wide, no sliding window
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=None),
}
# Model types the native path does not implement, trained through transformers' own classes
# (framework.models.transformers_model); each with what sets it apart.
TRANSFORMERS_ARCHITECTURES = {
    # local / global sliding windows, q/k norms, scaled embeddings, tied output
    "gemma3_text": dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], pad_token_id=0),
    # attention sinks, alternating sliding windows, a mixture of experts with biases (eager attention)
    "gpt_oss": dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    # chunked attention, layers without rotary positions, a mixture of experts with a shared expert
    "llama4_text": dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                        intermediate_size_mlp=96, interleave_moe_layer_step=1, no_rope_layers=[1, 0],
                        attention_chunk_size=8),
    # Gated DeltaNet linear attention beside gated full attention
    "qwen3_5_text": dict(num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16),
    "olmo2": dict(num_key_value_heads=2),  # norms after attention and MLP, q/k norms over all heads
    "phi3": dict(num_key_value_heads=2, pad_token_id=0),  # fused qkv and gate_up projections
    # multi-head latent attention, group-limited routing, a shared expert, a dense first layer; its
    # files hold one tensor per expert, which transformers stacks as it loads
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1),
}
_TRANSFORMERS_CONFIGS = {"deepseek_v3": "DeepseekV3Config", "gemma3_text": "Gemma3TextConfig", "gpt_oss": "GptOssConfig",
                         "llama4_text": "Llama4TextConfig", "qwen3_5_text": "Qwen3_5TextConfig",
                         "olmo2": "Olmo2Config", "phi3": "Phi3Config"}


def make_hf_model(kind: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Save a random 2-layer `kind` model (fp32) and a byte-level tokenizer.json in out_dir;
    return out_dir."""
    import transformers

    if kind in _TRANSFORMERS_CONFIGS:
        return _save(getattr(transformers, _TRANSFORMERS_CONFIGS[kind]), transformers.AutoModelForCausalLM.from_config,
                     TRANSFORMERS_ARCHITECTURES[kind] | overrides, out_dir, seed, "PreTrainedTokenizerFast")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[kind]
    return _save(config_class, model_class, {**{**ARCHITECTURES, **MOE_ARCHITECTURES}[kind], **overrides}, out_dir, seed)


def _save(config_class, build, choices: dict, out_dir: str, seed: int, tokenizer_class: Optional[str] = None) -> str:
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=0)
    options.update(choices)
    torch.manual_seed(seed)
    model = build(config_class(**options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # transformers zero-initializes biases; random ones test them
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # a router's logits far apart: routing far from ties and uniform
                p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    save_byte_tokenizer(out_dir, tokenizer_class)
    return out_dir


def reference(path: str):
    """transformers' own model of `path`, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)


def all_models(root: str) -> dict:
    return {kind: make_hf_model(kind, os.path.join(root, kind)) for kind in ARCHITECTURES}


def save_byte_tokenizer(out_dir: str, tokenizer_class: Optional[str] = None) -> None:
    """A byte-level tokenizer.json whose id for each byte is the byte's value (so it encodes
    text as conf/data/byte_corpus.yaml does), made with the `tokenizers` package, and a
    tokenizer_config.json naming byte 0 the end of text (and `tokenizer_class`, where the model
    type's own class would ask for tokens this one lacks: Gemma's <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_char = {b: c for c, b in zip(sorted(alphabet, key=_byte_of), range(256))}
    tokenizer = Tokenizer(models.BPE(vocab={to_char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        # byte 0 ends a text, as config.json's eos_token_id says
        json.dump({"eos_token": to_char[0], **({"tokenizer_class": tokenizer_class} if tokenizer_class else {})}, f)


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-character table, inverted: printable bytes map to themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table[char]


# A Gemma 3-shaped vision-language model: a SigLIP tower on 16x16 images (4x4 patches of 4 pixels),
# its projector pooling them to 4 image tokens, Gemma 3's text model; the byte tokenizer with
# Gemma's turn and image markers, and a chat template of Gemma's form.
VLM_SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                "<image_soft_token>", "<pad>"]
VLM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


# LLaVA's form: a CLIP tower (its class token dropped, the second-to-last layer's features), a
# 2-layer MLP projector, a Llama; "USER:<image>...\nASSISTANT: ...\n" turns (the newline an expression:
# transformers renders templates with trim_blocks, which drops a newline after a tag).
LLAVA_SPECIALS = ["<bos>", "<image>", "<pad>"]
_BYTE_ZERO = chr(256)  # the byte tokenizer's character for byte 0, config.json's eos (GPT-2's byte table)
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'].upper() }}:{% if message['role'] == 'assistant' %} "
    "{% endif %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% elif part['type'] == "
    "'text' %}{{ part['text'] }}{% endif %}{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _vlm_tokenizer(out_dir: str, specials: list) -> dict:
    """The byte tokenizer with `specials` added after the bytes; their ids."""
    from tokenizers import AddedToken, Tokenizer

    os.makedirs(out_dir, exist_ok=True)
    save_byte_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return {token: tokenizer.token_to_id(token) for token in specials}


def _randomized(model, seed: int):
    """Zero-initialized biases, norms and projectors made random, so they are tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith("mm_input_projection_weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_vlm(out_dir: str, seed: int = 0, kind: str = "gemma3") -> str:
    """Save a random 2-layer vision-language model (fp32) of `kind` (gemma3, llava) with its
    processor (image processor, tokenizer, chat template) in out_dir; return out_dir."""
    import transformers

    if kind == "llava":
        return _make_llava(out_dir, seed)
    ids = _vlm_tokenizer(out_dir, VLM_SPECIALS)
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB + len(VLM_SPECIALS), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=256, pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
                         eos_token_id=ids["<end_of_turn>"]),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=4, vision_use_head=False),  # (as Gemma 3 sets it)
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(seed)
    _randomized(transformers.Gemma3ForConditionalGeneration(config), seed).save_pretrained(out_dir)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(out_dir, "tokenizer.json"), bos_token="<bos>", eos_token="<end_of_turn>",
        pad_token="<pad>", extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"})
    image_processor = transformers.Gemma3ImageProcessor(size={"height": 16, "width": 16})
    transformers.Gemma3Processor(image_processor=image_processor, tokenizer=fast, chat_template=VLM_TEMPLATE,
                                 image_seq_length=4).save_pretrained(out_dir)
    return out_dir


def _make_llava(out_dir: str, seed: int) -> str:
    import transformers

    ids = _vlm_tokenizer(out_dir, LLAVA_SPECIALS)
    config = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=VOCAB + len(LLAVA_SPECIALS), hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=ids["<bos>"], eos_token_id=0,
                         pad_token_id=ids["<pad>"]),
        image_token_index=ids["<image>"], image_seq_length=16, vision_feature_layer=-2,
        vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    _randomized(transformers.LlavaForConditionalGeneration(config), seed).save_pretrained(out_dir)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(out_dir, "tokenizer.json"),
                                                bos_token="<bos>", eos_token=_BYTE_ZERO, pad_token="<pad>")
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=fast, patch_size=4,
                                vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                                num_additional_image_tokens=1).save_pretrained(out_dir)
    return out_dir


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 20)}


def colour_images(out_dir: str) -> None:
    """A solid 16x16 PNG of each colour, named after it, in `out_dir`."""
    from PIL import Image

    os.makedirs(out_dir, exist_ok=True)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (16, 16), rgb).save(os.path.join(out_dir, f"{name}.png"))


def colour_records(out_dir: str, count: int = 128, text_only_every: int = 0, seed: int = 0) -> str:
    """A JSONL of `count` records asking the colour of a solid 16x16 image (the answer only the
    image gives), the images beside it; every `text_only_every`-th record a text-only one."""
    import random

    colour_images(out_dir)
    rng = random.Random(seed)
    path = os.path.join(out_dir, "train.jsonl")
    with open(path, "w") as f:
        for i in range(count):
            name = rng.choice(sorted(COLOURS))
            if text_only_every and i % text_only_every == 0:
                record = {"prompt": "Say ok.", "response": "ok"}
            else:
                record = {"image": f"{name}.png", "prompt": "What colour is it?", "response": name}
            f.write(json.dumps(record) + "\n")
    return path


def hf_records(records: list, root, out, as_list: bool = True):
    """`records` (data=vision's, images beside them in `root`) as a save_to_disk dataset with an
    image column of datasets' Image feature: lists of images (as_list), or one image a row."""
    import datasets

    images = [[str(root / name) for name in ([r["image"]] if isinstance(r.get("image"), str) else r.get("image") or [])]
              for r in records]
    column = images if as_list else [files[0] for files in images]
    feature = datasets.Sequence(datasets.Image()) if as_list else datasets.Image()
    table = datasets.Dataset.from_dict({"image": column, "question": [r["prompt"] for r in records],
                                        "answer": [r["response"] for r in records]})
    table.cast_column("image", feature).save_to_disk(str(out))
    return str(out)


def colour_pairs(out_dir: str, count: int = 64, seed: int = 0) -> str:
    """colour_records' task as preference pairs (data=vision_preferences): the image's colour
    chosen, another rejected."""
    import random

    colour_images(out_dir)
    rng = random.Random(seed)
    path = os.path.join(out_dir, "pairs.jsonl")
    with open(path, "w") as f:
        for _ in range(count):
            name = rng.choice(sorted(COLOURS))
            wrong = rng.choice([c for c in sorted(COLOURS) if c != name])
            f.write(json.dumps({"image": f"{name}.png", "prompt": "What colour is it?", "chosen": name,
                                "rejected": wrong}) + "\n")
    return path
