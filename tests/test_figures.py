"""The figures a run reports, against hand counts: the tokens a step forwards (LM, DPO, GRPO
batches), the GPU allocator's figures from a memory_stats()-shaped dict, and the loggers'
calls (none on a step with nothing to log); and a whole 2-rank run on a stand-in of torch.cuda's
allocator functions (no GPU here): each window's peaks, the run's, summary.json and the snapshots."""
from types import SimpleNamespace

import pytest
import torch

from framework.data.batch import Batch
from framework.training.objectives.grpo import GroupRelativePolicy
from framework.training.logger import Loggers
from framework.training.memory import DeviceMemory, device_figures, figures_line, trouble
from framework.training.metrics import Metrics
from framework.training.objectives.lm import NextTokenCrossEntropy
from framework.training.objectives.preference import DirectPreference, KahnemanTversky

GIB = 1024 ** 3


def tokens(*shape) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64)


@pytest.mark.parametrize("objective, loader_batch, forwarded", [
    # 4 windows of 16 tokens: 4 x 16
    (NextTokenCrossEntropy(), Batch(tokens(4, 16), tokens(4, 16)), 64),
    # 4 pairs, each a chosen and a rejected sequence of 16: 4 x 2 x 16
    (DirectPreference(), Batch(tokens(4, 2, 16), tokens(4, 2, 16)), 128),
    # 4 examples, each its own row and its KL row (another example's response): 4 x 2 x 16
    (KahnemanTversky(), Batch(tokens(4, 2, 16), tokens(4, 2, 16)), 128),
    # 4 prompts of width 16, each continued 8 times: 4 x 8 x 16
    (GroupRelativePolicy(group_size=8), Batch(tokens(4, 16), tokens(4, 16)), 512),
])
def test_the_tokens_a_step_forwards_are_counted_by_hand(objective, loader_batch, forwarded):
    assert objective.forwarded_tokens(loader_batch) == forwarded


def test_tokens_per_s_counts_grpo_s_completions_not_its_prompts():
    """Metrics takes the objective's count per sample: a global batch of 16 prompts x group 8 x
    width 16 is 2,048 tokens a step, not the 256 of one sequence a prompt."""
    run = SimpleNamespace(objective=GroupRelativePolicy(group_size=8))
    metrics = SimpleNamespace(run=run, seq_len=16, tokens_per_sample=None, global_batch=16)
    Metrics.taken(metrics, Batch(tokens(4, 16), tokens(4, 16)))  # one DP replica's 4 prompts
    assert metrics.global_batch * metrics.tokens_per_sample == 16 * 8 * 16


class Recorder:
    def __init__(self):
        self.calls = []

    def log_scalars(self, step, values):
        self.calls.append((step, dict(values)))


def test_a_step_with_nothing_to_log_calls_no_logger():
    recorder = Recorder()
    metrics = SimpleNamespace(loggers=Loggers([recorder]))
    Metrics.scalars(metrics, 3, {})  # (fault tolerance's figures without torchft: none)
    Metrics.scalars(metrics, 4, {"loss": 1.5})
    assert recorder.calls == [(4, {"loss": 1.5})]


STATS = {"active_bytes.all.peak": 30 * GIB, "reserved_bytes.all.peak": 36 * GIB, "allocated_bytes.all.peak": 29 * GIB,
         "num_alloc_retries": 0, "num_ooms": 0}


def test_device_figures_are_torchtitan_s_from_memory_stats():
    figures = device_figures(STATS, capacity=144 * GIB)
    assert figures == {"max_active_gib": 30.0, "max_active_pct": 100 * 30 / 144, "max_reserved_gib": 36.0,
                       "max_reserved_pct": 25.0, "alloc_retries": 0, "ooms": 0}
    assert figures_line(figures) == ("memory max active 30.00 GiB (20.8%), max reserved 36.00 GiB (25.0%), "
                                     "0 alloc retries, 0 OOMs")
    assert trouble(figures) is None
    retried = device_figures({**STATS, "num_alloc_retries": 3}, capacity=144 * GIB)
    assert trouble(retried).startswith("3 allocation retries and 0 OOMs so far")
    assert trouble(device_figures({**STATS, "num_ooms": 1}, capacity=144 * GIB)).startswith("0 allocation retries "
                                                                                            "and 1 OOMs")


def test_the_run_s_peak_is_the_largest_window_s():
    """Each logging window reads the peaks since the last (reset after); the run keeps the largest."""
    windows = iter([{**STATS, "active_bytes.all.peak": 10 * GIB}, STATS, {**STATS, "reserved_bytes.all.peak": 40 * GIB,
                                                                         "num_alloc_retries": 2}])
    module = SimpleNamespace(memory_stats=lambda: next(windows), reset_peak_memory_stats=lambda: None)
    memory = object.__new__(DeviceMemory)
    memory.module, memory.capacity, memory.run_peak = module, 144 * GIB, {}
    for _ in range(3):
        memory.window()
    assert memory.run_peak["max_active_gib"] == 30.0 and memory.run_peak["max_reserved_gib"] == 40.0
    assert memory.run_peak["alloc_retries"] == 2


def test_a_cpu_run_has_no_device_memory():
    assert DeviceMemory.of("cpu") is None


# -- a run's device figures, through a stand-in of torch.cuda's allocator functions ----------

# Each rank's allocator peak (active GiB; reserved 4 GiB more) in each window between two reads
# (3 logging steps, then the summary's): they fall and rise, and the run's peak is not the last.
WINDOW_PEAKS = {0: [10, 30, 20, 25], 1: [12, 8, 35, 5]}
RETRIES_FROM, OOM_AT = 1, 2  # rank 1's allocator retries twice in window 1 and reports an OOM in window 2


class StandInAllocator:
    """torch.cuda's memory functions as a 144 GiB GPU's whose peaks in window w are WINDOW_PEAKS[rank][w]:
    memory_stats reads the peaks since the last reset_peak_memory_stats (a window, one read each);
    the retries and OOMs are counts since the start, as the allocator's are."""

    def __init__(self, rank: int):
        self.peaks, self.rank, self.reads, self.reset_at, self.oom_observer = WINDOW_PEAKS[rank], rank, 0, 0, None

    def memory_stats(self) -> dict:
        window, self.reads = self.reads, self.reads + 1
        peak = max(self.peaks[self.reset_at:window + 1]) * GIB
        if self.rank == 1 and window == OOM_AT:
            self.oom_observer(0, 0, 0, 0)
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak + 4 * GIB,
                "num_alloc_retries": 2 * (self.rank == 1 and window >= RETRIES_FROM),
                "num_ooms": int(self.rank == 1 and window >= OOM_AT)}

    def reset_peak_memory_stats(self) -> None:
        self.reset_at = self.reads

    def install(self) -> None:
        from framework.training import memory

        memory.DeviceMemory.of = staticmethod(lambda device_type: memory.DeviceMemory("cuda"))
        cuda = torch.cuda
        cuda.memory_stats, cuda.reset_peak_memory_stats = self.memory_stats, self.reset_peak_memory_stats
        cuda.current_device = lambda: 0
        cuda.get_device_properties = lambda index: SimpleNamespace(total_memory=144 * GIB)
        cuda.memory._record_memory_history = lambda **kwargs: None
        cuda.memory._dump_snapshot = lambda path: open(path, "wb").close()
        torch._C._cuda_attach_out_of_memory_observer = lambda observer: setattr(self, "oom_observer", observer)


def run_on_a_stand_in_gpu(cfg_container: dict, out_dir: str) -> None:
    """(Each rank, in its own process.) The whole run, its allocator the stand-in."""
    import os

    from framework.launch.worker import run_rank

    StandInAllocator(int(os.environ["RANK"])).install()
    run_rank(cfg_container, out_dir)


def figures(active: float, reserved: float, retries: int, ooms: int) -> dict:
    return {"max_active_gib": active, "max_active_pct": pytest.approx(100 * active / 144, rel=1e-5),
            "max_reserved_gib": reserved, "max_reserved_pct": pytest.approx(100 * reserved / 144, rel=1e-5),
            "alloc_retries": retries, "ooms": ooms}


@pytest.mark.timeout(120)
def test_a_run_s_device_figures_are_each_window_s_and_the_run_s_peak_reaches_summary_json(tmp_path):
    import json
    import math
    import re

    from omegaconf import OmegaConf

    from framework.launch.local import spawn_ranks
    from tests.conftest import QUIET, TINY_LM, compose_config

    cfg = compose_config([*TINY_LM, *QUIET, "mesh=2x1", "mesh.device_type=cpu", "trainer.max_steps=3",
                          "trainer.log_every=1", "trainer.memory_snapshot=true", "checkpoint.every=null"])
    spawn_ranks(math.prod(cfg.mesh.shape), run_on_a_stand_in_gpu, OmegaConf.to_container(cfg, resolve=True),
                str(tmp_path))
    for rank, peaks in WINDOW_PEAKS.items():  # each logging step's own window (reset after each read)
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert [float(gib) for gib in re.findall(r"step \d: memory max active ([\d.]+) GiB", log)] == peaks[:3]
        assert f"memory snapshot (end) for https://pytorch.org/memory_viz: {tmp_path}/memory_snapshot/rank{rank}_end" \
               f".pickle" in log
    assert "rank 1: 2 allocation retries and 1 OOMs so far" in (tmp_path / "logs" / "rank1.log").read_text()
    assert sorted(p.name for p in (tmp_path / "memory_snapshot").iterdir()) == [
        "rank0_end.pickle", "rank1_end.pickle", "rank1_oom.pickle"]
    device = json.loads((tmp_path / "summary.json").read_text())["device_memory"]
    assert device == {"rank0": figures(30.0, 34.0, 0, 0),  # the run's peak: window 1's, not the last one's
                      "max_over_ranks": figures(35.0, 39.0, 2, 1)}
