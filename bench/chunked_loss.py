"""trainer.loss_chunk_tokens on the CPU: peak memory and step time of the LM loss by chunks of
tokens against whole logits, on an lm_small-shaped model with a large vocabulary. Each side runs
in a fresh process (its peak RSS is the process's, ru_maxrss), alternating sides, N repeats.

    .venv/bin/python bench/chunked_loss.py                      # vocab 32768, 4 x 512 tokens, chunks of 512
    .venv/bin/python bench/chunked_loss.py --vocab 65536 --repeats 3
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one_side(vocab: int, rows: int, seq: int, chunk: int, steps: int) -> dict:
    """In this process: `steps` AdamW steps of the LM objective; the median step's seconds, the
    peak RSS over the one before the first step (MB)."""
    import torch

    from framework.data.batch import Batch
    from framework.models import Transformer
    from framework.training.objectives.head import OutputHead
    from framework.training.objectives.lm import NextTokenCrossEntropy

    torch.manual_seed(0)
    model = Transformer(vocab_size=vocab, dim=128, n_layers=4, n_heads=8, hidden_dim=352)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    objective = NextTokenCrossEntropy()
    objective.head = OutputHead(model.output, chunk=chunk)
    tokens = torch.randint(0, vocab, (rows, seq + 1))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = objective.loss_sum(objective.forward(model, batch), batch.targets) / batch.targets.numel()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"step_s": sorted(times[1:])[len(times[1:]) // 2], "peak_over_start_mb": (peak - before) / 1024,
            "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)  # (a child's chunk)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(one_side(args.vocab, args.rows, args.seq, args.side, args.steps)))
        return
    results = {"whole": [], "chunks": []}
    for _ in range(args.repeats):
        for name, chunk in (("whole", 0), ("chunks", args.chunk)):
            out = subprocess.run([sys.executable, __file__, "--side", str(chunk), "--vocab", str(args.vocab), "--rows",
                                  str(args.rows), "--seq", str(args.seq), "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    for name, runs in results.items():
        print(name, [f"{r['step_s']:.3f} s, +{r['peak_over_start_mb']:.0f} MB" for r in runs],
              "losses", [round(x, 4) for x in runs[0]["losses"]])


if __name__ == "__main__":
    main()
