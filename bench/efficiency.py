"""Efficiency against this machine's own limits (issue 21), each a ratio from one run:

- the machine's fp32 matmul peak, measured just before each run (the host is shared: the peak
  moves between runs): 2048 x 2048 GEMMs on all cores;
- MFU per mesh, eager and compiled: model FLOP/s (the model's flops_per_token x tokens/s) over
  the peak measured beside that run, on the compute-bound `lm_bench` model (26M parameters,
  8 x 256 tokens per step);
- distributed efficiency: a mesh's tokens/s (all its ranks on the same cores) over the best
  one-process tokens/s of the same model.

tokens/s is the steady state: the global batch's tokens over the median step time from step 3
on (the first step compiles; the second was up to 40% slower here, probably while the heap grows).

    .venv/bin/python bench/efficiency.py [--steps 10] [--meshes 1x1,2x1,1x2,1x2:lm_tp,2x2,2x2:lm_tp] \
        [--modes eager,compiled] [--overrides parallel.overlap_dp_sync=true]

A mesh runs its default plan (PLANS) or the one after the colon: TP meshes are measured with
and without sequence parallelism, whose extra collectives cost more than they save on a CPU.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["recipe=lm_2d", "model=lm_bench", "data.dataset.seq_len=256", "data.global_batch_size=8",
         "trainer.eval_every=null", "trainer.warmup_steps=0", "trainer.grad_clip=null", "trainer.log_every=1",
         "trainer.progress_bar=false", "logger.tensorboard=false"]
TOKENS_PER_STEP = 8 * 256  # data.global_batch_size x seq_len
PLANS = {"1x1": "none", "2x1": "none", "1x2": "lm_tp_sp", "2x2": "lm_tp_sp"}


def matmul_peak(size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of fp32 GEMMs on all of this machine's cores (the best of `repeats`)."""
    torch.set_num_threads(os.cpu_count())
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def tokens_per_s(mesh: str, plan: str, compiled: bool, steps: int, work: Path, overrides: list) -> dict:
    out = work / f"{mesh}_{plan}_{'compiled' if compiled else 'eager'}"
    subprocess.run([sys.executable, "-m", "framework.train", *MODEL, f"mesh={mesh}", f"plan={plan}",
                    f"trainer.max_steps={steps}", f"trainer.compile={'blocks' if compiled else 'none'}",
                    f"hydra.run.dir={out}", *overrides], cwd=ROOT, check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    step_s = statistics.median(summary["step_times_s"][2:])
    return {"tokens_per_s": TOKENS_PER_STEP / step_s, "first_step_s": summary["first_step_s"], "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--meshes", default="1x1,2x1,1x2,1x2:lm_tp,2x2,2x2:lm_tp")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--overrides", default="", help="comma-separated overrides for every run")
    args = parser.parse_args()
    overrides = [o for o in args.overrides.split(",") if o]
    sys.path.insert(0, str(ROOT))
    from framework.models import Transformer

    model = Transformer(vocab_size=256, dim=512, n_layers=8, n_heads=8, hidden_dim=1408)
    flops_per_token = model.flops_per_token(256)
    print(json.dumps({"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                      "flops_per_token_M": round(flops_per_token / 1e6, 1)}))
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-efficiency-") as work:
        for entry in args.meshes.split(","):
            mesh, _, plan = entry.partition(":")
            for compiled in [mode == "compiled" for mode in args.modes.split(",")]:
                peak = matmul_peak()
                rows[mesh, plan or PLANS[mesh], compiled] = {
                    **tokens_per_s(mesh, plan or PLANS[mesh], compiled, args.steps, Path(work), overrides),
                    "peak": peak}
    best_one = max(rows[key]["tokens_per_s"] for key in rows if key[0] == "1x1")
    for (mesh, plan, compiled), row in rows.items():
        print(json.dumps({"mesh": mesh, "plan": plan, "compiled": compiled,
                          "tokens_per_s": round(row["tokens_per_s"], 1),
                          "matmul_peak_gflops": round(row["peak"] / 1e9, 1),
                          "mfu": round(row["tokens_per_s"] * flops_per_token / row["peak"], 3),
                          "distributed_efficiency": round(row["tokens_per_s"] / best_one, 3),
                          "step_s": round(row["step_s"], 3), "first_step_s": round(row["first_step_s"], 1)}),
              flush=True)


if __name__ == "__main__":
    main()
