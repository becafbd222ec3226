"""`python -m framework.generate SOURCE --prompt TEXT [--max-new-tokens N] [--temperature T
--top-p P --seed S]`: continue a prompt with a trained model, on this one process.

SOURCE is a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a
framework checkpoint (a step_N dir, or a checkpoints dir: its newest). The prompt is encoded
with the model's tokenizer (the HF directory's tokenizer.json; for the framework's own LMs the
run's data.tokenizer, else bytes), decoded token by token with a KV cache (each new token attends to the cached keys and
values instead of recomputing the prefix), until N tokens or the end-of-text token. Greedy
(temperature 0, the default) or sampled with nucleus (top-p) filtering, seeded.
"""
import argparse
import json
import os
import sys
import warnings
from typing import List, Optional, Set, Tuple

import torch
from torch import nn

from framework.checkpoint.layout import CheckpointError
from framework.cli import parsed
from framework.config.errors import ConfigError
from framework.data.tokenizer import load_tokenizer
from framework.models.transformer import LayerCache


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    # keep the smallest set of most likely tokens whose probability reaches top_p
    outside = ordered.cumsum(-1) - ordered >= top_p
    ordered[outside] = 0
    return int(order[torch.multinomial(ordered, 1, generator=generator)])


@torch.no_grad()
def generate(model: nn.Module, prompt: List[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, stop: Optional[Set[int]] = None) -> List[int]:
    """The new token ids after `prompt` (the last one a stop id, or max_new_tokens of them)."""
    model.eval()
    cache = [LayerCache(len(prompt) + max_new_tokens) for _ in model.layers]
    generator = torch.Generator().manual_seed(seed)
    logits = model(torch.tensor([prompt]), cache)[0, -1]
    new: List[int] = []
    while len(new) < max_new_tokens:
        new.append(_next_token(logits, temperature, top_p, generator))
        if new[-1] in (stop or ()):
            break
        logits = model(torch.tensor([[new[-1]]]), cache)[0, -1]
    return new


def _stop_ids(model_dir: Optional[str], tokenizer) -> Set[int]:
    """The model's own end-of-text ids (generation_config.json, else config.json), else the tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(model_dir or "", name)
        if model_dir and os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {eos}
    return set() if tokenizer.eos_id is None else {tokenizer.eos_id}


def load_source(source: str) -> Tuple[nn.Module, object, Set[int]]:
    """(model with its weights, tokenizer, stop ids) of a Hugging Face directory or a checkpoint."""
    from framework.export import load_model
    from framework.models.hf import HFTransformer, load_hf_weights, materialize

    if os.path.isfile(os.path.join(source, "config.json")):
        model = HFTransformer(source)
        model_dir = tokenizer_path = model.hf_path
        materialize(model, "cpu")
        with warnings.catch_warnings():  # DCP's note that it reads in one process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load_hf_weights(model, model.hf_path)
    else:
        model, cfg, _ = load_model(source)
        model_dir = getattr(model, "hf_path", None)
        tokenizer_path = model_dir or (cfg.get("data") or {}).get("tokenizer")
    tokenizer = load_tokenizer(tokenizer_path)  # None: bytes (the framework's own LMs)
    return model, tokenizer, _stop_ids(model_dir, tokenizer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m framework.generate", description=__doc__.split("\n")[0])
    p.add_argument("source", help="a Hugging Face model directory or a framework checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: List[str]) -> int:
    args, status = parsed(parser(), argv)
    if args is None:
        return status
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        print("generate: --max-new-tokens must be >= 1, --temperature >= 0, --top-p in (0, 1]", file=sys.stderr)
        return 2
    try:
        model, tokenizer, stop = load_source(args.source)
    except (CheckpointError, ConfigError) as error:
        print(f"generate failed: {error}", file=sys.stderr)
        return 2
    # a model trained with a BOS token (Llama) expects one first, as transformers' tokenizer adds it
    prompt = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode_batch([args.prompt])[0]
    if not prompt:
        print("generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, stop)
    print(args.prompt + tokenizer.decode([t for t in new if t not in stop]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
