"""This host's figures for the planner's cost model, measured: the fp32 matmul rate at each thread
count a rank may get, and a gloo all-reduce's latency and bandwidth among 2 and 4 local ranks
(with more ranks than cores, a collective also waits for its peers to be scheduled: measured, not
modelled). Cached in a JSON file that names the host and backend it was measured on
(planner.calibration)."""
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.atomic import atomic_file
from framework.config.errors import ConfigError
from framework.launch.threads import available_cores

BACKEND = "gloo"


def default_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "framework", f"calibration-{socket.gethostname()}.json")


def matmul_gflops(threads: int, size: int = 1024, repeats: int = 8) -> float:
    """The median rate of size x size fp32 matmuls on `threads` threads (GFLOP/s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return 2 * size ** 3 / sorted(times)[len(times) // 2] / 1e9
    finally:
        torch.set_num_threads(before)


RANKS = (2, 4)  # the world sizes whose collectives are measured


def _between_compute(world: int, repeats: int = 20, rounds: int = 5) -> float:
    """A 4-byte all-reduce's cost between bursts of compute, as a training step meets it: the
    time of (matmuls + all-reduce) x repeats less that of the matmuls alone, run alike on every
    rank; the median of `rounds` such pairs (one pair alone came out at 0 once, the matmuls
    alone having drawn the slower scheduling). With more ranks than cores it includes the wait
    for peers the scheduler set aside."""
    a, b, flag = torch.randn(384, 384), torch.randn(384, 384), torch.ones(1)
    differences = []
    for _ in range(rounds):
        timings = []
        for with_collective in (False, True):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                for _ in range(4):
                    a @ b
                if with_collective:
                    dist.all_reduce(flag)
            dist.barrier()
            timings.append(time.perf_counter() - start)
        differences.append((timings[1] - timings[0]) / repeats)
    return max(statistics.median(differences), 0.0)


def _collective_rank(rank: int, world: int, port: int, out: str) -> None:
    """One of `world` ranks: all-reduces of 4 B (latency, alone and between compute) and of 8 MiB
    (bandwidth), timed."""
    torch.set_num_threads(1)
    # Under torchrun (mesh=auto: rank 0 plans) this variable makes c10d take a store torchrun's
    # agent hosts, not the one this measurement starts: none listens on its port.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        figures = {"between_compute": _between_compute(world)}
        for name, numel, repeats in (("small", 1, 50), ("large", 2 * 2**20, 6)):
            tensor = torch.ones(numel)
            dist.all_reduce(tensor)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                dist.all_reduce(tensor)
            figures[name] = (time.perf_counter() - start) / repeats
        if rank == 0:
            moved = 2 * (world - 1) / world * 2 * 2**20 * 4  # what a ring all-reduce moves per rank
            with open(out, "w") as f:
                json.dump({"latency_us": 1e6 * figures["small"], "busy_latency_us": 1e6 * figures["between_compute"],
                           "gbps": moved / max(figures["large"] - figures["small"], 1e-9) / 1e9}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(path: str) -> Dict:
    """Measure, write `path` (atomically) and return the figures."""
    cores = available_cores()
    collectives = {}
    with tempfile.TemporaryDirectory() as work:
        for world in RANKS:
            out = os.path.join(work, f"collectives{world}.json")
            mp.start_processes(_collective_rank, args=(world, _free_port(), out), nprocs=world, start_method="spawn")
            with open(out) as f:
                collectives[str(world)] = json.load(f)
    figures = {"host": socket.gethostname(), "backend": BACKEND, "torch": torch.__version__, "cores": cores,
               "matmul_gflops": {str(t): matmul_gflops(t) for t in sorted({1, cores})}, "collectives": collectives}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_file(path) as f:
        json.dump(figures, f, indent=2)
    return figures


def load(path: str) -> Dict:
    """The figures in `path`, refused (ConfigError) when measured on another host or backend."""
    try:
        with open(path) as f:
            figures = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError("planner.calibration", path, f"is not a calibration file ({error}); re-calibrate "
                                                       f"(--calibrate) or name this host's file") from None
    if not isinstance(figures, dict):
        raise ConfigError("planner.calibration", path, "is not a calibration file (not a JSON object); re-calibrate "
                                                       "(--calibrate) or name this host's file")
    here = socket.gethostname()
    if figures.get("host") != here or figures.get("backend") != BACKEND:
        raise ConfigError("planner.calibration", path, f"was measured on host {figures.get('host')!r} with "
                                                       f"{figures.get('backend')}, and this is {here!r} with "
                                                       f"{BACKEND}; re-calibrate (--calibrate) or name this "
                                                       f"host's file")
    if "collectives" not in figures:
        raise ConfigError("planner.calibration", path, "holds no collective figures per world size (an older "
                                                       "planner's); re-calibrate (--calibrate)")
    return figures


def cpu_profile(path: str, recalibrate: bool) -> Dict:
    """The `cpu` device profile: this host's figures, measured first when there are none."""
    figures = calibrate(path) if recalibrate or not os.path.exists(path) else load(path)
    measured = {int(world): values for world, values in figures["collectives"].items()}
    return {"matmul_gflops": {int(t): rate for t, rate in figures["matmul_gflops"].items()}, "cores": figures["cores"],
            "memory_gb": None, "ranks_per_host": None, "collectives": measured, "calibration": path,
            "dp_overlap": 0.0}  # gloo's collectives take the cores compute uses (bench/README.md "DP gradient sync")
