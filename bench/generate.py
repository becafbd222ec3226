"""framework.generate's decoding speed: milliseconds per new token for 16 and 256 new tokens,
with the KV cache (what generate does) and without it (the whole sequence recomputed for every
token), on a Llama-architecture model of about 30M parameters with random weights.

    .venv/bin/python bench/generate.py [--threads 2]

With the cache each new token attends to the cached keys and values: the time per token stays
about flat as the output grows. Without it the time per token grows with the length.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.generate import generate  # noqa: E402
from framework.models.transformer import Transformer  # noqa: E402

PROMPT = list(range(1, 17))


@torch.no_grad()
def without_cache(model: Transformer, prompt: list, new_tokens: int) -> list:
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def ms_per_token(fn, new_tokens: int) -> float:
    fn(4)  # warm up
    start = time.perf_counter()
    fn(new_tokens)
    return (time.perf_counter() - start) * 1000 / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, hidden_dim=1536,
                        rope_halves=True).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.0f}M parameters, prompt {len(PROMPT)} tokens, {args.threads} threads")
    cached = lambda n: generate(model, PROMPT, n)  # noqa: E731
    recomputed = lambda n: without_cache(model, PROMPT, n)  # noqa: E731
    assert cached(32) == recomputed(32), "the KV cache changes the greedy output"
    print("| new tokens | with KV cache (ms/token) | recomputing the prefix (ms/token) |\n|---|---|---|")
    for n in (16, 256):
        print(f"| {n} | {ms_per_token(cached, n):.1f} | {ms_per_token(recomputed, n):.1f} |")


if __name__ == "__main__":
    main()
