"""Every layout the planner weighs for `world` ranks: mesh factorizations over pp, dp and tp
(and cp when planner.dims has it; for a mixture of experts, experts over dp), each DP strategy
(replicate, fsdp, hsdp over each split of dp into replicas x shards), activation checkpointing on
and off, the pipeline's schedules (1F1B; interleaved 1F1B, 2 stages per rank) and micro-batches;
each as the overrides framework.train would take, and each checked by the launcher's own
validation (a refusal keeps its one line)."""
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from framework.cli import compose_config
from framework.config.errors import ConfigError
from framework.validate import validate


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


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dp_layouts(dp: int) -> List[Tuple[str, List[str], List[int], str]]:
    """(strategy, DP dim names, DP shape, label) of `dp` DP ranks: replicate; fsdp over all;
    hsdp, replicas x shards, for each split into two dims of 2 or more."""
    if dp == 1:
        return [("replicate", ["dp"], [1], "dp1")]
    found = [("replicate", ["dp"], [dp], f"dp{dp}"), ("fsdp", ["dp"], [dp], f"dp{dp}")]
    return found + [("hsdp", ["dp_replicate", "dp"], [r, dp // r], f"dp{r}x{dp // r}")
                    for r in divisors(dp) if 1 < r < dp]


def schedules(pp: int, per_replica: int, n_layers: int) -> List[Tuple[List[str], str, str]]:
    """(overrides, schedule label, micro-batches label) of a pipeline of `pp` stages: 1F1B with
    2 x pp micro-batches where they divide the replica's batch (else pp), and interleaved 1F1B
    with 2 stages per rank where the model has the blocks."""
    if pp == 1:
        return [([], "-", "-")]
    micro = 2 * pp if per_replica % (2 * pp) == 0 else pp
    found = [(["parallel.pp_schedule=1f1b", f"parallel.pp_microbatches={micro}"], "1f1b", str(micro))]
    if n_layers >= 2 * pp:
        found.append((["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
                       f"parallel.pp_microbatches={micro}"], "interleaved", str(micro)))
    return found


def layouts(cfg: DictConfig, world: int, dims: Sequence[str], strategies: Sequence[str] = ("replicate", "fsdp", "hsdp"),
            fixed_recompute: bool = False) -> List[Tuple[List[str], dict]]:
    """(overrides, labels) of each layout, before validation: the mesh over `dims` (pp, dp, tp,
    and cp when asked; dp then split for hsdp), outermost first. Activation checkpointing on and
    off unless the user fixed it; no TP group across hosts (mesh.ranks_per_host) unless allowed."""
    has_plan = bool(cfg.plan)
    recomputes = ("none", "full") if "activation_checkpointing" in cfg.model else (None,)
    if fixed_recompute:
        recomputes = (cfg.model.activation_checkpointing,)
    per_host = None if cfg.parallel.allow_tp_across_hosts else cfg.mesh.ranks_per_host
    moe = cfg.model.get("moe") or None
    n_layers = cfg.model.get("n_layers") or 0
    searched = [d for d in ("pp", "dp", "cp", "tp") if d in dims]
    found = []
    for sizes in factorizations(world, len(searched)):
        size = dict(zip(searched, sizes))
        pp, dp, cp, tp = (size.get(d, 1) for d in ("pp", "dp", "cp", "tp"))
        if tp > 1 and not has_plan:
            continue  # TP ranks without a plan would only repeat each other's work
        if per_host and per_host % tp:
            continue  # a TP group across hosts, which the validation refuses (allow_tp_across_hosts)
        for strategy, dp_names, dp_shape, dp_label in dp_layouts(dp):
            if strategy not in strategies and dp > 1:
                continue
            names = [*(["pp"] if pp > 1 else []), *dp_names, *(["cp"] if cp > 1 else []), "tp"]
            shape = [*([pp] if pp > 1 else []), *dp_shape, *([cp] if cp > 1 else []), tp]
            mesh = [f"mesh.shape=[{','.join(map(str, shape))}]", f"mesh.dim_names=[{','.join(names)}]"]
            mesh += [] if tp > 1 else ["plan=none"]
            experts = [[]]
            if moe and dp > 1 and moe.n_experts % dp == 0:
                spread = "[dp_replicate,dp]" if strategy == "hsdp" else "[dp]"
                experts = [["parallel.ep_dims=null"], [f"parallel.ep_dims={spread}"]]
            elif moe:
                experts = [["parallel.ep_dims=null"]]
            for recompute in recomputes:
                for stages, schedule, micro in schedules(pp, cfg.data.global_batch_size // dp, n_layers):
                    for spread in experts:
                        overrides = [*mesh, f"parallel.dp_strategy={strategy}", *stages, *spread]
                        if recompute and not fixed_recompute:
                            overrides.append(f"model.activation_checkpointing={recompute}")
                        labels = {"mesh": f"pp{pp} {dp_label}{f' cp{cp}' if 'cp' in searched else ''} tp{tp}",
                                  "strategy": strategy, "AC": recompute or "-", "schedule": schedule, "micro": micro,
                                  **({"experts": "all" if spread == ["parallel.ep_dims=null"] else "dp"} if moe else {})}
                        found.append((overrides, labels))
    return found


def candidates(user_overrides: Sequence[str], world: int, dims: Sequence[str] = ("pp", "dp", "tp"),
               strategies: Sequence[str] = ("replicate", "fsdp", "hsdp")) -> List[Candidate]:
    """Each layout composed over the user's overrides and validated for `world` ranks."""
    base = compose_config(user_overrides)
    composed = {}  # the user's config under each group choice the layouts make (plan=none): Hydra composes each once
    result = []
    fixed_recompute = any(o.startswith("model.activation_checkpointing=") for o in user_overrides)
    for overrides, labels in layouts(base, world, dims, strategies, fixed_recompute):
        candidate = Candidate(overrides, labels=labels)
        groups = tuple(o for o in overrides if "." not in o.split("=")[0])
        try:
            if groups not in composed:
                composed[groups] = compose_config([*user_overrides, *groups])
            candidate.cfg = OmegaConf.merge(composed[groups],
                                            OmegaConf.from_dotlist([o for o in overrides if o not in groups]))
            validate(candidate.cfg, world_size=math.prod(candidate.cfg.mesh.shape))
        except ConfigError as error:
            candidate.cfg, candidate.refusal = None, str(error)
        result.append(candidate)
    return result
