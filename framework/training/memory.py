"""The bytes a rank holds for its training state, from the local shards it really holds:
parameters, their gradients and the optimizer's state. Recorded by the training loop after the
first step (summary.json `memory`, TensorBoard) and estimated by framework.dryrun on meta; the
activations autograd saves for backward (framework.dryrun, bench/pipeline.py); and on a GPU what
the device's allocator held (torchtitan's figures: summary.json `device_memory`, the log line,
TensorBoard) and its snapshots for pytorch.org/memory_viz."""
import logging
import os
from typing import Dict, List, Optional

import torch
from torch import nn

from framework.parallel.dtensors import local_bytes, local_tensor

log = logging.getLogger("framework")


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Gradients count as the trainable parameters' shards (placed like them, whether or not a
    step has made them yet); optimizer state as its tensors with a dim (momenta, second
    moments), not its scalar step counters."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    sizes = {"parameters": sum(local_bytes(p) for p in params),
             "gradients": sum(local_bytes(p) for p in params if p.requires_grad),
             "optimizer_state": sum(local_bytes(t) for t in state)}
    return {**sizes, "total": sum(sizes.values())}


class SavedActivations:
    """The peak bytes of the tensors autograd holds for backward, once per storage, parameters
    excluded: a saved_tensors_hooks pair whose packed handle gives its storage back when
    autograd frees it (after that backward). Works on any device, meta included."""

    def __init__(self, parameters: List[torch.Tensor]):
        self.parameters = {local_tensor(p).untyped_storage()._cdata for p in parameters}
        self.holders: Dict[int, int] = {}  # storage -> saved tensors holding it
        self.bytes = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = local_tensor(tensor).untyped_storage()
        key = storage._cdata
        if key in self.parameters or _of_a_parameter(tensor):
            return tensor
        if key not in self.holders:
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        self.holders[key] = self.holders.get(key, 0) + 1
        return _Saved(tensor, key, storage.nbytes(), self)

    @staticmethod
    def unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.bytes -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _of_a_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one, whatever its storage: FSDP's all-gathered parameters, which
    FSDP frees after their unit's forward (and gathers again for backward)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class _Saved:
    def __init__(self, tensor: torch.Tensor, key: int, nbytes: int, owner: SavedActivations):
        self.tensor, self.key, self.nbytes, self.owner = tensor, key, nbytes, owner

    def __del__(self):
        self.owner.release(self.key, self.nbytes)


GIB = 1024 ** 3
DEVICE_FIGURES = ("max_active_gib", "max_active_pct", "max_reserved_gib", "max_reserved_pct", "alloc_retries", "ooms")


def device_figures(stats: Dict[str, int], capacity: int) -> Dict[str, float]:
    """torchtitan's memory figures (DeviceMemoryMonitor) from an allocator's memory_stats(): the
    peak bytes held by live tensors (active) and by the caching allocator (reserved), in GiB and %
    of the device's `capacity`; the allocations retried after freeing the cache, and the OOMs."""
    active, reserved = stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
    return {"max_active_gib": active / GIB, "max_active_pct": 100 * active / capacity,
            "max_reserved_gib": reserved / GIB, "max_reserved_pct": 100 * reserved / capacity,
            "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}


def figures_line(figures: Dict[str, float]) -> str:
    return (f"memory max active {figures['max_active_gib']:.2f} GiB ({figures['max_active_pct']:.1f}%), max reserved "
            f"{figures['max_reserved_gib']:.2f} GiB ({figures['max_reserved_pct']:.1f}%), "
            f"{figures['alloc_retries']:.0f} alloc retries, {figures['ooms']:.0f} OOMs")


def trouble(figures: Dict[str, float]) -> Optional[str]:
    """A warning's text when the allocator retried (it freed its cache to fit: slow steps) or ran out."""
    if not (figures["alloc_retries"] or figures["ooms"]):
        return None
    return (f"{figures['alloc_retries']:.0f} allocation retries and {figures['ooms']:.0f} OOMs so far: the device is "
            f"near its memory (a smaller data.micro_batch_size, activation checkpointing, fsdp; "
            f"trainer.memory_snapshot=true shows what holds it)")


class DeviceMemory:
    """One rank's accelerator memory (cuda, or any torch device module with memory_stats): the
    window's peaks (reset after each read) and the run's. On a CPU there is none (`None`)."""

    def __init__(self, device_type: str):
        self.module = getattr(torch, device_type)
        index = self.module.current_device()
        self.capacity = self.module.get_device_properties(index).total_memory
        self.run_peak: Dict[str, float] = {}
        self.module.reset_peak_memory_stats()

    @staticmethod
    def of(device_type: str) -> Optional["DeviceMemory"]:
        module = getattr(torch, device_type, None)
        available = device_type != "cpu" and hasattr(module, "memory_stats") and module.is_available()
        return DeviceMemory(device_type) if available else None

    def window(self) -> Dict[str, float]:
        """The figures since the last read; the run's peaks keep the largest."""
        figures = device_figures(self.module.memory_stats(), self.capacity)
        self.module.reset_peak_memory_stats()
        self.run_peak = {k: max(v, self.run_peak.get(k, v)) for k, v in figures.items()}
        return figures


class MemorySnapshot:
    """CUDA's allocator state as a pickle pytorch.org/memory_viz draws: on an OOM always (the
    allocator's observer dumps it as it fails: the blocks that filled the device), and with
    trainer.memory_snapshot the history of every allocation from the first step, dumped at the end
    (and kept in the OOM's). Written to <job dir>/memory_snapshot/rank<N>_<when>.pickle."""

    def __init__(self, out_dir: str, rank: int, record: bool, max_entries: int = 100_000):
        self.out_dir, self.rank, self.record = out_dir, rank, record
        if record:
            torch.cuda.memory._record_memory_history(max_entries=max_entries)
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(lambda device, alloc, device_alloc, device_free: self.dump("oom"))

    def path(self, when: str) -> str:
        return os.path.join(self.out_dir, "memory_snapshot", f"rank{self.rank}_{when}.pickle")

    def dump(self, when: str) -> None:
        """Never ends the run (an OOM's own error does)."""
        try:
            os.makedirs(os.path.dirname(self.path(when)), exist_ok=True)
            torch.cuda.memory._dump_snapshot(self.path(when))
            log.warning("memory snapshot (%s) for https://pytorch.org/memory_viz: %s", when, self.path(when))
        except Exception as error:  # informational: a failed dump must not hide the run's own state
            log.warning("no memory snapshot (%s): %s", when, error)

    def close(self) -> None:
        if self.record:
            self.dump("end")
            torch.cuda.memory._record_memory_history(enabled=None)
