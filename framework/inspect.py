"""What one training step communicates, and where a step's time goes, from the configured
mesh's own ranks.

    python -m framework.inspect comm [overrides]    rank 0's collectives by type, with counts
    python -m framework.inspect trace [overrides]   per rank, the order of module forward and
                                                    backward passes with the collectives in each
    python -m framework.inspect profile [--out=DIR] [overrides]
                                                    per rank, torch.profiler over 3 steps after
                                                    the first: top operators by self time, the
                                                    share in collectives, a trace in DIR/profile/

Both compose the config like framework.train (same groups, recipes and overrides; no output
dir), start the mesh's ranks, build the model and run one step as training runs it (the
Trainer's train_step: forward, backward with the gradient finalization, trainer.grad_clip's
global norm, optimizer step; no logging). DTensor's own collectives (TP)
and the c10d ones DataParallel issues (DP gradient averaging) are both seen. `trace` is for a
hang or a mismatch: ranks of one group must issue that group's collectives in the same order,
and it says where the first pair of ranks differs.
"""
import math
import os
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional

import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed._tools.mod_tracker import ModTracker

from framework.data.batch import Batch
from framework.parallel.collectives import CollectiveRecorder, counted
from framework.training.builder import build_and_run
from framework.cli import command_status, compose_config
from framework.launch.handoff import rank_config
from framework.launch.local import spawn_ranks
from framework.launch.threads import binds_cores
from framework.data.loader import DataPosition, batches
from framework.training.profiling import format_summary, profiled, summary, trace_path
from framework.training.trainer import Trainer
from framework.validate import validate

USAGE = ("usage: python -m framework.inspect {comm|trace|profile} [--out=DIR (profile)] "
         "[hydra overrides, e.g. recipe=lm_2d mesh=1x2]")
PROFILED_STEPS = 3  # after a first step, which compiles and warms caches


def build_for_one_step(cfg_container: dict, out_dir: str):
    """In every rank: the run built up to the optimizer, and its first batch."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="optimizer")
    return run, Batch.of(next(iter(run.dataloader)), run.cfg.mesh.device_type)


def pipeline_warmed(run, batch: Batch) -> Trainer:
    """The run's trainer; under pipeline parallelism after a first step, which also exchanges
    the stages' tensor shapes (3 sends and 3 receives per stage boundary) and infers the
    gradients' with autograd.grad (which ModTracker's hooks on leaves refuse)."""
    trainer = Trainer(run)
    if run.stages:
        trainer.forward_backward(batch)
        run.optimizer.step()
    return trainer


def collectives_of_one_step(cfg_container: dict, out_dir: str) -> Dict[str, int]:
    """Runs in every rank: one counted step (under pipeline parallelism the second)."""
    run, batch = build_for_one_step(cfg_container, out_dir)
    trainer = pipeline_warmed(run, batch)
    totals: Dict[str, List[int]] = {}
    with CollectiveRecorder(counted(totals, lambda op, dim: op)):
        trainer.train_step(batch, measure_norm=False)  # the configured step, clipping included
    dist.destroy_process_group()
    return {op: count for op, (count, _) in totals.items()}


def trace_of_one_step(cfg_container: dict, out_dir: str) -> List[dict]:
    """Runs in every rank: the order of module forward/backward passes in one step, and the
    collectives issued inside each (those outside any module under `step`)."""
    run, batch = build_for_one_step(cfg_container, out_dir)
    trainer = pipeline_warmed(run, batch)
    dim_of_group = run.group_labels()
    names = {module: name or "(model)" for name, module in run.module.named_modules()}
    events = [{"pass": "step", "module": "start", "collectives": []}]

    def enter(kind: str):
        def hook(module, *_):
            if module in names:  # not DataParallel's wrapper: its module's events say it all
                events.append({"pass": kind, "module": names[module], "collectives": []})
        return hook

    tracker = ModTracker()
    tracker.register_user_hooks(pre_fw_hook=enter("forward"), pre_bw_hook=enter("backward"))
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    def record(op: str, dim: str, _bytes: int) -> None:  # into the current module pass
        events[-1]["collectives"].append(f"{op.split('.')[1]}[{dim}]")

    with tracker, CollectiveRecorder(record, dim_of_group):
        trainer.train_step(batch, measure_norm=False, on_gradients=lambda: events.append(
            {"pass": "step", "module": "optimizer", "collectives": []}))  # (trainer.grad_clip's norm in it)
    dist.destroy_process_group()
    return events


def on_ranks(function, overrides: List[str], *args) -> Dict[int, object]:
    """Compose and validate like framework.train, then run `function` on every rank of the mesh."""
    cfg = compose_config(overrides)
    validate(cfg)
    with tempfile.TemporaryDirectory(prefix="framework-inspect-") as out_dir:
        # each rank's threads and cores as in a run of this config: the profile is of that run
        return spawn_ranks(math.prod(cfg.mesh.shape), function, rank_config(cfg), out_dir, *args,
                           threads_per_rank=cfg.launcher.threads_per_rank,
                           bind_cores=binds_cores(cfg))


def profile_of_steps(cfg_container: dict, out_dir: str, trace_dir: str) -> dict:
    """Runs in every rank: PROFILED_STEPS train steps after a first one, under torch.profiler."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="optimizer")
    trainer = Trainer(run)
    data = batches(run.sampler, run.dataloader, DataPosition(), run.cfg.data.global_batch_size)
    with profiled(trace_dir, run.rank, PROFILED_STEPS) as profiler:
        for _ in range(PROFILED_STEPS + 1):
            trainer.train_step(Batch.of(next(data), run.cfg.mesh.device_type), measure_norm=False)
            profiler.step()
    dist.destroy_process_group()
    return summary(profiler)


def print_profiles(argv: List[str]) -> int:
    out = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--out=")),
               os.path.join("outputs", "profile", time.strftime("%Y-%m-%d_%H-%M-%S")))
    results = on_ranks(profile_of_steps, [arg for arg in argv if not arg.startswith("--out=")], os.path.abspath(out))
    for rank in sorted(results):
        print("\n".join(format_summary(rank, results[rank], trace_path(os.path.abspath(out), rank))))
    print(f"open the traces in https://ui.perfetto.dev or: tensorboard --logdir {os.path.join(out, 'profile')}")
    return 0


def count_collectives(overrides: List[str]) -> Dict[int, Dict[str, int]]:
    """Each rank's counts (ranks of one pipeline stage issue the same; other stages may not)."""
    return {rank: dict(sorted(counts.items())) for rank, counts in sorted(on_ranks(collectives_of_one_step,
                                                                                    overrides).items())}


POINT_TO_POINT = ("send", "recv_")  # a pipeline's: one rank's send is its neighbour's recv


def first_difference(traces: Dict[int, List[dict]]) -> Optional[str]:
    """Where two ranks first issue different collectives on a group they share (mesh dim), or
    None when every group's ranks agree. Sends and receives are left out: their ranks differ
    by design."""
    sequences = {rank: [(c, i, e["pass"], e["module"]) for i, e in enumerate(events) for c in e["collectives"]
                        if c.split("[")[0] not in POINT_TO_POINT]
                 for rank, events in traces.items()}
    dims = {c.rsplit("[", 1)[1].rstrip("]") for seq in sequences.values() for c, *_ in seq}
    for dim in sorted(dims):
        on_dim = {r: [s for s in seq if s[0].endswith(f"[{dim}]")] for r, seq in sequences.items()}
        ranks = sorted(on_dim)
        for a, b in zip(ranks, ranks[1:]):
            for n, (x, y) in enumerate(zip(on_dim[a], on_dim[b])):
                if x[0] != y[0]:
                    return (f"{dim} collective #{n + 1}: rank {a} issues {x[0]} in {x[2]} {x[3]}, "
                            f"rank {b} issues {y[0]} in {y[2]} {y[3]}")
            if len(on_dim[a]) != len(on_dim[b]):
                return f"{dim}: rank {a} issues {len(on_dim[a])} collectives, rank {b} {len(on_dim[b])}"
    return None


def print_traces(traces: Dict[int, List[dict]]) -> None:
    for rank in sorted(traces):
        print(f"rank {rank}:")
        for n, event in enumerate(traces[rank]):
            print(f"  {n:4d} {event['pass']:<9} {event['module']:<32} {' '.join(event['collectives'])}".rstrip())
    difference = first_difference(traces)
    print(f"first difference between ranks: {difference}" if difference else
          "every rank issues its groups' collectives in the same order as the other ranks of each group")


def main(argv: List[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in ("comm", "trace", "profile"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "profile":
        return command_status(lambda: print_profiles(argv[1:]), "profiling failed", argv, USAGE)
    if argv[0] == "trace":
        return command_status(lambda: print_traces(on_ranks(trace_of_one_step, argv[1:])) or 0, "inspection failed",
                              argv, USAGE)
    return command_status(lambda: print_counts(count_collectives(argv[1:]), argv[1:]), "inspection failed", argv,
                          USAGE)


def print_counts(per_rank: Dict[int, Dict[str, int]], overrides: List[str]) -> int:
    """Rank 0's counts, and every other rank whose counts differ (another pipeline stage)."""
    shown = [rank for rank, counts in per_rank.items() if rank == 0 or counts != per_rank[0]]
    for rank in shown:
        counts = per_rank[rank]
        print(f"collectives in one training step (rank {rank}), {' '.join(overrides) or 'default config'}:")
        width = max([len(op) for op in counts] + [10])
        for op, n in counts.items():
            print(f"  {op.ljust(width)}  {n}")
        print(f"  {'total'.ljust(width)}  {sum(counts.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
