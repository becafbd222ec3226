"""framework.generate's decoding speed: milliseconds per new token for 16 and 256 new tokens,
with the KV cache (what generate does) and without it (the whole sequence recomputed for every
token), on a Llama-architecture model of about 30M parameters with random weights.

    .venv/bin/python bench/generate.py [--threads 2]
    .venv/bin/python bench/generate.py --rollout [--rounds 7]

--rollout: GRPO's rollout (framework.models.decode.generate_groups, sampled at temperature 1)
in tokens/s, the decoder before the device-resident one (git BEFORE's framework/generate.py,
sampling on the host, a look at `done` every token) against today's with the stop looked at
every 1, 8 tokens or never and with the compiled step, and the eager step attending over the
static cache's whole buffer (as it did before the CPU's span: StaticCache.span patched to the
capacity), rounds alternating (medians), on grpo_lm's model (lm_tiny: 4 prompts x 8, 8 new
tokens, a DP rank's share), lm_small (32 new) and bench/grpo.py's model (256 wide, 4 blocks, 4 KV
heads: 8 prompts x 8, 64 new tokens).

With the cache each new token attends to the cached keys and values: the time per token stays
about flat as the output grows. Without it the time per token grows with the length.
"""
import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.generate import generate  # noqa: E402
from framework.models.decode import StaticCache, compiled_step, decoding_generators, generate_groups  # noqa: E402
from framework.models.transformer import Transformer  # noqa: E402

PROMPT = list(range(1, 17))
BEFORE = "0d90ed5"  # the last commit with the host-side decoder
LAYER_CACHE_GONE = "9650194"  # the commit that removed LayerCache, which BEFORE's decoder imports
ROOT = Path(__file__).resolve().parents[1]


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


def decoder_before() -> types.ModuleType:
    """framework/generate.py as it was at BEFORE, as a module of its own, with the LayerCache it
    imported as that cache was (framework/models/transformer.py before LAYER_CACHE_GONE)."""
    def source(commit: str, path: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    transformer = source(f"{LAYER_CACHE_GONE}^", "framework/models/transformer.py")
    layer_cache = transformer[transformer.index("class LayerCache"):transformer.index("class Attention(")]
    module = types.ModuleType("generate_before")
    exec("from typing import Optional, Tuple\nimport torch\nfrom framework.models.documents import AttentionLayout, additive_mask\n"
         + layer_cache, module.__dict__)
    decoder = source(BEFORE, "framework/generate.py").replace("from framework.models.transformer import LayerCache\n", "")
    exec(compile(decoder, "generate_before.py", "exec"), module.__dict__)
    return module


def whole_buffer(run):
    """`run` with the eager step attending over every position of the static cache."""
    span, StaticCache.span = StaticCache.span, lambda self, new: self.capacity
    try:
        return run()
    finally:
        StaticCache.span = span


def rollout(args) -> None:
    """Tokens/s of each decoder on each model, rounds alternating, medians (rows x new tokens)."""
    before = decoder_before()
    cpu = torch.device("cpu")
    step = compiled_step(cpu)
    for name, sizes, count, new in (
            ("lm_tiny", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64), 4, 8),
            ("lm_small", dict(dim=128, n_layers=4, n_heads=8, hidden_dim=352), 4, 32),
            ("bench/grpo.py's", dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=688), 8, 64)):
        prompts = [[(7 * p + i) % 250 + 1 for i in range(10 + p)] for p in range(count)]
        torch.manual_seed(0)
        model = Transformer(vocab_size=256, **sizes).eval()
        seeds = list(range(len(prompts)))
        sides = {"before (host sampling, done every token)": lambda: before.generate_groups(
                     model, prompts, 8, new, 1.0, 1.0, [torch.Generator().manual_seed(s) for s in seeds], {0}, 0),
                 **{f"device-resident, done every {k or 'never'}": (lambda k=k: generate_groups(
                     model, prompts, 8, new, 1.0, 1.0, decoding_generators(seeds, cpu), {0}, 0, check_every=k))
                    for k in (1, 8, 0)},
                 "device-resident, compiled step": lambda: generate_groups(
                     model, prompts, 8, new, 1.0, 1.0, decoding_generators(seeds, cpu), {0}, 0,
                     capacity=16 + new, step=step),
                 "device-resident, every 8, whole buffer": lambda: whole_buffer(lambda: generate_groups(
                     model, prompts, 8, new, 1.0, 1.0, decoding_generators(seeds, cpu), {0}, 0))}
        times = {side: [] for side in sides}
        for side, run in sides.items():
            run()  # warm up (and compile)
        for _ in range(args.rounds):
            for side, run in sides.items():
                start = time.perf_counter()
                run()
                times[side].append(time.perf_counter() - start)
        tokens = len(prompts) * 8 * new
        print(f"\n{name}: {len(prompts)} prompts x 8, {new} new tokens, {args.threads} threads")
        print("| decoder | tokens/s (median) |\n|---|---|")
        for side, seconds in times.items():
            print(f"| {side} | {tokens / statistics.median(seconds):,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rollout", action="store_true", help="GRPO's rollout, before and after (tokens/s)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rollout:
        return rollout(args)
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
