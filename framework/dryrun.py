"""`python -m framework.dryrun [overrides]`: a run of any mesh size, rehearsed in one CPU process.

Composes the config like framework.train (same groups, recipes and overrides) and runs the
launcher's whole validation for the mesh's world size. Then, for each rank of `dryrun.ranks`,
it joins torch's fake process group as that rank (collectives return at once and move
nothing), runs the builder's own stages up to the optimizer with the model built on the meta
device (shapes, no storage), and one training step on meta tensors: forward, backward with
DataParallel's gradient finalization (or FSDP2's all-gathers and reduce-scatters under fsdp and
hsdp: FSDP2 made to run on meta, `fsdp_on_meta`), trainer.grad_clip's global norm, optimizer
step: the Trainer's own train_step, as `framework.inspect comm` counts it.

Printed per rank:
- every parameter's local shape and placement (DTensor placements per mesh dim, or a plain
  tensor, replicated on every rank);
- memory: parameters and gradients (the trainable parameters' local sizes); optimizer state
  (the tensors the configured optimizer holds after its first step: AdamW/Adam 2 per parameter
  element, SGD with momentum 1, plain SGD 0; step counters torch keeps on the CPU are left out);
  activations (the most bytes the tensors autograd saves for backward take at any one time in
  the step, counted once per storage, parameters excluded: one micro-batch's under gradient
  accumulation; under pipeline parallelism as many micro-batches' as the schedule keeps alive on
  this rank's stages, all of them under GPipe); and their sum as the estimated peak.
  Temporaries inside an op, DataParallel's flat buckets, FSDP's all-gathered parameters (a
  unit's, freed after its forward and backward), the allocator's caching and the CUDA/NCCL
  context are not counted. Attention, causal or masked (document masking, context
  parallelism), counts what the fused kernels save (framework.models.documents.attend), not the
  attention weights SDPA's math path on meta would save. With `dryrun.device_memory_gb` a rank
  whose peak exceeds the device's memory is refused (exit 1);
- the step's collectives per type and mesh dim: count and bytes, the bytes being those of the
  tensors the collective takes in on this rank (every tensor argument but its output buffers; a
  pipeline's send or recv: the activation or gradient sent or received).

Under pipeline parallelism the rank runs its stages under the configured schedule. Torch infers
the tensors crossing stage boundaries by sending them between stages in the first step, which
the fake process group cannot answer, so the dry run gives each stage its tensors instead
(torch's static mode), computed from a second meta copy of the model, TP-sharded like the run's,
run block by block. The first step (which also runs the stages' warm-up exchange) is not
counted: the second is, as `framework.inspect comm` does.
"""
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from framework.data.batch import Batch
from framework.models.lifecycle import new_model
from framework.config.errors import ConfigError
from framework.validate import validate
from framework.parallel.roles import MeshRoles
from framework.parallel.collectives import CollectiveRecorder, counted
from framework.parallel.mesh import coordinates
from framework.parallel.pipeline_layout import layers_per_stage
from framework.parallel.tensor_parallel import apply_tp
from framework.cli import command_status, compose_config
from framework.training.builder import build_and_run
from framework.training.trainer import Trainer
from framework.parallel.dtensors import local_tensor
from framework.training.memory import SavedActivations, state_bytes
from framework.training.run import Run

# torch internals, all here (DESIGN.md: fail clearly if a future torch moves them).
try:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class _RehearsedStage(PipelineStage):
        """A stage given its tensors (torch's static mode). Its warm-up vote, an exchange of
        whether every stage was given its tensors, has a known answer here (all were), which
        the fake process group's receives (zeros) would turn into 'infer by sending'."""

        def _warmup_forward_vote(self, has_backward, received_acc=None):
            return torch.ones(1, dtype=torch.int32)

        def _warmup_backward_result(self, received_result=None):
            return torch.ones(1, dtype=torch.int32)
except ImportError as error:
    FakeStore = None
    MISSING_INTERNALS = str(error)


@contextmanager
def c_stderr_silenced() -> Iterator[None]:
    """The process's stderr (file descriptor 2) to /dev/null: destroying the fake process group
    makes c10d warn from C++ ("No backend of type 0 found ... hasHooks"), once per simulated rank,
    where no Python filter reaches. A Python exception still raises with its message."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """FSDP2 on meta parameters: its check that parameters were materialized (before its first
    all-gather) set aside, and every tensor it allocates on the mesh's device (the all-gather's
    output, the reduce-scatter's input) made on meta instead: shapes, no storage."""
    check = FSDPParamGroup._validate_no_meta_params
    FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        with _OnMeta():
            yield
    finally:
        FSDPParamGroup._validate_no_meta_params = check


class _OnMeta(TorchDispatchMode):
    """FSDP's ops, and any op asked for an uninitialized tensor (`empty*`, which nothing can
    read), on the CPU make it on meta. (Tensors made with values stay: a pipeline's warm-up vote
    is read.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "fsdp" and "empty" not in func.__name__:
            return func(*args, **(kwargs or {}))
        args, kwargs = list(args), dict(kwargs or {})
        for i, argument in enumerate(func._schema.arguments):
            if "Device" not in str(argument.type):
                continue
            if argument.kwarg_only or i >= len(args):
                if kwargs.get(argument.name) == CPU:
                    kwargs[argument.name] = META
            elif args[i] == CPU:
                args[i] = META
        return func(*args, **kwargs)


CPU, META = torch.device("cpu"), torch.device("meta")

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
    stages: List[int] = field(default_factory=list)  # pipeline stages the rank runs

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
    if "optimizer" not in cfg.pipeline:
        raise ConfigError("pipeline", list(cfg.pipeline),
                          "the dry run rehearses a training step, which needs the stages up to optimizer; "
                          "drop the override (or recipe) that stops the pipeline early")


def _placement(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "replicated plain tensor"
    return ", ".join(f"{dim}: {p!r}" for dim, p in zip(param.device_mesh.mesh_dim_names, param.placements))


def stage_tensors(run: Run, trainer: Trainer, inputs: torch.Tensor) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Stage index -> (its input, its output) for one micro-batch, on meta: what torch's stage
    shape inference would have sent between stages. From a second meta copy of the model,
    TP-sharded like the run's, run block by block under the trainer's autocast."""
    cfg = run.cfg
    model = new_model(cfg.model, "meta", cfg.trainer.seed)
    tp_mesh = run.roles.tp_mesh(run.mesh)
    if tp_mesh is not None:
        model = apply_tp(model, tp_mesh, OmegaConf.to_container(cfg.plan, resolve=True))
    counts = layers_per_stage(len(model.layers), trainer.pipeline.n_stages, cfg.parallel.pp_layers_per_stage)
    mine = {index for index, _ in run.stages}
    tensors, first = {}, 0
    micro_batch = inputs[: len(inputs) // trainer.microbatches]
    with trainer.pipeline_context():
        h = model.tok_embeddings(micro_batch)
        for index, count in enumerate(counts):
            stage_input = h
            h = model.run_blocks(model.layers[first: first + count], h)
            first += count
            stage_output = model.output(model.norm(h)) if index == len(counts) - 1 else h
            if index in mine:
                tensors[index] = (micro_batch if index == 0 else stage_input, stage_output)
    return tensors


def rehearsed_stage(tensors: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """Pipeline's make_stage for the dry run: stages on meta, given their tensors."""
    def make(module, index, n_stages, _device, group):
        stage_input, stage_output = tensors[index]
        return _RehearsedStage(module, index, n_stages, torch.device("meta"), input_args=stage_input,
                               output_args=stage_output, group=group)
    return make


def rehearsal_trainer(run: Run, batch: Batch) -> Trainer:
    """The trainer of the step to count. Under pipeline parallelism its stages are given their
    tensors, and a first step (the stages' warm-up exchange) is run and not counted."""
    trainer = Trainer(run)
    if trainer.pipeline is None:
        return trainer
    trainer = Trainer(run, make_stage=rehearsed_stage(stage_tensors(run, trainer, batch.inputs)))
    trainer.forward_backward(batch)
    run.optimizer.step()
    return trainer


def simulate_rank(cfg: DictConfig, rank: int) -> RankReport:
    """Rank `rank` of the mesh, built by the builder's stages and stepped once, on meta tensors."""
    world = math.prod(cfg.mesh.shape)
    # meta: a pipeline sends and receives meta tensors
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # no stage up to the optimizer writes anything
        run = build_and_run(cfg, "", through="optimizer", run=Run(cfg=cfg, out_dir="", meta_only=True))
        batch = Batch.of(next(iter(run.dataloader)), "meta")
        params = list(run.module.named_parameters())
        activations = SavedActivations([p for _, p in params])
        totals: Dict[Tuple[str, str], List[int]] = {}
        collectives = CollectiveRecorder(counted(totals, lambda op, dim: (op, dim)), run.group_labels(), "other")
        with fsdp_on_meta() if cfg.parallel.dp_strategy != "replicate" else nullcontext():
            trainer = rehearsal_trainer(run, batch)
            with collectives, activations.hooks():
                trainer.train_step(batch, measure_norm=False)  # the configured step, clipping included
        sizes = state_bytes(run.module, run.optimizer)
        return RankReport(
            rank=rank,
            coordinates=dict(zip(cfg.mesh.dim_names, coordinates(cfg.mesh.shape, rank))),
            parameters=[(name, list(local_tensor(p).shape), list(p.shape), _placement(p)) for name, p in params],
            parameter_bytes=sizes["parameters"],
            gradient_bytes=sizes["gradients"],
            optimizer_bytes=sizes["optimizer_state"],
            activation_bytes=activations.peak,
            stages=[index for index, _ in run.stages],
            collectives=dict(sorted(totals.items())),
        )
    finally:
        with c_stderr_silenced():
            dist.destroy_process_group()
        # DTensor caches its sharding decisions by mesh, and meshes of one shape compare equal
        # whatever their groups: the next rank would reuse this rank's destroyed groups.
        _clear_sharding_prop_cache()


def dry_run(cfg: DictConfig) -> List[RankReport]:
    """Validate as the launcher does, then simulate each rank asked. The simulated mesh is on
    cpu whatever mesh.device_type says: shapes and collectives do not depend on the device."""
    validate(cfg, world_size=math.prod(cfg.mesh.shape), devices_here=False)
    check_dryrun(cfg)
    # and uncompiled: compiling changes none of the shapes, bytes or collectives it reports; and
    # the optimizer unfused: fused kernels refuse meta tensors, and hold the same state as the loop
    unfused = {"optim": {"fused": False}} if cfg.optim.get("fused") else \
        {"optim": {"adamw": {"fused": False}}} if (cfg.optim.get("adamw") or {}).get("fused") else {}  # optim=muon's
    simulated = OmegaConf.merge(cfg, {"mesh": {"device_type": "cpu"}, "trainer": {"compile": "none"}}, unfused)
    with open_dict(simulated):
        simulated.device = None  # (validation settled the run's device; the simulation settles its own: cpu)
    return [simulate_rank(simulated, rank) for rank in cfg.dryrun.ranks]


def human(n: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def print_report(report: RankReport, cfg: DictConfig) -> None:
    where = ", ".join(f"{dim} {c}" for dim, c in report.coordinates.items())
    stages = f", pipeline stage {', '.join(map(str, report.stages))}" if report.stages else ""
    print(f"\nrank {report.rank} ({where}{stages})")
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
            ("activations", report.activation_bytes, f"saved for backward, most alive at once; {per_replica} samples "
                                                     f"per replica{_micro(cfg)}"),
            ("estimated peak", report.peak_bytes, _fit(report, cfg))):
        print(f"    {label:<16} {human(n):>10}   {note}")
    print(f"  collectives of one step{'':<22}  dim    count  bytes in")
    for (op, dim), (count, nbytes) in report.collectives.items():
        print(f"    {op:<42}  {dim:<5}  {count:>5}  {human(nbytes)}")
    total_count = sum(count for count, _ in report.collectives.values())
    total_bytes = sum(nbytes for _, nbytes in report.collectives.values())
    print(f"    {'total':<42}  {'':<5}  {total_count:>5}  {human(total_bytes)}")


def _micro(cfg: DictConfig) -> str:
    p = cfg.parallel
    if MeshRoles.from_config(cfg).pp_size > 1:
        schedule = getattr(p.pp_schedule, "value", p.pp_schedule)
        return f" in {p.pp_microbatches or 'a micro-batch per stage'} micro-batches under {schedule}"
    return f" in micro-batches of {cfg.data.micro_batch_size}" if cfg.data.micro_batch_size else ""


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
