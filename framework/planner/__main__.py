"""python -m framework.planner [overrides] planner.world=N [planner.device=cpu|h100|h200|a100]
[planner.device_memory_gb=M] [--calibrate]: the layouts of this run for N ranks, ranked by
predicted step time, with the memory per rank and the command that runs each; the refused ones
with the line that refused them, and those over the device's memory."""
import os
import sys
import time
from typing import List, Tuple

import yaml
from omegaconf import OmegaConf

from framework.cli import command_status, compose_config
from framework.config.errors import ConfigError
from framework.dryrun import GIB, RankReport, dry_run, human
from framework.parallel.roles import MeshRoles
from framework.planner.calibrate import cpu_profile, default_path
from framework.planner.candidates import Candidate, candidates
from framework.planner.confirm import confirm, report
from framework.planner.cost import Prediction, predict

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles.yaml")
USAGE = ("usage: python -m framework.planner [hydra overrides, e.g. recipe=lm_2d model=lm_small] planner.world=N "
         "[planner.device=cpu|h100|h200|a100] [planner.device_memory_gb=M] [--calibrate] [--confirm K]\n"
         "--calibrate: measure this host's matmul rate and gloo latency / bandwidth again; --confirm K: run the top "
         "K layouts and the last two for real and compare\n"
         "exit 0: a ranked table; 2: a config error, or no layout fits")


def device_profile(planner) -> dict:
    """The device's figures: `cpu` measured on this host (planner.calibration), the others published."""
    with open(PROFILES) as f:
        published = yaml.safe_load(f)
    if planner.device == "cpu":
        return cpu_profile(planner.calibration or default_path(), planner.get("recalibrate", False))
    if planner.device not in published:
        raise ConfigError("planner.device", planner.device, f"is not a device profile; use cpu (measured here) or "
                                                            f"one of {sorted(published)} ({PROFILES})")
    return published[planner.device]


def simulated_ranks(cfg) -> List[int]:
    """Rank 0, and under pipeline parallelism the first rank of the last stage (other layers)."""
    roles = MeshRoles.from_config(cfg)
    return [0] if roles.pp_size == 1 else [0, roles.world - roles.world // roles.pp_size]


def rehearse(candidate: Candidate, device: dict) -> Tuple[Prediction, List[RankReport]]:
    """The candidate's prediction, and the dry-run reports it comes from (fsdp dry-run as replicate)."""
    cfg = OmegaConf.merge(candidate.cfg, {"parallel": {"dp_strategy": "replicate"},
                                          "dryrun": {"ranks": simulated_ranks(candidate.cfg), "device_memory_gb": None}})
    reports = dry_run(cfg)
    return predict(candidate.cfg, reports, device), reports


def plan(argv: List[str]) -> int:
    recalibrate = "--calibrate" in argv
    top = None
    if "--confirm" in argv:
        at = argv.index("--confirm")
        if at + 1 >= len(argv) or not argv[at + 1].isdigit() or int(argv[at + 1]) < 1:
            raise ConfigError("--confirm", argv[at + 1] if at + 1 < len(argv) else None,
                              "give how many of the top layouts to run for real, e.g. --confirm 3")
        top, argv = int(argv[at + 1]), argv[:at] + argv[at + 2:]
    overrides = [arg for arg in argv if arg != "--calibrate"]
    cfg = compose_config(overrides)
    planner = cfg.planner
    if top and planner.device != "cpu":
        raise ConfigError("planner.device", planner.device, "--confirm runs the layouts here, on this host's CPU; "
                                                            "plan for planner.device=cpu to confirm")
    if planner.world is None or planner.world < 1:
        raise ConfigError("planner.world", planner.world, "give the number of ranks to plan for, e.g. planner.world=8")
    with_recalibration = {**planner, "recalibrate": recalibrate}
    device = device_profile(OmegaConf.create(with_recalibration))
    memory_gb = planner.device_memory_gb or device.get("memory_gb")
    user = [o for o in overrides if not o.startswith("planner.")]
    start = time.perf_counter()
    found = candidates(user, planner.world)
    feasible, over = [], []
    for candidate in (c for c in found if c.refusal is None):
        prediction, _ = rehearse(candidate, device)
        fits = memory_gb is None or prediction.memory_bytes <= memory_gb * GIB
        (feasible if fits else over).append((candidate, prediction))
    feasible.sort(key=lambda pair: pair[1].step_s)
    print_table(feasible, user, planner, device)
    refused = [c for c in found if c.refusal is not None]
    limit = f"over {memory_gb} GiB" if memory_gb else "pruned by memory (planner.device_memory_gb: none)"
    print(f"\n{len(found)} layouts for {planner.world} ranks: {len(feasible)} ranked, {len(over)} {limit}, "
          f"{len(refused)} refused by validation ({time.perf_counter() - start:.1f} s)")
    for candidate, prediction in over:
        print(f"  over memory: {' '.join(candidate.overrides)}: {human(prediction.memory_bytes)} per rank")
    for candidate in refused:
        print(f"  refused: {' '.join(candidate.overrides)}: {candidate.refusal.removeprefix('config error: ')}")
    if not feasible:
        smallest = min((p for _, p in over), key=lambda p: p.memory_bytes, default=None)
        need = f"; the smallest layout needs {human(smallest.memory_bytes)} per rank" if smallest else ""
        raise ConfigError("planner.world", planner.world, f"no layout fits {memory_gb} GiB per rank "
                                                          f"(planner.device_memory_gb){need}: more ranks, a smaller "
                                                          f"batch, or a larger device")
    if top:
        print(report(confirm(feasible, top)))
    return 0


def print_table(ranked: List, user: List[str], planner, device: dict) -> None:
    source = f"calibrated in {device['calibration']}" if "calibration" in device else "published figures"
    print(f"planner: {planner.world} ranks of {planner.device} ({source}); predicted, not measured:")
    header = ["#", *ranked[0][0].labels] if ranked else ["#"]
    rows = [[str(i + 1), *candidate.labels.values(), f"{1000 * p.step_s:.1f}", f"{p.tokens_per_s:,.0f}",
             human(p.memory_bytes), "python -m framework.train " + " ".join([*user, *candidate.overrides])]
            for i, (candidate, p) in enumerate(ranked)]
    header += ["ms/step", "tokens/s", "memory/rank", "command"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


def main(argv: List[str]) -> int:
    return command_status(lambda: plan(argv), "planner failed", argv, USAGE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
