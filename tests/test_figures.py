"""The figures a run reports, against hand counts: the tokens a step forwards (LM, DPO, GRPO
batches), the GPU allocator's figures from a memory_stats()-shaped dict, and the loggers'
calls (none on a step with nothing to log). A cuda run's summary.json `device_memory` and its
snapshots cannot run here (no GPU): this checks the figures and their plumbing on CPU."""
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
