"""python -m framework.planner [overrides] planner.world=N [planner.device=cpu|h100|h200|a100]
[planner.device_memory_gb=M] [--calibrate] [--confirm K]: the layouts of this run for N ranks,
ranked by predicted step time, with the memory per rank and the command that runs each; the
refused ones with the line that refused them, and those over the device's memory."""
import sys
import time
from typing import List

from framework.cli import command_status, compose_config
from framework.config.errors import ConfigError
from framework.dryrun import human
from framework.planner.confirm import confirm, report
from framework.planner.plan import Plan, check_planner, device_profile, plan

USAGE = ("usage: python -m framework.planner [hydra overrides, e.g. recipe=lm_2d model=lm_small] planner.world=N "
         "[planner.device=cpu|h100|h200|a100] [planner.device_memory_gb=M] [planner.dims=[pp,dp,cp,tp]] "
         "[planner.strategies=[fsdp,hsdp]] [--calibrate] [--confirm K]\n"
         "--calibrate: measure this host's matmul rate and gloo latency / bandwidth again; --confirm K: run the top "
         "K layouts and the last two for real and compare\n"
         "exit 0: a ranked table; 2: a config error, or no layout fits")


def confirm_count(argv: List[str]) -> int:
    """--confirm K's K (0 without it)."""
    if "--confirm" not in argv:
        return 0
    at = argv.index("--confirm")
    if at + 1 >= len(argv) or not argv[at + 1].isdigit() or int(argv[at + 1]) < 1:
        raise ConfigError("--confirm", argv[at + 1] if at + 1 < len(argv) else None,
                          "give how many of the top layouts to run for real, e.g. --confirm 3")
    return int(argv[at + 1])


def run_planner(argv: List[str]) -> int:
    top = confirm_count(argv)
    flags = {"--calibrate", "--confirm", str(top)} if top else {"--calibrate"}
    overrides = [arg for arg in argv if arg not in flags]
    planner = compose_config(overrides).planner
    if top and planner.device != "cpu":
        raise ConfigError("planner.device", planner.device, "--confirm runs the layouts here, on this host's CPU; "
                                                            "plan for planner.device=cpu to confirm")
    check_planner(planner)
    device = device_profile(planner, recalibrate="--calibrate" in argv)
    user = [o for o in overrides if not o.startswith("planner.")]
    start = time.perf_counter()
    try:
        result = plan(user, planner, device)
    finally:
        print(f"planned in {time.perf_counter() - start:.1f} s")
    print_plan(result, user, planner, device)
    if top:
        print(report(confirm(result.ranked, top)))
    return 0


def print_plan(result: Plan, user: List[str], planner, device: dict) -> None:
    source = f"calibrated in {device['calibration']}" if "calibration" in device else "published figures"
    print(f"planner: {planner.world} ranks of {planner.device} ({source}); predicted, not measured:")
    header = ["#", *result.ranked[0][0].labels, "ms/step", "tokens/s", "memory/rank", "command"]
    rows = [[str(i + 1), *candidate.labels.values(), f"{1000 * p.step_s:.1f}", f"{p.tokens_per_s:,.0f}",
             human(p.memory_bytes), "python -m framework.train " + " ".join([*user, *candidate.overrides])]
            for i, (candidate, p) in enumerate(result.ranked)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    limit = f"over {result.memory_gb} GiB" if result.memory_gb else "pruned by memory (planner.device_memory_gb: none)"
    total = len(result.ranked) + len(result.over) + len(result.refused)
    print(f"\n{total} layouts for {planner.world} ranks: {len(result.ranked)} ranked, {len(result.over)} {limit}, "
          f"{len(result.refused)} refused by validation")
    for candidate, prediction in result.over:
        print(f"  over memory: {' '.join(candidate.overrides)}: {human(prediction.memory_bytes)} per rank")
    for candidate in result.refused:
        print(f"  refused: {' '.join(candidate.overrides)}: {candidate.refusal.removeprefix('config error: ')}")


def main(argv: List[str]) -> int:
    return command_status(lambda: run_planner(argv), "planner failed", argv, USAGE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
