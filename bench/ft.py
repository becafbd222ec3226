"""Per-step fault tolerance (launcher.fault_tolerance=torchft) on this machine: two replica groups
of two TP ranks (mesh 2x2, the tiny LM with TP + SP inside each group).

1. Overhead when nothing fails: the median steady step time of torchft's replica groups against
   plain replicate on the same mesh, runs alternated.
2. Chaos: one run of --steps steps with --kills kill -9s of a random rank of a random group at
   random moments (each once the previous victim has rejoined). Per failure: the steps the
   healthy group redid (not committed), its pause (the failed step's time over the median), the
   steps it trained alone, and the victim's time from the kill to its heal; against today's
   restart, which loses the steps since the last checkpoint on every replica.

    .venv/bin/python bench/ft.py [--steps 300] [--kills 3] [--repeats 2]
"""
import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["recipe=lm_2d", "model=lm_tiny", "data.dataset.seq_len=64", "trainer.eval_every=null",
          "trainer.progress_bar=false", "logger.tensorboard=false", "trainer.log_every=50"]
FT = ["launcher.fault_tolerance=torchft"]


def train(overrides: list, out: Path, wait: bool = True):
    command = [sys.executable, "-m", "framework.train", *COMMON, *overrides, f"hydra.run.dir={out}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if wait:
        _, err = process.communicate()
        assert process.returncode == 0, err
    return process


def steady_step_s(summary_path: Path) -> float:
    return statistics.median(json.loads(summary_path.read_text())["step_times_s"][10:])


def overhead(steps: int, repeats: int, tmp: Path) -> dict:
    times = {"replicate": [], "torchft": []}
    for repeat in range(repeats):
        for name, extra in (("replicate", []), ("torchft", FT)):
            out = tmp / f"{name}{repeat}"
            train([f"trainer.max_steps={steps}", *extra], out)
            times[name].append(steady_step_s(out / "summary.json"))
    return {name: statistics.median(values) for name, values in times.items()}


def ranks_of(group: int) -> list:
    """PIDs of replica group `group`'s rank processes (their environment says which)."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"FRAMEWORK_REPLICA_GROUP={group}/2".encode() in environ and any(e.startswith(b"RANK=") for e in environ):
            pids.append(int(pid))
    return pids


def log_time(line: str) -> float:
    stamp = re.search(r"\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line).group(1)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def heals(out: Path, group: int) -> list:
    log = out / f"replica_group_{group}" / "logs" / "rank0.log"
    return [line for line in log.read_text().splitlines() if "healed from a live group" in line] if log.exists() else []


def chaos(steps: int, kills: int, tmp: Path, seed: int = 0) -> dict:
    rng = random.Random(seed)
    out = tmp / "chaos"
    process = train([f"trainer.max_steps={steps}", *FT, "launcher.max_restarts=3", "checkpoint.every=50"],
                    out, wait=False)
    events = []
    time.sleep(rng.uniform(10, 15))
    for _ in range(kills):
        group = rng.randrange(2)
        pids = ranks_of(group)
        healed_before = len(heals(out, group))
        victim = rng.choice(pids)
        os.kill(victim, signal.SIGKILL)
        events.append({"group": group, "killed_at": time.time(), "rank_pids": len(pids)})
        while len(heals(out, group)) == healed_before and process.poll() is None:
            time.sleep(0.2)
        if process.poll() is not None:
            break
        events[-1]["rejoin_s"] = log_time(heals(out, group)[-1]) - events[-1]["killed_at"]
        time.sleep(rng.uniform(3, 8))
    _, err = process.communicate()
    assert process.returncode == 0, err
    for event in events:
        healthy = 1 - event["group"]
        summary = json.loads((out / f"replica_group_{healthy}" / "summary.json").read_text())
        log = (out / f"replica_group_{healthy}" / "logs" / "rank0.log").read_text().splitlines()
        redone = [line for line in log if "not committed" in line and log_time(line) >= event["killed_at"] - 1]
        step = int(re.search(r"step (\d+) not committed", redone[0]).group(1)) if redone else None
        median = statistics.median(summary["step_times_s"])
        live = summary["live_replica_groups"]
        event.update(failed_step=step, redone_steps=len({line for line in redone if f"step {step} " in line}),
                     pause_s=summary["step_times_s"][step - 1] - median if step else None,
                     alone_steps=(live.index(2, step - 1) - (step - 1)) if step and 2 in live[step - 1:] else None,
                     restart_would_lose=2 * ((step - 1) % 50) if step else None)
    final = [json.loads((out / f"replica_group_{g}" / "summary.json").read_text()) for g in (0, 1)]
    return {"events": events, "final_losses_equal": final[0]["losses"] == final[1]["losses"],
            "steps": final[0]["steps"], "median_step_s": statistics.median(final[0]["step_times_s"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        times = overhead(100, args.repeats, Path(tmp))
        print(f"steady step, mesh 2x2 lm_tiny TP+SP: replicate {times['replicate'] * 1e3:.1f} ms, torchft replica "
              f"groups {times['torchft'] * 1e3:.1f} ms ({times['torchft'] / times['replicate'] - 1:+.1%})")
        result = chaos(args.steps, args.kills, Path(tmp))
        print(f"chaos: {result['steps']} steps, median step {result['median_step_s'] * 1e3:.1f} ms, groups' "
              f"loss histories equal: {result['final_losses_equal']}")
        print("| kill | group | failed step | redone | healthy group's pause s | steps alone | rejoin s | "
              "restart would lose (steps x replicas) |")
        for i, e in enumerate(result["events"]):
            print(f"| {i + 1} | {e['group']} | {e['failed_step']} | {e['redone_steps']} | {e['pause_s']:.2f} | "
                  f"{e['alone_steps']} | {e.get('rejoin_s', float('nan')):.1f} | {e['restart_would_lose']} |")


if __name__ == "__main__":
    main()
