"""`make bench`: the framework against the hand-written script, same model, mesh and steps.

Alternates framework (a) and hand-written (b) runs, each a fresh launch from this driver, and
prints median step time and time to first step (launch to the end of step 1, as the user waits
for it) for both, with the ratios a / b. Then tokens/s of the framework per mesh shape, then
DataParallel's overlapped gradient sync against waiting for backward and against torch's DDP and
replicate_with_fsdp, then the cost of checkpointing (none, sync and async every 10 steps): mean step time with the saves'
blocking inside, seconds per save (blocking and until written), and seconds to load one.
Absolute times on a shared CPU are noisy; the ratios come from interleaved runs. Both sides
give each rank this host's cores shared out among its ranks (the framework's default,
framework/launch/threads.py), whatever OMP_NUM_THREADS the driver was started with.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from functools import partial
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
# recipe=lm_2d, reduced to the loop both sides share: no eval, no clipping, constant LR.
# Without OMP_NUM_THREADS, so that both sides share out the cores the same way.
ENV = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
FRAMEWORK_SETTINGS = ["recipe=lm_2d", "trainer.eval_every=null", "trainer.grad_clip=null", "trainer.warmup_steps=0",
                      "trainer.lr_decay=constant", "trainer.progress_bar=false", "logger.tensorboard=false"]


def timed_launch(cmd, result_path: Path) -> dict:
    launched = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(result_path.read_text())
    steady = result["step_times_s"][1:]  # step 1 includes warm-up work on both sides
    return {"median_step_s": statistics.median(steady), "first_step_s": result["first_step_done_unix"] - launched,
            "final_loss": result["final_loss"], "tokens_per_s": result.get("tokens_per_s")}


def run_framework(mesh: str, steps: int, work: Path, *overrides: str) -> dict:
    out = work / f"fw-{mesh}-{time.time_ns()}"
    cmd = [PYTHON, "-m", "framework.train", *FRAMEWORK_SETTINGS, f"mesh={mesh}", f"trainer.max_steps={steps}",
           f"trainer.log_every={steps}", f"hydra.run.dir={out}", *overrides]
    return timed_launch(cmd, out / "summary.json")


def run_checkpointing(mode: str, mesh: str, steps: int, work: Path) -> dict:
    """The framework alone, with no checkpoints, or a checkpoint every 10 steps (sync / async):
    mean step time over steps 2..N with the saves' blocking inside, and each save's seconds."""
    out = work / f"ck-{mode}-{time.time_ns()}"
    saving = [] if mode == "none" else ["checkpoint.every=10", f"checkpoint.async_save={mode == 'async'}"]
    cmd = [PYTHON, "-m", "framework.train", *FRAMEWORK_SETTINGS, *saving, f"mesh={mesh}", f"trainer.max_steps={steps}",
           f"trainer.log_every={steps}", f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    saves = summary["checkpoints"]
    result = {"mean_step_s": (summary["wall_s"] - summary["first_step_s"]) / (steps - 1),
              "blocking_s": statistics.mean(s["blocking_s"] for s in saves) if saves else 0.0,
              "total_s": statistics.mean(s["total_s"] for s in saves) if saves else 0.0,
              "final_loss": summary["final_loss"]}
    if saves:  # and the resume: load seconds, on the same mesh
        resumed = out / "resumed"
        subprocess.run([*cmd[:-1], f"hydra.run.dir={resumed}", f"checkpoint.resume={out}/checkpoints/step_10",
                        "trainer.max_steps=11"],
                       cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, check=True)
        result["load_s"] = json.loads((resumed / "summary.json").read_text())["resumed_from"]["load_s"]
    shutil.rmtree(out)
    return result


def interleaved(sides: Dict[str, Callable[[], dict]], repeats: int, label: str,
                rel_tol: float = 0.0) -> Dict[str, List[dict]]:
    """Each side launched once per repeat, in turn, the order reversed every other repeat (so
    machine noise, and whatever a run leaves for the next, hit them alike); stops if their final
    losses differ (beyond `rel_tol`; 0: at all): all must train one model."""
    runs: Dict[str, List[dict]] = {side: [] for side in sides}
    for i in range(repeats):
        for side in list(sides)[::-1 if i % 2 else 1]:
            runs[side].append(sides[side]())
        print(f"{label} repeat {i + 1}/{repeats}: " + ", ".join(f"{side} {r[-1]}" for side, r in runs.items()), flush=True)
        losses = [r[-1]["final_loss"] for r in runs.values()]
        if not all(math.isclose(loss, losses[0], rel_tol=rel_tol) for loss in losses):
            sys.exit(f"{label}: the variants trained differently: final losses {losses}")
    return runs


def checkpoint_costs(mesh: str, steps: int, repeats: int, work: Path) -> None:
    runs = interleaved({mode: partial(run_checkpointing, mode, mesh, steps, work) for mode in ("none", "sync", "async")},
                       repeats, "checkpointing")
    base = statistics.median(r["mean_step_s"] for r in runs["none"])
    print(f"\nlm_small, lm_tp_sp, mesh {mesh}, {steps} steps, checkpoint every 10, {repeats} interleaved repeats (medians)")
    print("| checkpoints | mean step time (s) | overhead | blocking s / save | total s / save | load s |")
    print("|---|---|---|---|---|---|")
    for mode, results in runs.items():
        median = {key: statistics.median(r.get(key, 0.0) for r in results)
                  for key in ("mean_step_s", "blocking_s", "total_s", "load_s")}
        print(f"| {mode} | {median['mean_step_s']:.4f} | {median['mean_step_s'] / base - 1:+.1%} | "
              f"{median['blocking_s']:.3f} | {median['total_s']:.3f} | {median['load_s']:.3f} |", flush=True)


def run_handwritten(mesh: str, steps: int, work: Path, dp_mode: str = "after-backward", compiled: bool = False,
                    bound: bool = False) -> dict:
    dp, tp = mesh.split("x")
    out = work / f"hw-{mesh}-{time.time_ns()}.json"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(int(dp) * int(tp)), "bench/handwritten.py",
           "--mesh", dp, tp, "--steps", str(steps), "--out", str(out), "--dp", dp_mode] + \
        (["--compile"] if compiled else []) + (["--bind-cores"] if bound else [])
    return timed_launch(cmd, out)


def dp_sync_costs(meshes: List[str], steps: int, repeats: int, work: Path) -> None:
    """DataParallel's all-reduce overlapped with backward against waiting for backward to end
    (parallel.overlap_dp_sync), and torch's own DP for the same job: DDP (pure DP only) and
    replicate_with_fsdp; median step time of interleaved launches."""
    for mesh in meshes:
        sides = {"framework, overlapped": partial(run_framework, mesh, steps, work, "parallel.overlap_dp_sync=true"),
                 "framework, after backward": partial(run_framework, mesh, steps, work, "parallel.overlap_dp_sync=false"),
                 "torch DDP": partial(run_handwritten, mesh, steps, work, "ddp"),
                 "torch replicate_with_fsdp": partial(run_handwritten, mesh, steps, work, "replicate")}
        if not mesh.endswith("x1"):
            del sides["torch DDP"]  # DDP cannot take TP's DTensor parameters
        runs = interleaved(sides, repeats, f"DP sync {mesh}", rel_tol=1e-5)
        base = statistics.median(r["median_step_s"] for r in runs["framework, overlapped"])
        print(f"\nlm_small, lm_tp_sp, mesh {mesh}, {steps} steps, {repeats} interleaved repeats (medians)")
        print("| DP | step time (s) | vs framework, overlapped |")
        print("|---|---|---|")
        for side, results in runs.items():
            median = statistics.median(r["median_step_s"] for r in results)
            print(f"| {side} | {median:.4f} | {median / base:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput-meshes", default="1x1,2x1,1x2,2x2", help="empty: skip the tokens/s table")
    parser.add_argument("--checkpoint-steps", type=int, default=40, help="0: skip the checkpoint costs")
    parser.add_argument("--only-checkpoints", action="store_true", help="just the checkpoint costs")
    parser.add_argument("--dp-sync-meshes", default="2x1,2x2", help="empty: skip the DP sync comparison")
    parser.add_argument("--only-dp-sync", action="store_true", help="just the DP sync comparison")
    parser.add_argument("--compile", action="store_true",
                        help="both sides compile each block (trainer.compile=blocks / handwritten.py --compile)")
    parser.add_argument("--bound-hand-written", action="store_true",
                        help="a third side: hand-written with its ranks bound to their cores, as the framework's are")
    args = parser.parse_args()
    if args.only_checkpoints or args.only_dp_sync:
        with tempfile.TemporaryDirectory(prefix="framework-bench-") as tmp:
            if args.only_checkpoints:
                checkpoint_costs(args.mesh, args.checkpoint_steps, args.repeats, Path(tmp))
            else:
                dp_sync_costs(args.dp_sync_meshes.split(","), args.steps, args.repeats, Path(tmp))
        return
    with tempfile.TemporaryDirectory(prefix="framework-bench-") as tmp:
        work = Path(tmp)
        compiled = ["trainer.compile=blocks"] if args.compile else []
        sides = {"framework": partial(run_framework, args.mesh, args.steps, work, *compiled),
                 "hand-written": partial(run_handwritten, args.mesh, args.steps, work, compiled=args.compile)}
        if args.bound_hand_written:
            sides["hand-written, bound"] = partial(run_handwritten, args.mesh, args.steps, work, compiled=args.compile,
                                                   bound=True)
        runs = interleaved(sides, args.repeats, "framework vs hand-written", rel_tol=1e-5)
        medians = {side: {key: statistics.median(r[key] for r in results) for key in ("median_step_s", "first_step_s")}
                   for side, results in runs.items()}
        a = medians["framework"]
        print(f"\nlm_small, lm_tp_sp, mesh {args.mesh}, {args.steps} steps, {args.repeats} interleaved repeats (medians)"
              + (", both sides compiled per block" if args.compile else ""))
        for other in list(medians)[1:]:
            b = medians[other]
            print(f"\n| | framework | {other} | framework / {other} |")
            print("|---|---|---|---|")
            print(f"| step time (s) | {a['median_step_s']:.4f} | {b['median_step_s']:.4f} | "
                  f"{a['median_step_s'] / b['median_step_s']:.3f} |")
            print(f"| time to first step (s) | {a['first_step_s']:.2f} | {b['first_step_s']:.2f} | "
                  f"{a['first_step_s'] / b['first_step_s']:.3f} |")
        if args.throughput_meshes:
            print("\n| mesh | tokens/s (framework) |")
            print("|---|---|")
            for mesh in args.throughput_meshes.split(","):
                print(f"| {mesh} | {run_framework(mesh, args.steps, work)['tokens_per_s']:.0f} |", flush=True)
        if args.dp_sync_meshes:
            dp_sync_costs(args.dp_sync_meshes.split(","), args.steps, args.repeats, work)
        if args.checkpoint_steps:
            checkpoint_costs(args.mesh, args.checkpoint_steps, args.repeats, work)


if __name__ == "__main__":
    main()
