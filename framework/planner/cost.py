"""A candidate's predicted memory per rank and step time, from its dry run.

Memory: the dry run's parameter, gradient and optimizer bytes (exact: the local shards the run
holds) plus the activations it saw saved for backward (one micro-batch's, or what the pipeline
schedule keeps alive), under every DP strategy: fsdp and hsdp are dry-run as they run.

Time = compute + communication + the pipeline's bubble, where the DP strategy's communication
(DataParallel's bucketed all-reduce, FSDP's prefetched all-gathers and reduce-scatters) hides
behind up to `dp_overlap` x the compute (the device's: 1 for GPUs, whose collectives run on
streams of their own; 0 for this CPU, where gloo's collectives take the cores compute uses:
bench/README.md "DP gradient sync" measured overlap no faster here) and the rest adds:
- compute: the step's FLOPs on this rank (the model's flops_per_token x the tokens a rank
  computes; x 4/3 with activation checkpointing, which repeats the forward) over the device's
  matmul rate at the rank's thread count; ranks beyond the cores share them (oversubscription);
- communication: each collective the dry run recorded, latency + bytes moved / bandwidth (ring
  algorithms: an all-reduce moves 2 (n-1)/n of its buffer, an all-gather (n-1) x its input, a
  reduce-scatter or all-to-all (n-1)/n), inside a host or across hosts by the group's ranks
  (FSDP's per-unit all-gathers, re-gathers and reduce-scatters as the dry run saw them). On the CPU the
  latency and bandwidth are those measured with as many ranks as the run has (the nearest world
  measured), its latency the larger of an idle all-reduce's and one's between bursts of compute
  (with more ranks than cores it waits for peers the scheduler set aside);
- bubble: compute x (pp - 1) / (micro-batches x stages per rank): 1f1b and gpipe, and
  interleaved 1F1B's smaller one (Narayanan et al. 2021); none with more ranks than cores, where
  a stage that waits leaves its core to another rank.
"""
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from framework.parallel.mesh import spanning_ranks
from framework.parallel.roles import MeshRoles
from framework.models.protocol import offered

# bytes moved per byte taken in, for a group of n ranks
MOVED = {"allreduce": lambda n: 2 * (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
         "allgather": lambda n: n - 1, "all_gather": lambda n: n - 1,
         "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    memory_bytes: int
    tokens_per_s: float


def moved_fraction(op: str, n: int) -> float:
    name = op.split(".", 1)[1].lstrip("_")  # (c10d._allgather_base_)
    return next((f(n) for key, f in MOVED.items() if name.startswith(key)), 1.0)  # send / recv / broadcast: 1


def group_ranks(roles: MeshRoles, dim: str) -> List[int]:
    """Rank 0's group over a recorded dim (a flattened one is named by its dims joined by _)."""
    names = list(roles.dim_names)
    dims = [d for d in names if d == dim] or [d for d in names if d in dim.split("_")] or names
    return spanning_ranks(list(roles.shape), 0, [names.index(d) for d in dims])


def flops_per_rank(cfg: DictConfig, roles: MeshRoles) -> float:
    with torch.device("meta"):
        model = instantiate(cfg.model)
    seq_len = cfg.data.dataset.get("seq_len") or 1
    tokens = cfg.data.global_batch_size * seq_len
    per_token = offered(model).flops_per_token(seq_len) or 6 * sum(p.numel() for p in model.parameters())
    recompute = 4 / 3 if cfg.model.get("activation_checkpointing") == "full" else 1.0
    return per_token * tokens * recompute / (roles.dp_size * roles.tp_size * roles.pp_size * roles.cp_size)


def compute_seconds(flops: float, world: int, device: Dict) -> float:
    if "cores" not in device:  # a GPU profile: one device per rank
        return flops / (device["matmul_tflops"] * 1e12)
    cores, rates = device["cores"], device["matmul_gflops"]
    threads = max(1, cores // world)
    rate = rates[threads] if threads in rates else rates[1] * threads  # (measured at 1 and at every core)
    return flops / (rate * 1e9) * max(1.0, world * threads / cores)


def link(device: Dict, world: int, inside: bool) -> Tuple[float, float]:
    """(latency in s, bandwidth in B/s) of a collective in a run of `world` ranks."""
    if "collectives" in device:  # measured here: with the nearest world size measured, between compute
        measured = device["collectives"][min(device["collectives"], key=lambda n: (abs(n - world), -n))]
        return max(measured["latency_us"], measured["busy_latency_us"]) * 1e-6, measured["gbps"] * 1e9
    where = "intra" if inside else "inter"
    return device[f"{where}_latency_us"] * 1e-6, device[f"{where}_gbps"] * 1e9


def data_parallel(op: str, dim: str, roles: MeshRoles) -> bool:
    """A DP strategy's gradient or parameter collective (DataParallel's all-reduce, FSDP's
    all-gathers and reduce-scatters) over DP ranks, flattened with cp or not: what can overlap
    with compute. (Expert parallelism's all-to-alls on the same ranks cannot: the next layer waits.)"""
    dp_groups = {*roles.dp_dims, "_".join(roles.dp_dims), "_".join([*roles.dp_dims, roles.cp_dim or ""])}
    return dim in dp_groups and any(kind in op for kind in ("allreduce", "allgather", "reduce_scatter"))


def comm_seconds(collectives: Dict, roles: MeshRoles, device: Dict) -> Tuple[float, float]:
    """(the DP strategy's communication, the rest's), nothing overlapped."""
    per_host = device.get("ranks_per_host") or roles.world
    totals = [0.0, 0.0]
    for (op, dim), (count, nbytes) in collectives.items():
        ranks = group_ranks(roles, dim)
        latency, bandwidth = link(device, roles.world, len({r // per_host for r in ranks}) == 1)
        seconds = count * latency + nbytes * moved_fraction(op, len(ranks)) / bandwidth
        totals[0 if data_parallel(op, dim, roles) else 1] += seconds
    return totals[0], totals[1]


def predict(cfg: DictConfig, reports: List, device: Dict) -> Prediction:
    """From the candidate's config and the dry-run reports of its ranks."""
    roles = MeshRoles.from_config(cfg)
    memory = max(r.peak_bytes for r in reports)
    compute = compute_seconds(flops_per_rank(cfg, roles), roles.world, device)
    # the DP strategy's communication beyond what hides behind compute (device dp_overlap)
    comm = max(max(0.0, dp - device.get("dp_overlap", 0.0) * compute) + rest
               for dp, rest in (comm_seconds(r.collectives, roles, device) for r in reports))
    bubble = 0.0
    if roles.pp_size > 1 and roles.world <= device.get("cores", roles.world):  # (else idle stages yield their cores)
        looped = cfg.parallel.pp_stages_per_rank  # interleaved: each rank's share of the bubble is 1 / its stages
        bubble = compute * (roles.pp_size - 1) / ((cfg.parallel.pp_microbatches or roles.pp_size) * looped)
    step = compute + comm + bubble
    tokens = cfg.data.global_batch_size * (cfg.data.dataset.get("seq_len") or 1)
    return Prediction(step, compute, comm, bubble, memory, tokens / step)
