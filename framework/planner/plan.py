"""The planner's ranking, shared by its command (framework.planner) and mesh=auto
(framework.planner.auto): every candidate validated, dry-run, predicted, and ranked by step time."""
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from framework.config.errors import ConfigError
from framework.dryrun import GIB, RankReport, dry_run, human
from framework.parallel.roles import MeshRoles
from framework.planner.calibrate import cpu_profile, default_path
from framework.planner.candidates import Candidate, candidates
from framework.planner.cost import Prediction, predict

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles.yaml")


@dataclass
class Plan:
    ranked: List[Tuple[Candidate, Prediction]] = field(default_factory=list)  # fastest first
    over: List[Tuple[Candidate, Prediction]] = field(default_factory=list)  # over the device's memory
    refused: List[Candidate] = field(default_factory=list)  # by validation
    memory_gb: Optional[float] = None


def device_profile(planner, recalibrate: bool = False) -> dict:
    """The device's figures: `cpu` measured on this host (planner.calibration), the others published."""
    with open(PROFILES) as f:
        published = yaml.safe_load(f)
    if planner.device == "cpu":
        return cpu_profile(planner.calibration or default_path(), recalibrate)
    if planner.device not in published:
        raise ConfigError("planner.device", planner.device, f"is not a device profile; use cpu (measured here) or "
                                                            f"one of {sorted(published)} ({PROFILES})")
    return published[planner.device]


def simulated_ranks(cfg) -> List[int]:
    """Rank 0, and under pipeline parallelism the first rank of the last stage (other layers)."""
    roles = MeshRoles.from_config(cfg)
    return [0] if roles.pp_size == 1 else [0, roles.world - roles.world // roles.pp_size]


def rehearse(candidate: Candidate, device: dict) -> Tuple[Prediction, List[RankReport]]:
    """The candidate's prediction, and the dry-run reports it comes from."""
    cfg = OmegaConf.merge(candidate.cfg, {"dryrun": {"ranks": simulated_ranks(candidate.cfg), "device_memory_gb": None}})
    reports = dry_run(cfg)
    return predict(candidate.cfg, reports, device), reports


def plan(user_overrides: List[str], planner, device: dict) -> Plan:
    """Every layout for planner.world ranks; refused (ConfigError) when none fits the memory."""
    if planner.world is None or planner.world < 1:
        raise ConfigError("planner.world", planner.world, "give the number of ranks to plan for, e.g. planner.world=8")
    result = Plan(memory_gb=planner.device_memory_gb or device.get("memory_gb"))
    for candidate in candidates(user_overrides, planner.world):
        if candidate.refusal is not None:
            result.refused.append(candidate)
            continue
        prediction, _ = rehearse(candidate, device)
        fits = result.memory_gb is None or prediction.memory_bytes <= result.memory_gb * GIB
        (result.ranked if fits else result.over).append((candidate, prediction))
    result.ranked.sort(key=lambda pair: pair[1].step_s)
    if not result.ranked and not result.over:
        first = result.refused[0]
        raise ConfigError("planner.world", planner.world, f"validation refuses every layout; the first, "
                                                          f"{' '.join(first.overrides)}, with: "
                                                          f"{first.refusal.removeprefix('config error: ')}")
    if not result.ranked:
        smallest = min((p for _, p in result.over), key=lambda p: p.memory_bytes, default=None)
        need = f"; the smallest layout needs {human(smallest.memory_bytes)} per rank" if smallest else ""
        raise ConfigError("planner.world", planner.world, f"no layout fits {result.memory_gb} GiB per rank "
                                                          f"(planner.device_memory_gb){need}: more ranks, a smaller "
                                                          f"batch, or a larger device")
    return result
