"""Mixture of experts on this machine: lm_moe_small's tokens/s with the experts over 1, 2 and 4
ranks against one process, the all-to-all count and bytes of a step (the dry run's, which run the
same collectives as real ranks) against the analytic count, and the grouped GEMM against the
per-expert loop in bf16 (where both run).

    .venv/bin/python bench/moe.py [--steps 20] [--repeats 20]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from framework.dryrun import compose_config, dry_run  # noqa: E402
from framework.models.moe import swiglu_grouped, swiglu_per_expert  # noqa: E402

COMMON = ["recipe=lm_moe", "trainer.eval_every=null", "trainer.progress_bar=false", "logger.tensorboard=false"]
LAYOUTS = [("1x1 (one process, all experts)", ["mesh=1x1", "plan=none", "parallel.ep_dims=null"]),
           ("2x1, experts replicated", ["mesh=2x1", "plan=none", "parallel.ep_dims=null"]),
           ("2x1, experts over 2 ranks", ["mesh=2x1", "plan=none", "parallel.ep_dims=[dp]"]),
           ("4x1, experts over 4 ranks", ["mesh=4x1", "plan=none", "parallel.ep_dims=[dp]"]),
           ("2x2, attention TP, experts over the 2 DP ranks", ["mesh=2x2", "parallel.ep_dims=[dp]"]),
           ("2x2, attention TP, experts over all 4 ranks", ["mesh=2x2", "parallel.ep_dims=[dp,tp]"])]


def tokens_per_s(overrides: list, steps: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "framework.train", *COMMON, f"trainer.max_steps={steps}", *overrides,
                    f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "final_loss": summary["final_loss"]}


def all_to_alls(overrides: list) -> tuple:
    """(count, bytes in) of rank 0's token all-to-alls in one step, and the analytic bytes: each
    block sends this rank's token slots (tokens x top_k x dim x 4 B; under TP its share) out and
    back, forward and backward."""
    cfg = compose_config([*COMMON, *overrides])
    report = dry_run(cfg)[0]
    count, size = map(sum, zip(*[v for (op, _), v in report.collectives.items()
                                 if op == "c10d_functional.all_to_all_single"]))
    m, roles_tp = cfg.model, (2 if "[dp,tp]" in " ".join(overrides) else 1)
    tokens = cfg.data.global_batch_size // cfg.mesh.shape[0] * cfg.data.dataset.seq_len // roles_tp
    analytic = 4 * m.n_layers * tokens * m.moe.top_k * m.dim * 4
    return count, size, analytic


def grouped_against_loop(repeats: int) -> list:
    """lm_moe_small's experts on one rank: 8 experts of width 128 on dim 128, 16 x 128 tokens x top 2
    routed at random; forward + backward in bf16, alternating the two, median ms."""
    torch.manual_seed(0)
    slots, experts, dim, hidden = 16 * 128 * 2, 8, 128, 128
    counts = torch.bincount(torch.randint(0, experts, (slots,)), minlength=experts).tolist()
    tokens = torch.randn(slots, dim, dtype=torch.bfloat16, requires_grad=True)
    weights = [(torch.randn(experts, *shape) * 0.05).bfloat16().requires_grad_()
               for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    times = {swiglu_grouped: [], swiglu_per_expert: []}
    for _ in range(repeats):
        for swiglu in times:
            start = time.perf_counter()
            swiglu(tokens, *weights, counts).float().square().sum().backward()
            times[swiglu].append(time.perf_counter() - start)
    return [(f.__name__, 1000 * statistics.median(t)) for f, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| layout | tokens/s | final loss | token all-to-alls per step | bytes in (dry run) | analytic |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for i, (name, overrides) in enumerate(LAYOUTS):
            result = tokens_per_s(overrides, args.steps, Path(work) / str(i))
            count, size, analytic = all_to_alls(overrides) if "ep_dims=[" in " ".join(overrides) else (0, 0, 0)
            print(f"| {name} | {result['tokens_per_s']:,.0f} | {result['final_loss']:.6f} | {count} | "
                  f"{size / 2**20:.2f} MiB | {analytic / 2**20:.2f} MiB |")
    print("\n| experts in bf16, forward + backward | ms |\n|---|---|")
    for name, ms in grouped_against_loop(args.repeats):
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
