"""Pipeline parallelism's layout: the schedules, which stages and blocks each pp rank runs, and
the checks of them before launch (framework.parallel.pipeline runs them with
torch.distributed.pipelining). Light: the launcher imports it."""
from typing import Dict, List, Optional, Tuple

from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.protocol import offered


# schedule name -> (torch class name, stages per rank it takes: 1, ">1", or 2 in a V)
SCHEDULES: Dict[str, Tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "1"),
    "1f1b": ("Schedule1F1B", "1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", ">1"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", ">1"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "V"),
    "dualpipev": ("ScheduleDualPipeV", "V"),
}


# Schedules that split each backward into input and weight gradients (to fill the bubble).
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def stage_indices(pp_rank: int, pp_size: int, per_rank: int, schedule: str) -> List[int]:
    """The stages rank `pp_rank` runs: looped (r, r + pp, ...), or a V (r, 2 pp - 1 - r)."""
    if SCHEDULES[schedule][1] == "V":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(per_rank)]


def layers_per_stage(n_layers: int, n_stages: int, given: Optional[List[int]]) -> List[int]:
    """How many blocks each stage runs: parallel.pp_layers_per_stage, else an even split."""
    if given is not None:
        if len(given) != n_stages or sum(given) != n_layers or min(given) < 1:
            raise ConfigError("parallel.pp_layers_per_stage", list(given),
                              f"give {n_stages} counts (pp x pp_stages_per_rank stages), each >= 1, summing to the "
                              f"model's {n_layers} layers")
        return list(given)
    if n_layers < n_stages:
        raise ConfigError("parallel.pp_layers_per_stage", None,
                          f"the model's {n_layers} layers cannot fill {n_stages} stages (pp x pp_stages_per_rank), "
                          f"each of which needs at least one; use at most {n_layers} stages")
    if n_layers % n_stages:
        raise ConfigError("parallel.pp_layers_per_stage", None,
                          f"an even split, and the model's {n_layers} layers do not split evenly into {n_stages} "
                          f"stages (pp x pp_stages_per_rank); give each stage's count, e.g. "
                          f"[{', '.join(str(n_layers // n_stages + (i < n_layers % n_stages)) for i in range(n_stages))}], "
                          f"or change the stages")
    return [n_layers // n_stages] * n_stages


def microbatches(parallel, n_stages: int) -> int:
    """parallel.pp_microbatches, null meaning the number of stages."""
    return n_stages if parallel.pp_microbatches is None else parallel.pp_microbatches


def check_splittable(model: nn.Module, pp_dim: str) -> None:
    needed = ("tok_embeddings", "layers", "norm", "output")
    if not all(hasattr(model, name) for name in needed) or not isinstance(model.layers, nn.ModuleList):
        raise ConfigError("parallel.pp_dim", pp_dim, f"pipeline parallelism splits a model with {', '.join(needed)} "
                                                     f"(framework.models.Transformer); {type(model).__name__} has not")
    if offered(model).tie_word_embeddings:
        raise ConfigError("parallel.pp_dim", pp_dim, "the model ties its output to its embedding, which sit on the "
                                                     "first and the last stage; pipeline parallelism needs them apart")


def check_pipeline_parallel(c: Checked) -> None:
    """Before launch: the model splits as configured, the schedule takes the stages per rank
    and the micro-batch count (torch's own rules, said with the key to change)."""
    cfg, model, pp_size, dp_size = c.cfg, c.model, c.roles.pp_size, c.roles.dp_size
    p = cfg.parallel
    schedule, per_rank = getattr(p.pp_schedule, "value", p.pp_schedule), p.pp_stages_per_rank
    if pp_size == 1:
        return
    check_splittable(model, p.pp_dim)
    takes = SCHEDULES[schedule][1]
    wrong = {"1": (per_rank != 1, "runs one stage per rank; use 1, or interleaved_1f1b / interleaved_zero_bubble for "
                                  "more"),
             ">1": (per_rank < 2, "needs 2 or more stages per rank; use gpipe or 1f1b for one"),
             "V": (per_rank != 2, "runs exactly 2 stages per rank, in a V")}[takes]
    if wrong[0]:
        raise ConfigError("parallel.pp_stages_per_rank", per_rank, f"parallel.pp_schedule={schedule} {wrong[1]}")
    if schedule in SPLIT_BACKWARD and cfg.trainer.compile != "none":
        raise ConfigError("trainer.compile", cfg.trainer.compile, f"parallel.pp_schedule={schedule} splits each backward "
                                                                  f"into input and weight gradients, which compiled "
                                                                  f"blocks fail in (torch 2.13); use trainer.compile=none "
                                                                  f"or another schedule")
    n_stages = pp_size * per_rank
    layers_per_stage(len(model.layers), n_stages, p.pp_layers_per_stage)
    micro = microbatches(p, n_stages)
    if micro < 1:
        raise ConfigError("parallel.pp_microbatches", micro, "must be >= 1 (null: the number of stages)")
    if schedule in ("1f1b", "dualpipev") and micro < n_stages:
        raise ConfigError("parallel.pp_microbatches", micro, f"{schedule} needs at least as many micro-batches as "
                                                             f"stages ({n_stages}) to fill the pipeline")
    rounds = max(1, micro // pp_size)
    if takes == ">1" and micro % rounds:
        raise ConfigError("parallel.pp_microbatches", micro, f"{schedule} runs micro-batches in rounds of the pp size "
                                                             f"{pp_size}: use a multiple of {rounds}")
    local = cfg.data.global_batch_size // dp_size
    if local % micro:
        raise ConfigError("parallel.pp_microbatches", micro, f"must divide each replica's batch of {local} "
                                                             f"(data.global_batch_size / DP size {dp_size})")
    if cfg.data.micro_batch_size is not None:
        raise ConfigError("data.micro_batch_size", cfg.data.micro_batch_size,
                          "under pipeline parallelism the schedule's micro-batches are the gradient accumulation; "
                          "set parallel.pp_microbatches instead and data.micro_batch_size=null")


def last_stage_rank(pp_size: int, per_rank: int, schedule: str) -> int:
    """The pp rank that runs the last stage (and so computes the loss)."""
    last = pp_size * per_rank - 1
    return next(r for r in range(pp_size) if last in stage_indices(r, pp_size, per_rank, schedule))
