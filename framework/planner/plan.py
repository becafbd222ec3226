"""The planner's ranking, shared by its command (framework.planner) and mesh=auto
(framework.planner.auto): every candidate validated, dry-run, predicted, and ranked by step time."""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from omegaconf import OmegaConf

from framework.config.errors import ConfigError
from framework.dryrun import GIB, RankReport, dry_run, human
from framework.launch.threads import available_cores
from framework.parallel.roles import MeshRoles
from framework.planner.calibrate import cpu_profile, default_path
from framework.planner.candidates import Candidate, candidates
from framework.planner.cost import Prediction, predict
from framework.training.metrics import DEVICE_PROFILES, device_profiles

SEARCHABLE = ("pp", "dp", "cp", "tp")  # the mesh dims a layout factorizes (hsdp splits dp)
STRATEGIES = ("replicate", "fsdp", "hsdp")


@dataclass
class Plan:
    ranked: List[Tuple[Candidate, Prediction]] = field(default_factory=list)  # fastest first
    over: List[Tuple[Candidate, Prediction]] = field(default_factory=list)  # over the device's memory
    refused: List[Candidate] = field(default_factory=list)  # by validation
    memory_gb: Optional[float] = None


def device_profile(planner, recalibrate: bool = False) -> dict:
    """The device's figures: `cpu` measured on this host (planner.calibration), the others published."""
    published = device_profiles()
    if planner.device == "cpu":
        return cpu_profile(planner.calibration or default_path(), recalibrate)
    if planner.device not in published:
        raise ConfigError("planner.device", planner.device, f"is not a device profile; use cpu (measured here) or "
                                                            f"one of {sorted(published)} ({DEVICE_PROFILES})")
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


def predicted(candidate: Candidate, device: dict) -> Prediction:
    return rehearse(candidate, device)[0]


def predictions(valid: List[Candidate], device: dict) -> List[Prediction]:
    """Each candidate's prediction, dry-run in a process per core (each dry run is one CPU
    thread of Python dispatch, and the candidates are independent)."""
    workers = min(available_cores(), len(valid) // 4)
    if workers < 2:
        return [predicted(candidate, device) for candidate in valid]
    quiet = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # the workers' fake process groups warn once per rank
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            return list(pool.map(predicted, valid, [device] * len(valid)))
    finally:
        if quiet is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = quiet


def check_planner(planner) -> None:
    """planner.world, planner.strategies and planner.dims, before anything is measured or dry-run."""
    if planner.world is None or planner.world < 1:
        raise ConfigError("planner.world", planner.world, "give the number of ranks to plan for, e.g. planner.world=8")
    strange = [s for s in planner.strategies if s not in STRATEGIES]
    if strange or not planner.strategies:
        raise ConfigError("planner.strategies", list(planner.strategies), f"weighs any of {', '.join(STRATEGIES)}, "
                                                                          f"e.g. planner.strategies=[fsdp,hsdp]")
    unknown = [d for d in planner.dims if d not in SEARCHABLE]
    if unknown or "dp" not in planner.dims:
        raise ConfigError("planner.dims", list(planner.dims), f"{'names ' + repr(unknown[0]) if unknown else 'lacks dp'}"
                                                              f"; the planner factorizes dp and any of "
                                                              f"{', '.join(d for d in SEARCHABLE if d != 'dp')}, "
                                                              f"e.g. planner.dims=[pp,dp,cp,tp]")


def plan(user_overrides: List[str], planner, device: dict) -> Plan:
    """Every layout for planner.world ranks; refused (ConfigError) when none fits the memory."""
    check_planner(planner)
    result = Plan(memory_gb=planner.device_memory_gb or device.get("memory_gb"))
    per_host = device.get("ranks_per_host")  # (a GPU profile's: TP across hosts is then refused)
    if per_host and not any(o.startswith("mesh.ranks_per_host=") for o in user_overrides):
        user_overrides = [*user_overrides, f"mesh.ranks_per_host={per_host}"]
    found = candidates(user_overrides, planner.world, list(planner.dims), list(planner.strategies))
    result.refused = [c for c in found if c.refusal is not None]
    valid = [c for c in found if c.refusal is None]
    for candidate, prediction in zip(valid, predictions(valid, device)):
        fits = result.memory_gb is None or prediction.memory_bytes <= result.memory_gb * GIB
        (result.ranked if fits else result.over).append((candidate, prediction))
    result.ranked.sort(key=lambda pair: (round(pair[1].step_s, 6), pair[1].memory_bytes))  # a tie: less memory first
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
