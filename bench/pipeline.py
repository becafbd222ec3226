"""Pipeline parallelism on this machine: step time and tokens/s of lm_small with 8 blocks on
pp=2 per schedule and micro-batch count, and the bubble measured against theory.

    .venv/bin/python bench/pipeline.py [--steps 12]

Each pipeline rank runs 1 thread (2 ranks on 2 cores); the reference is the same model on one
process with 1 thread, whose step time T1 is the pipeline's compute if it had no bubble and no
transfers: ideal pp step = T1 / p. Measured bubble (and transfer) share = 1 - (T1 / p) / T_pp;
theory for GPipe and 1F1B: (p - 1) / (m + p - 1). Interleaved schedules run 2 stages per rank.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["recipe=lm_2d", "model=lm_small", "model.n_layers=8", "data.global_batch_size=16", "plan=none",
         "trainer.eval_every=null", "trainer.log_every=1", "trainer.progress_bar=false", "logger.tensorboard=false",
         "launcher.threads_per_rank=1"]
RUNS = [("gpipe", 1, m) for m in (2, 4, 8)] + [("1f1b", 1, m) for m in (2, 4, 8)] + \
       [("interleaved_1f1b", 2, 4), ("zbv_zero_bubble", 2, 4)]


def step_time(overrides: list, steps: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "framework.train", *MODEL, f"trainer.max_steps={steps}", *overrides,
                    f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    return {"step_s": statistics.median(summary["step_times_s"][2:]), "tokens_per_s": summary["tokens_per_s"]}


def activations_per_rank(overrides: list) -> list:
    """Each pp rank's activations (bytes, the most alive at once), as framework.dryrun counts them."""
    from framework.dryrun import compose_config, dry_run

    return [r.activation_bytes for r in dry_run(compose_config([*MODEL, *overrides]))]


def pipeline_overrides(schedule: str, per_rank: int, micro: int) -> list:
    return ["mesh=pp2x1x1", f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={per_rank}",
            f"parallel.pp_microbatches={micro}"]


def print_memory() -> None:
    whole = activations_per_rank(["mesh=1x1", "dryrun.ranks=[0]"])[0]
    print(f"\nactivations saved for backward, most alive at once (MiB; one process: {whole / 2**20:.1f}):")
    print("| schedule | stages/rank | micro-batches | rank 0 | rank 1 |\n|---|---|---|---|---|")
    for schedule, per_rank, micro in RUNS:
        first, second = activations_per_rank([*pipeline_overrides(schedule, per_rank, micro), "dryrun.ranks=[0,1]"])
        print(f"| {schedule} | {per_rank} | {micro} | {first / 2**20:.1f} | {second / 2**20:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    if args.memory_only:
        return print_memory()
    work = Path(tempfile.mkdtemp(prefix="bench_pp_"))
    one = step_time(["mesh=1x1"], args.steps, work / "1x1")
    print(f"one process, 1 thread: {one['step_s'] * 1000:.0f} ms/step, {one['tokens_per_s']:.0f} tokens/s")
    print("| schedule | stages/rank | micro-batches | ms/step | tokens/s | bubble+transfer measured | "
          "bubble theory |\n|---|---|---|---|---|---|---|")
    p = 2
    for schedule, per_rank, micro in RUNS:
        r = step_time(pipeline_overrides(schedule, per_rank, micro), args.steps, work / f"{schedule}_{micro}")
        measured = 1 - (one["step_s"] / p) / r["step_s"]
        stages = p * per_rank
        theory = (p - 1) / (micro * per_rank + p - 1) if per_rank > 1 else (p - 1) / (micro + p - 1)
        print(f"| {schedule} | {per_rank} | {micro} | {r['step_s'] * 1000:.0f} | {r['tokens_per_s']:.0f} | "
              f"{measured:.2f} | {theory:.2f}{' (' + str(stages) + ' stages)' if per_rank > 1 else ''} |")
    print_memory()


if __name__ == "__main__":
    main()
