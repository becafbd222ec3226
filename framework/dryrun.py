"""`python -m framework.dryrun [overrides]`: a run of any mesh size, rehearsed in one CPU process.

Composes the config like framework.train (same groups, recipes and overrides) and runs the
launcher's whole validation for the mesh's world size. Then, for each rank of `dryrun.ranks`,
it joins torch's fake process group as that rank (collectives return at once and move
nothing), runs the builder's own stages up to the optimizer with the model built on the meta
device (shapes, no storage), and one training step on meta tensors: forward, backward with
DataParallel's gradient finalization, optimizer step (no clipping, as `framework.inspect comm`).

Printed per rank:
- every parameter's local shape and placement (DTensor placements per mesh dim, or a plain
  tensor, replicated on every rank);
- memory: parameters and gradients (the trainable parameters' local sizes); optimizer state
  (the tensors the configured optimizer holds after its first step: AdamW/Adam 2 per parameter
  element, SGD with momentum 1, plain SGD 0; step counters torch keeps on the CPU are left out);
  activations (the tensors autograd saves for backward in the step, counted once per storage,
  parameters excluded: what stays allocated when backward starts); and their sum as the
  estimated peak. Temporaries inside an op, DataParallel's flat buckets, the allocator's caching
  and the CUDA/NCCL context are not counted. On meta, scaled_dot_product_attention takes its math
  path, which saves the attention weights (batch x heads x seq x seq) that fused kernels
  recompute, so for attention the estimate errs high. With `dryrun.device_memory_gb` a rank
  whose peak exceeds the device's memory is refused (exit 1);
- the step's collectives per type and mesh dim: count and bytes, the bytes being those of the
  tensors the collective takes in on this rank (every tensor argument but its output buffers).
"""
import math
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from framework.config.errors import ConfigError
from framework.config.validate import validate
from framework.parallel.roles import MeshRoles
from framework.parallel.collectives import CollectiveRecorder, counted
from framework.parallel.mesh import coordinates
from framework.parallel.pipeline import refuse_pipeline
from framework.cli import command_status, compose_config
from framework.training.builder import build_and_run
from framework.training.trainer import Trainer
from framework.training.memory import state_bytes
from framework.training.run import Run

# torch internals, all here (DESIGN.md: fail clearly if a future torch moves them).
try:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError as error:
    FakeStore = None
    MISSING_INTERNALS = str(error)

GIB = 2**30


@dataclass
class RankReport:
    rank: int
    coordinates: Dict[str, int]
    parameters: List[Tuple[str, List[int], List[int], str]]  # name, local shape, global shape, placement
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    collectives: Dict[Tuple[str, str], List[int]] = field(default_factory=dict)  # (op, mesh dim) -> [count, bytes]

    @property
    def peak_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes


def check_dryrun(cfg: DictConfig) -> None:
    """The dry run's own keys, and a pipeline that reaches a training step."""
    world = math.prod(cfg.mesh.shape)
    ranks = list(cfg.dryrun.ranks)
    outside = [r for r in ranks if not 0 <= r < world]
    if outside:
        raise ConfigError("dryrun.ranks", ranks, f"rank {outside[0]} is not a rank of the mesh {list(cfg.mesh.shape)}; "
                                                 f"give ranks from 0 to {world - 1}")
    if not ranks:
        raise ConfigError("dryrun.ranks", ranks, f"give at least one rank to simulate, from 0 to {world - 1}")
    memory = cfg.dryrun.device_memory_gb
    if memory is not None and memory <= 0:
        raise ConfigError("dryrun.device_memory_gb", memory, "must be > 0 (GiB), or null for no memory check")
    if cfg.parallel.dp_strategy != "replicate":
        raise ConfigError("parallel.dp_strategy", cfg.parallel.dp_strategy,
                          "the dry run steps on meta tensors, and FSDP2 refuses parameters on meta before it "
                          "all-gathers; dry-run the mesh with dp_strategy=replicate (same TP shards and "
                          "collectives; FSDP then divides parameters, gradients and optimizer state by the DP size)")
    if "optimizer" not in cfg.pipeline:
        raise ConfigError("pipeline", list(cfg.pipeline),
                          "the dry run rehearses a training step, which needs the stages up to optimizer; "
                          "drop the override (or recipe) that stops the pipeline early")


def stage_model_on_meta(run: Run) -> None:
    """The builder's model stage, with parameters on the meta device: shapes, no storage."""
    with torch.device("meta"):
        run.model = instantiate(run.cfg.model)


class _SavedActivations:
    """Bytes of the tensors autograd saves for backward, once per storage, parameters excluded."""

    def __init__(self, parameters: List[torch.Tensor]):
        self.seen = {_local(p).untyped_storage()._cdata for p in parameters}
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _local(tensor).untyped_storage()
        if storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            self.bytes += storage.nbytes()
        return tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _placement(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "replicated plain tensor"
    return ", ".join(f"{dim}: {p!r}" for dim, p in zip(param.device_mesh.mesh_dim_names, param.placements))


def simulate_rank(cfg: DictConfig, rank: int) -> RankReport:
    """Rank `rank` of the mesh, built by the builder's stages and stepped once, on meta tensors."""
    world = math.prod(cfg.mesh.shape)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # no stage up to the optimizer writes anything
        run = build_and_run(cfg, "", through="optimizer", replace={"model": stage_model_on_meta})
        inputs, targets = (t.to("meta") for t in next(iter(run.dataloader)))
        params = list(run.module.named_parameters())
        activations = _SavedActivations([p for _, p in params])
        totals: Dict[Tuple[str, str], List[int]] = {}
        collectives = CollectiveRecorder(counted(totals, lambda op, dim: (op, dim)), run.group_labels(), "other")
        with collectives, torch.autograd.graph.saved_tensors_hooks(activations.pack, lambda tensor: tensor):
            Trainer(run).forward_backward(inputs, targets)
            run.optimizer.step()
        sizes = state_bytes(run.module, run.optimizer)
        return RankReport(
            rank=rank,
            coordinates=dict(zip(cfg.mesh.dim_names, coordinates(cfg.mesh.shape, rank))),
            parameters=[(name, list(_local(p).shape), list(p.shape), _placement(p)) for name, p in params],
            parameter_bytes=sizes["parameters"],
            gradient_bytes=sizes["gradients"],
            optimizer_bytes=sizes["optimizer_state"],
            activation_bytes=activations.bytes,
            collectives=dict(sorted(totals.items())),
        )
    finally:
        dist.destroy_process_group()
        # DTensor caches its sharding decisions by mesh, and meshes of one shape compare equal
        # whatever their groups: the next rank would reuse this rank's destroyed groups.
        _clear_sharding_prop_cache()


def dry_run(cfg: DictConfig) -> List[RankReport]:
    """Validate as the launcher does, then simulate each rank asked. The simulated mesh is on
    cpu whatever mesh.device_type says: shapes and collectives do not depend on the device."""
    validate(cfg, world_size=math.prod(cfg.mesh.shape))
    refuse_pipeline(cfg, "framework.dryrun")
    check_dryrun(cfg)
    simulated = OmegaConf.merge(cfg, {"mesh": {"device_type": "cpu"}})
    return [simulate_rank(simulated, rank) for rank in cfg.dryrun.ranks]


def human(n: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def print_report(report: RankReport, cfg: DictConfig) -> None:
    where = ", ".join(f"{dim} {c}" for dim, c in report.coordinates.items())
    print(f"\nrank {report.rank} ({where})")
    rows = [("parameter", "local shape", "global shape", "placement")] + \
        [(name, str(local), str(full), placement) for name, local, full, placement in report.parameters]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    optimizer = cfg.optim._target_.rsplit(".", 1)[-1]
    per_replica = cfg.data.global_batch_size // MeshRoles.from_config(cfg).dp_size
    print("  memory")
    for label, n, note in (
            ("parameters", report.parameter_bytes, "local shards"),
            ("gradients", report.gradient_bytes, "trainable parameters, placed like them"),
            ("optimizer state", report.optimizer_bytes, f"{optimizer}'s state after its first step"),
            ("activations", report.activation_bytes, f"saved for backward, {per_replica} samples per replica"),
            ("estimated peak", report.peak_bytes, _fit(report, cfg))):
        print(f"    {label:<16} {human(n):>10}   {note}")
    print(f"  collectives of one step{'':<22}  dim    count  bytes in")
    for (op, dim), (count, nbytes) in report.collectives.items():
        print(f"    {op:<42}  {dim:<5}  {count:>5}  {human(nbytes)}")
    total_count = sum(count for count, _ in report.collectives.values())
    total_bytes = sum(nbytes for _, nbytes in report.collectives.values())
    print(f"    {'total':<42}  {'':<5}  {total_count:>5}  {human(total_bytes)}")


def _fit(report: RankReport, cfg: DictConfig) -> str:
    memory = cfg.dryrun.device_memory_gb
    if memory is None:
        return "sum of the above (dryrun.device_memory_gb to check a device)"
    return f"{100 * report.peak_bytes / (memory * GIB):.3g}% of dryrun.device_memory_gb={memory:g}"


def too_big(reports: List[RankReport], cfg: DictConfig) -> str | None:
    """The refusal line when a simulated rank's estimated peak exceeds the device memory."""
    memory = cfg.dryrun.device_memory_gb
    over = [r for r in reports if memory is not None and r.peak_bytes > memory * GIB]
    if not over:
        return None
    worst = max(over, key=lambda r: r.peak_bytes)
    return (f"dry run: does not fit: rank {worst.rank}'s estimated peak {human(worst.peak_bytes)} exceeds "
            f"dryrun.device_memory_gb={memory:g} ({human(memory * GIB)}; ranks over: "
            f"{', '.join(str(r.rank) for r in over)}); shard more (a larger TP size), lower "
            f"data.global_batch_size, or give a larger device")


USAGE = ("usage: python -m framework.dryrun [hydra overrides, e.g. recipe=lm_2d mesh.shape=[128,8] "
         "dryrun.ranks=[0,1023]]\nexit 0: valid and fits; 1: a rank does not fit dryrun.device_memory_gb; "
         "2: a config error")


def main(argv: List[str]) -> int:
    if FakeStore is None:
        print(f"dry run: this torch ({torch.__version__}) lacks the internals the dry run uses "
              f"(torch's fake process group): {MISSING_INTERNALS}", file=sys.stderr)
        return 1
    return command_status(lambda: rehearse(argv), "dry run failed", argv, USAGE)


def rehearse(argv: List[str]) -> int:
    cfg = compose_config(argv)
    reports = dry_run(cfg)
    shape = ", ".join(f"{n}={s}" for n, s in zip(cfg.mesh.dim_names, cfg.mesh.shape))
    world = math.prod(cfg.mesh.shape)
    print(f"dry run: mesh [{shape}] = {world} ranks, simulated in one process (fake process group, "
          f"parameters on meta); {' '.join(argv) or 'default config'}")
    per_host = f", mesh.ranks_per_host={cfg.mesh.ranks_per_host}" if cfg.mesh.ranks_per_host else ""
    print(f"config: valid for {world} ranks{per_host} (framework.train's checks)")
    for report in reports:
        print_report(report, cfg)
    refusal = too_big(reports, cfg)
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
