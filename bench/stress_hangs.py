"""Hang hunting: many short launches of the configurations seen hanging, each with a deadline,
counting the runs that stall and keeping every stalled run's per-rank stacks.

    python bench/stress_hangs.py --runs 20 --configs lm_tiny lm_small handwritten --out /tmp/hangs

Framework runs get a short trainer.stall_timeout_s: a stalled run fails by itself with each
rank's stage and collective, and its job dir (logs/rank<N>.log hold all threads' stacks) is
kept. The hand-written baseline has no watchdog: past its deadline every process of the run
gets SIGUSR1 (faulthandler writes its stacks to the run's log) and is then killed. Finished
runs' dirs are deleted; results.jsonl gets one line per run as it ends, summary.json the counts.
With --debug-collectives every rank runs under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch checks each
collective's type and shapes against the other ranks of its group before running it, so ranks
that issue their collectives in different orders fail at once, naming both, instead of hanging.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
FRAMEWORK = ["recipe=lm_2d", "mesh=2x2", "plan=lm_tp_sp", "trainer.eval_every=null", "trainer.progress_bar=false",
             "logger.tensorboard=false", "trainer.check_replicas_every=null"]


def command(config: str, steps: int, stall_s: int, run_dir: Path) -> list:
    if config == "handwritten":
        return [TORCHRUN, "--standalone", "--nproc-per-node", "4", "bench/handwritten.py", "--mesh", "2", "2",
                "--steps", str(steps), "--out", str(run_dir / "result.json")]
    return [PYTHON, "-m", "framework.train", *FRAMEWORK, f"model={config}", f"trainer.max_steps={steps}",
            f"trainer.log_every={steps}", f"trainer.stall_timeout_s={stall_s}", f"hydra.run.dir={run_dir}"]


def one_run(config: str, steps: int, stall_s: int, deadline_s: float, run_dir: Path, env: dict) -> dict:
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    with open(run_dir / "console.log", "w") as log:
        process = subprocess.Popen(command(config, steps, stall_s, run_dir), cwd=ROOT, stdout=log, stderr=log,
                                   env=env, start_new_session=True)
        try:
            code = process.wait(timeout=deadline_s)
            outcome = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGUSR1)  # faulthandler in the hand-written ranks
            time.sleep(2)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code, outcome = None, "hung past the deadline"
    console = (run_dir / "console.log").read_text()
    if outcome == "failed" and "stalled:" in console:
        outcome = "stalled"
    last = console.strip().splitlines()[-1] if console.strip() else ""
    return {"config": config, "outcome": outcome, "exit": code, "seconds": round(time.monotonic() - started, 1),
            "dir": str(run_dir), "last_line": last if outcome != "ok" else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per configuration")
    parser.add_argument("--configs", nargs="+", default=["lm_tiny", "lm_small", "handwritten"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stall-timeout-s", type=int, default=30)
    parser.add_argument("--deadline-s", type=float, default=240, help="per run; past it the run counts as hung")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--debug-collectives", action="store_true", help="TORCH_DISTRIBUTED_DEBUG=DETAIL")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if args.debug_collectives else {})}
    args.out.mkdir(parents=True, exist_ok=True)
    counts = {c: {"runs": 0, "ok": 0, "stalled": 0, "hung past the deadline": 0, "failed": 0} for c in args.configs}
    for i in range(args.runs):
        for config in args.configs:  # interleaved: load on the machine hits every config alike
            result = one_run(config, args.steps, args.stall_timeout_s, args.deadline_s, args.out / f"{config}-{i:03d}", env)
            counts[config]["runs"] += 1
            counts[config][result["outcome"]] += 1
            if result["outcome"] == "ok":
                shutil.rmtree(result["dir"])
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), flush=True)
            (args.out / "summary.json").write_text(json.dumps(counts, indent=2))
    print(f"{'config':<12} {'runs':>5} {'ok':>5} {'stalled':>8} {'hung':>5} {'failed':>7}")
    for config, c in counts.items():
        print(f"{config:<12} {c['runs']:>5} {c['ok']:>5} {c['stalled']:>8} {c['hung past the deadline']:>5} "
              f"{c['failed']:>7}")


if __name__ == "__main__":
    main()
