"""`python -m framework.generate SOURCE --prompt TEXT [--max-new-tokens N] [--temperature T
--top-p P --seed S] [--device auto|cpu|cuda] [--adapter PEFT_DIR]`: continue a prompt with a trained
model, on this one process, on the GPU where there is one (--device auto, the default).

SOURCE is a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a
framework checkpoint (a step_N dir, or a checkpoints dir: its newest). The prompt is encoded
with the model's tokenizer (the HF directory's tokenizer.json; for the framework's own LMs the
run's data.tokenizer, else bytes), decoded token by token with a KV cache (each new token
attends to the cached keys and values instead of recomputing the prefix; framework.models.decode), until N tokens or the
end-of-text token. `--adapter PEFT_DIR` adds a PEFT LoRA adapter (PEFT's or framework.export
--format peft's) to SOURCE's model. `--image FILE` (a vision-language model): the images and the
prompt as the user's turn of the model's chat template, and the answer alone printed. Greedy (temperature 0, the default) or sampled with nucleus (top-p)
filtering, seeded. A Hugging Face model is checked as training checks it (its safetensors, a
tokenizer within its vocabulary, the prompt and N new tokens within its max_position_embeddings)
before anything runs; bad input exits 2 with one line.
"""
import argparse
import sys
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from framework.cli import checkpoint_source, parsed_status
from framework.config.errors import ConfigError, check_rules
from framework.data.tokenizer import load_tokenizer
from framework.data.vision import load_processor
from framework.parallel.device import resolve_device
from framework.checkpoint.weights import load_base
from framework.models.hf import check_length, check_vocab, check_weights
from framework.models.hf_backend import hugging_face_model
from framework.models.transformers_model import TransformersModel
from framework.models.lifecycle import allocate
from framework.models.adapter_names import is_adapter
from framework.models.lora import add_peft_adapter, load_peft_adapter
from framework.models.protocol import from_hugging_face, offered
# (next_tokens: tests and bench import the decoder from here too)
from framework.models.decode import decoding_generators, generate_groups, stop_ids
from framework.export import load_model, saved_config_errors

DEVICES = ("auto", "cpu", "cuda")
ROPE_POSITIONS = 1 << 24  # float32 holds every integer position up to here
SOURCES = ("a Hugging Face model directory (config.json, *.safetensors, tokenizer.json), a step_N checkpoint or a "
           "checkpoints dir (its newest)")
# (option, whether its value is allowed, the rule): each refused alone, by name
OPTION_RULES = [("max_new_tokens", lambda n: n >= 1, "must be >= 1"),
                ("temperature", lambda t: t >= 0, "must be >= 0 (0: greedy)"),
                ("top_p", lambda p: 0 < p <= 1, "must be in (0, 1]"),
                ("device", lambda d: d in DEVICES, f"use one of {', '.join(DEVICES)}"),
                ("device", lambda d: d != "cuda" or torch.cuda.is_available(),
                 "torch sees no GPU here; use --device cpu (or auto: the GPU where there is one)")]


def generate(model: nn.Module, prompt: List[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, stop: Optional[Set[int]] = None) -> List[int]:
    """The new token ids after `prompt` (the last one a stop id, or max_new_tokens of them),
    decoded on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    tokens, lengths = generate_groups(model, [prompt], 1, max_new_tokens, temperature, top_p,
                                      decoding_generators([seed], device), stop or set(), pad_id=0, device=device,
                                      last_only=True)
    tokens, lengths = tokens.cpu(), lengths.cpu()
    return tokens[0, :int(lengths[0])].tolist()


def chosen_device(name: str) -> torch.device:
    """--device's, as a run's mesh.device_type resolves for one rank: auto is the GPU where torch
    sees one, else the CPU."""
    return torch.device(resolve_device(name, local_ranks=1).type)


def _tokenizer(model: nn.Module, path: Optional[str]):
    """The tokenizer at `path`, whose ids a Hugging Face model must have embeddings for (as
    training checks its data)."""
    tokenizer = load_tokenizer(path)  # None: bytes (the framework's own LMs)
    if from_hugging_face(model):
        check_vocab(model, tokenizer.vocab_size, tokenizer.path)
    return tokenizer


def _hf_source(source: str, adapter: Optional[str]) -> Tuple[nn.Module, object, Set[int]]:
    """A Hugging Face directory's model (with `adapter`'s LoRA), tokenizer and stop ids, checked
    as training checks them before any weight is read."""
    model = hugging_face_model(source)
    check_weights(model)
    tokenizer = _tokenizer(model, model.hf_path)
    if adapter:
        add_peft_adapter(model, adapter, "--adapter")
    allocate(model, "cpu", 0)
    load_base(model, None, model.hf_path)
    if adapter:
        load_peft_adapter(model, adapter)
    return model, tokenizer, stop_ids(model.hf_path, tokenizer)


def _checkpoint_source(path: str, source: str, adapter: Optional[str]) -> Tuple[nn.Module, object, Set[int]]:
    """The checkpoint at `path` (SOURCE `source`): its model (with `adapter`'s LoRA), tokenizer
    and stop ids; what its saved config names is said to come from there."""
    model, cfg, _ = load_model(path)
    if adapter:
        if any(is_adapter(name) for name, _ in model.named_parameters()):
            raise ConfigError("--adapter", adapter, f"{source} has LoRA adapters of its own; give its base model "
                                                    f"as SOURCE")
        add_peft_adapter(model, adapter, "--adapter")
        load_peft_adapter(model, adapter)
    model_dir = offered(model).hf_path
    with saved_config_errors(path):
        tokenizer = _tokenizer(model, model_dir or (cfg.get("data") or {}).get("tokenizer"))
    return model, tokenizer, stop_ids(model_dir, tokenizer)


def load_source(source: str, adapter: Optional[str] = None) -> Tuple[nn.Module, object, Set[int]]:
    """(model with its weights and `adapter`'s, tokenizer, stop ids) of a Hugging Face directory
    or a checkpoint."""
    checkpoint = checkpoint_source(source, SOURCES)
    if checkpoint is not None:
        return _checkpoint_source(checkpoint, source, adapter)
    try:
        return _hf_source(source, adapter)
    except ConfigError as error:  # framework.models.hf names model.path, training's key for SOURCE
        raise (ConfigError("SOURCE", error.value, error.fix) if error.key == "model.path" else error) from None


def check_options(args: argparse.Namespace) -> None:
    """Before any loading: the first option that breaks its rule, named alone."""
    check_rules(OPTION_RULES, lambda name: getattr(args, name), lambda name: f"--{name.replace('_', '-')}")


def encoded_prompt(args: argparse.Namespace, model: nn.Module, tokenizer) -> List[int]:
    """The prompt's ids, with the model's BOS first (Llama is trained with one, as transformers'
    tokenizer adds it); refused if empty, or if it and the new tokens pass a Hugging Face
    model's positions (framework.models.hf.check_length, as training checks seq_len)."""
    prompt = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode_batch([args.prompt])[0]
    if not prompt:
        raise ConfigError("--prompt", args.prompt, "encodes to no tokens; give some text")
    if from_hugging_face(model):
        check_length(model, "--max-new-tokens", args.max_new_tokens, before=len(prompt))
    if not isinstance(model, TransformersModel):  # (transformers' own cache grows as it decodes)
        check_room(model, len(prompt), args.max_new_tokens)
    return prompt


def available_bytes(device: torch.device) -> int:
    """What the decoder may allocate: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def check_room(model: nn.Module, before: int, new: int) -> None:
    """The prompt and `new` tokens fit the decoder: positions the rotary embedding computes
    exactly (float32, to ROPE_POSITIONS), and the static cache (every layer's keys and values for
    every position, preallocated) with the rotation table and a step's scores in the memory
    there is, else refused before the cache is allocated (100M new tokens ran until the kernel
    killed the process)."""
    param = next(model.parameters())
    per_position = (len(model.layers) * 2 * model.n_kv_heads * model.head_dim * param.element_size()
                    + 8 * model.head_dim + 8 * model.n_heads + 64)  # (the table rounded to a power of 2; masks)
    free = available_bytes(param.device)
    limit = min(ROPE_POSITIONS, free // per_position)
    if before + new > limit:
        prompt = f"with the prompt's {before} tokens, " if before else ""
        why = (f"passes the {ROPE_POSITIONS} positions the rotary embedding computes exactly (in float32)"
               if limit == ROPE_POSITIONS else
               f"the decoder's cache would take {(before + new) * per_position / 2 ** 30:.1f} GiB and the "
               f"{param.device.type} has {free / 2 ** 30:.1f} GiB available")
        fix = f"use at most {limit - before}" if limit > before else "shorten the prompt"
        raise ConfigError("--max-new-tokens", new, f"{prompt}{why}; {fix}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m framework.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help=SOURCES)
    p.add_argument("--prompt", required=True, help="the text to continue (with --image: the user's question)")
    p.add_argument("--image", action="append", metavar="FILE", help="an image for a vision-language model, before "
                                                                     "the prompt in the user's turn (repeat for more)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (>= 1; default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); > 0: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens whose probability "
                                                            "reaches this, in (0, 1] (default 1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling's seed (default 0)")
    p.add_argument("--device", default="auto", help="where to decode: auto (the GPU where torch sees one, else the "
                                                    "CPU; the default), cpu or cuda")
    p.add_argument("--adapter", metavar="PEFT_DIR", help="a PEFT LoRA adapter directory (adapter_config.json + "
                                                         "adapter_model.safetensors) to apply to SOURCE's model")
    return p


def image_prompt(args: argparse.Namespace, model: nn.Module) -> Tuple[List[int], Dict[str, torch.Tensor]]:
    """A vision-language model's prompt of --image files and --prompt text through its own
    processor and chat template (the user's turn, then the assistant's opening, as data=vision
    trains it): the ids, and the image inputs its first forward takes."""
    from PIL import Image, UnidentifiedImageError

    if not getattr(offered(model), "vision", False):
        raise ConfigError("--image", args.image, "SOURCE's model reads text alone; give a vision-language model "
                                                 "(config.json with a vision_config) or drop --image")
    images = []
    for file in args.image:
        try:
            images.append(Image.open(file).convert("RGB"))
        except (OSError, UnidentifiedImageError) as error:
            raise ConfigError("--image", file, f"is not an image Pillow reads ({error})") from None
    processor = load_processor(offered(model).hf_path)
    user = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    encoded = processor(text=[text], images=[images], return_tensors="pt")
    check_length(model, "--max-new-tokens", args.max_new_tokens, before=encoded["input_ids"].shape[1])
    return encoded["input_ids"][0].tolist(), {key: value for key, value in encoded.items()
                                              if key not in ("input_ids", "attention_mask")}


def _run(args: argparse.Namespace) -> int:
    check_options(args)
    model, tokenizer, stop = load_source(args.source, args.adapter)
    model.to(chosen_device(args.device))
    if args.image:  # the answer alone: the prompt is a chat template's turn
        prompt, images = image_prompt(args, model)
        device = next(model.parameters()).device
        with offered(model).prompt_images({key: value.to(device) for key, value in images.items()}):
            new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, stop)
        print(tokenizer.decode([t for t in new if t not in stop]))
        return 0
    prompt = encoded_prompt(args, model, tokenizer)
    new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, stop)
    print(args.prompt + tokenizer.decode([t for t in new if t not in stop]))
    return 0


def main(argv: List[str]) -> int:
    return parsed_status(parser(), argv, _run, "generate failed")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
