"""Per-step fault tolerance (launcher.fault_tolerance=torchft) on this machine: two replica groups
of two TP ranks (mesh 2x2, the tiny LM with TP + SP inside each group).

1. Overhead when nothing fails: the median steady step time of torchft's replica groups against
   plain replicate on the same mesh (--mesh 2x2, or 2x1: one rank per group), runs alternated.
2. Chaos: one run of --steps steps with --kills kill -9s of a random rank of group 1 at random
   moments (each once it has rejoined; group 0, never killed, keeps its own step times: a healed
   group takes the history of the group it heals from). Per failure: the steps the
   healthy group redid (not committed), its pause (the failed step's time over the median), the
   steps it trained alone, and the victim's time from the kill to its heal; against today's
   restart, which loses the steps since the last checkpoint on every replica.

    .venv/bin/python bench/ft.py [--steps 300] [--kills 3] [--repeats 2] [--mesh 2x1] [--detection]
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
COMMON = ["recipe=lm_2d", "data.dataset.seq_len=64", "trainer.eval_every=null",
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


def overhead(model: list, steps: int, repeats: int, tmp: Path) -> dict:
    times = {"replicate": [], "torchft": []}
    for repeat in range(repeats):
        for name, extra in (("replicate", []), ("torchft", FT)):
            out = tmp / f"{name}{repeat}-{model[0].split('=')[1]}"
            train([f"trainer.max_steps={steps}", *extra, *model], out)
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


def chaos(steps: int, kills: int, detection_s: float, tmp: Path, seed: int = 0) -> dict:
    rng = random.Random(seed)
    out = tmp / f"chaos{detection_s:g}"
    process = train([f"trainer.max_steps={steps}", "model=lm_tiny", *FT, f"launcher.max_restarts={kills}", "checkpoint.every=50",
                     f"launcher.ft_detection_s={detection_s}"], out, wait=False)
    events = []
    time.sleep(rng.uniform(20, 25))  # past start-up (about 8 s here)
    for _ in range(kills):
        group = 1
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
    previous = 0  # the healthy group's steps up to the previous victim's heal
    for i, event in enumerate(events):
        healthy = 1 - event["group"]
        summary = json.loads((out / f"replica_group_{healthy}" / "summary.json").read_text())
        log = (out / f"replica_group_{healthy}" / "logs" / "rank0.log").read_text().splitlines()
        until = events[i + 1]["killed_at"] if i + 1 < len(events) else float("inf")
        redone = [line for line in log if "not committed" in line and event["killed_at"] - 0.5 <= log_time(line) < until]
        healed = int(re.search(r"at step (\d+)", heals(out, event["group"])[i - sum(
            e["group"] != event["group"] for e in events[:i])]).group(1))
        window = summary["step_times_s"][previous:healed + 1]  # the failure lies in these steps
        slowest = previous + window.index(max(window)) + 1
        event.update(healed_at=healed, slowest_step=slowest, redone_steps=len(redone),
                     pause_s=max(window) - statistics.median(summary["step_times_s"]),
                     alone_steps=summary["live_replica_groups"][previous:healed + 1].count(1),
                     restart_would_lose=2 * ((slowest - 1) % 50))
        previous = healed + 1
    final = [json.loads((out / f"replica_group_{g}" / "summary.json").read_text()) for g in (0, 1)]
    return {"events": events, "final_losses_equal": final[0]["losses"] == final[1]["losses"],
            "steps": final[0]["steps"], "median_step_s": statistics.median(final[0]["step_times_s"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--detection", type=float, nargs="*", default=[5.0, 2.0],
                        help="launcher.ft_detection_s of each chaos run (none given: no chaos run)")
    parser.add_argument("--mesh", default="2x2", help="the overhead runs' mesh: 2x2 (TP+SP in a group) or 2x1")
    parser.add_argument("--out", help="keep the runs here (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.out or tmp
        for model in (["model=lm_tiny"], ["model=lm_small", "data.dataset.seq_len=128"])[: 2 if args.repeats else 0]:
            mesh = [f"mesh={args.mesh}"] + (["plan=none"] if args.mesh == "2x1" else [])
            times = overhead([*model, *mesh], 100, args.repeats, Path(tmp))
            print(f"steady step (median of {args.repeats} runs' medians), {' '.join(model + mesh)}: replicate "
                  f"{times['replicate'] * 1e3:.1f} ms, torchft replica groups {times['torchft'] * 1e3:.1f} ms "
                  f"({times['torchft'] / times['replicate'] - 1:+.1%})")
        for detection_s in args.detection:
            result = chaos(args.steps, args.kills, detection_s, Path(tmp))
            print(f"chaos, ft_detection_s={detection_s:g}: {result['steps']} steps, median step "
                  f"{result['median_step_s'] * 1e3:.1f} ms, groups' loss histories equal: {result['final_losses_equal']}")
            print("| kill | slowest step | steps redone | group 0's pause s | steps alone | rejoin s | healed at step | "
                  "a full restart would lose (steps x replicas) |")
            for i, e in enumerate(result["events"]):
                print(f"| {i + 1} | {e['slowest_step']} | {e['redone_steps']} | {e['pause_s']:.2f} | {e['alone_steps']} | "
                      f"{e.get('rejoin_s', float('nan')):.1f} | {e['healed_at']} | {e['restart_would_lose']} |")


if __name__ == "__main__":
    main()
