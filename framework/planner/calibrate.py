"""This host's figures for the planner's cost model, measured: the fp32 matmul rate at each thread
count a rank may get, and a gloo collective's latency and bandwidth between two local ranks.
Cached in a JSON file that names the host and backend it was measured on (planner.calibration)."""
import json
import os
import socket
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


def _collective_rank(rank: int, port: int, out: str) -> None:
    """One of two ranks: all-reduces of 4 B (latency) and of 8 MiB (bandwidth), timed."""
    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        figures = {}
        for name, numel, repeats in (("small", 1, 50), ("large", 2 * 2**20, 6)):
            tensor = torch.ones(numel)
            dist.all_reduce(tensor)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                dist.all_reduce(tensor)
            figures[name] = (time.perf_counter() - start) / repeats
        if rank == 0:
            large_bytes = 2 * 2**20 * 4  # a ring all-reduce over 2 ranks moves each rank's buffer once
            with open(out, "w") as f:
                json.dump({"latency_us": 1e6 * figures["small"],
                           "gbps": large_bytes / max(figures["large"] - figures["small"], 1e-9) / 1e9}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(path: str) -> Dict:
    """Measure, write `path` (atomically) and return the figures."""
    cores = available_cores()
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "collectives.json")
        mp.start_processes(_collective_rank, args=(_free_port(), out), nprocs=2, start_method="spawn")
        with open(out) as f:
            collectives = json.load(f)
    figures = {"host": socket.gethostname(), "backend": BACKEND, "torch": torch.__version__, "cores": cores,
               "matmul_gflops": {str(t): matmul_gflops(t) for t in sorted({1, cores})}, **collectives}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_file(path) as f:
        json.dump(figures, f, indent=2)
    return figures


def load(path: str) -> Dict:
    """The figures in `path`, refused (ConfigError) when measured on another host or backend."""
    with open(path) as f:
        figures = json.load(f)
    here = socket.gethostname()
    if figures.get("host") != here or figures.get("backend") != BACKEND:
        raise ConfigError("planner.calibration", path, f"was measured on host {figures.get('host')!r} with "
                                                       f"{figures.get('backend')}, and this is {here!r} with "
                                                       f"{BACKEND}; re-calibrate (--calibrate) or name this "
                                                       f"host's file")
    return figures


def cpu_profile(path: str, recalibrate: bool) -> Dict:
    """The `cpu` device profile: this host's figures, measured first when there are none."""
    figures = calibrate(path) if recalibrate or not os.path.exists(path) else load(path)
    return {"matmul_gflops": {int(t): rate for t, rate in figures["matmul_gflops"].items()}, "cores": figures["cores"],
            "memory_gb": None, "ranks_per_host": None, "intra_gbps": figures["gbps"], "inter_gbps": figures["gbps"],
            "intra_latency_us": figures["latency_us"], "inter_latency_us": figures["latency_us"], "calibration": path}
