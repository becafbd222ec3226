"""Every layout the planner weighs for `world` ranks: mesh factorizations over pp, dp and tp (and,
for a mixture of experts, experts over dp), each DP strategy, activation checkpointing on and off,
and the pipeline's micro-batches; each as the overrides framework.train would take, and each
checked by the launcher's own validation (a refusal keeps its one line)."""
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from omegaconf import DictConfig

from framework.cli import compose_config
from framework.config.errors import ConfigError
from framework.config.validate import validate


@dataclass
class Candidate:
    overrides: List[str]
    cfg: Optional[DictConfig] = None
    refusal: Optional[str] = None  # the validation's line, when refused
    labels: dict = field(default_factory=dict)  # what tells it from the others, for the table


def factorizations(world: int, parts: int) -> List[Tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `world`."""
    if parts == 1:
        return [(world,)]
    return [(d, *rest) for d in range(1, world + 1) if world % d == 0 for rest in factorizations(world // d, parts - 1)]


def layouts(cfg: DictConfig, world: int) -> List[Tuple[List[str], dict]]:
    """(overrides, labels) of each layout, before validation."""
    has_plan = bool(cfg.plan)
    recomputes = ("none", "full") if "activation_checkpointing" in cfg.model else (None,)
    moe = cfg.model.get("moe") or None
    per_replica_batches = cfg.data.global_batch_size
    found = []
    for pp, dp, tp in factorizations(world, 3):
        if tp > 1 and not has_plan:
            continue  # TP ranks without a plan would only repeat each other's work
        names = ["pp", "dp", "tp"] if pp > 1 else ["dp", "tp"]
        shape = [pp, dp, tp] if pp > 1 else [dp, tp]
        mesh = [f"mesh.shape=[{','.join(map(str, shape))}]", f"mesh.dim_names=[{','.join(names)}]"]
        mesh += [] if tp > 1 else ["plan=none"]
        pipeline = [[]]
        if pp > 1:
            local = per_replica_batches // dp
            micro = 2 * pp if local % (2 * pp) == 0 else pp
            pipeline = [["parallel.pp_schedule=1f1b", f"parallel.pp_microbatches={micro}"]]
        experts = [[]]
        if moe and dp > 1 and moe.n_experts % dp == 0:
            experts = [["parallel.ep_dims=null"], ["parallel.ep_dims=[dp]"]]
        elif moe:
            experts = [["parallel.ep_dims=null"]]
        for strategy in ["replicate", "fsdp"] if dp > 1 else ["replicate"]:
            for recompute in recomputes:
                for stages in pipeline:
                    for spread in experts:
                        overrides = [*mesh, f"parallel.dp_strategy={strategy}", *stages, *spread]
                        overrides += [f"model.activation_checkpointing={recompute}"] if recompute else []
                        labels = {"mesh": f"pp{pp} dp{dp} tp{tp}", "strategy": strategy, "AC": recompute or "-",
                                  "micro": stages[-1].split("=")[1] if stages else "-",
                                  **({"experts": "dp" if spread == ["parallel.ep_dims=[dp]"] else "all"} if moe else {})}
                        found.append((overrides, labels))
    return found


def candidates(user_overrides: Sequence[str], world: int) -> List[Candidate]:
    """Each layout composed over the user's overrides and validated for `world` ranks."""
    base = compose_config(user_overrides)
    result = []
    for overrides, labels in layouts(base, world):
        candidate = Candidate(overrides, labels=labels)
        try:
            candidate.cfg = compose_config([*user_overrides, *overrides])
            validate(candidate.cfg, world_size=math.prod(candidate.cfg.mesh.shape))
        except ConfigError as error:
            candidate.cfg, candidate.refusal = None, str(error)
        result.append(candidate)
    return result
