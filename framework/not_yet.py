"""The pairs of features that do not compose yet, in one table. Each is a choice of what to build
next, not a rule of the math: the refusal names both keys, says "not yet" and gives the fix.
validate() asks the table before building anything; docs/checks-and-trust.md shows it
(tests/test_docs.py keeps the two equal)."""
from dataclasses import dataclass
from typing import Callable, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.parallel.fault_tolerance_config import replica_dim
from framework.parallel.roles import MeshRoles
from framework.training.objectives.base import objective_kind
from framework.training.objectives.grpo import GroupRelativePolicy
from framework.training.objectives.preference import DirectPreference, KahnemanTversky, SimplePreference

PREFERENCE = (DirectPreference.kind, SimplePreference.kind, KahnemanTversky.kind)


def _grpo(cfg: DictConfig) -> bool:
    return objective_kind(cfg) == GroupRelativePolicy.kind


def _torchft(cfg: DictConfig) -> bool:
    return cfg.launcher.get("fault_tolerance") == "torchft"


def _adapter(cfg: DictConfig) -> bool:
    return cfg.adapter.kind in ("lora", "qlora")


def _dims_inside_a_replica_group(cfg: DictConfig, roles: MeshRoles) -> List[str]:
    """The dims of size > 1 torchft's replica groups would hold besides TP (the replica dim is
    dp_replicate when the mesh has one, else dp)."""
    sizes, replica = dict(zip(roles.dim_names, roles.shape)), replica_dim(cfg)
    return [name for name in (cfg.parallel.dp_dim, roles.cp_dim, roles.pp_dim)
            if name and name != replica and sizes.get(name, 1) > 1]


@dataclass(frozen=True)
class NotYet:
    """Feature `key` with feature `other`, refused when `applies`."""
    key: str
    other: str
    applies: Callable[[DictConfig, MeshRoles], bool]
    why: str  # what is missing, then the fix
    shown: Optional[str] = None  # the value the line (and the docs' table) shows (default: the config's at `key`)
    value: Optional[Callable[[DictConfig], str]] = None  # the line's value, where `shown` names several

    def check(self, cfg: DictConfig, roles: MeshRoles) -> None:
        if self.applies(cfg, roles):
            value = self.value(cfg) if self.value else self.shown if self.shown is not None else \
                OmegaConf.select(cfg, self.key)
            value = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
            raise ConfigError(self.key, value, f"not yet with {self.other}: {self.why}")


NOT_YET = [
    NotYet("objective", "context parallelism (parallel.cp_dim)",
           lambda cfg, roles: objective_kind(cfg) in PREFERENCE and roles.cp_size > 1,
           "each sequence's log-probabilities would be summed from its CP ranks' chunks; use a mesh without a cp dim",
           shown="dpo / simpo / kto", value=objective_kind),
    NotYet("objective", "pipeline parallelism (parallel.pp_dim)",
           lambda cfg, roles: objective_kind(cfg) in PREFERENCE and roles.pp_size > 1,
           "each sequence's log-probabilities (and DPO's and KTO's reference) come from whole logits, not a stage "
           "of the schedule; use a mesh without a pp dim", shown="dpo / simpo / kto",
           value=objective_kind),
    NotYet("objective", "context or pipeline parallelism (parallel.cp_dim, pp_dim)",
           lambda cfg, roles: _grpo(cfg) and max(roles.cp_size, roles.pp_size) > 1,
           "generation decodes with a KV cache through whole sequences and every layer at once; use a mesh of "
           "DP and TP dims (e.g. mesh=2x1 plan=none)", shown="grpo"),
    NotYet("objective", "trainer.compile",
           lambda cfg, roles: _grpo(cfg) and cfg.trainer.compile != "none",
           "decoding one token at a time would recompile the blocks; use trainer.compile=none", shown="grpo"),
    NotYet("objective", "trainer.eval_every",
           lambda cfg, roles: _grpo(cfg) and bool(cfg.trainer.eval_every),
           "held-out prompts are not scored yet; use trainer.eval_every=0", shown="grpo"),
    NotYet("objective", "launcher.fault_tolerance=torchft",
           lambda cfg, roles: _grpo(cfg) and _torchft(cfg),
           "a replica group's rollout is not redone after a heal; use launcher.fault_tolerance=null", shown="grpo"),
    NotYet("parallel.ep_dims", "context parallelism (parallel.cp_dim)",
           lambda cfg, roles: bool(roles.ep_dims) and roles.cp_size > 1,
           "the all-to-all would route each CP rank's chunks apart; use parallel.ep_dims=null"),
    NotYet("launcher.fault_tolerance", "parallel.dp_strategy=fsdp / hsdp",
           lambda cfg, roles: _torchft(cfg) and cfg.parallel.dp_strategy != "replicate",
           "FSDP2's reduce-scatter has no torchft hook here; use parallel.dp_strategy=replicate", shown="torchft"),
    NotYet("launcher.fault_tolerance", "parallel.ep_dims",
           lambda cfg, roles: _torchft(cfg) and bool(roles.ep_dims),
           "experts spread over ranks are not healed across replica groups; use parallel.ep_dims=null", shown="torchft"),
    NotYet("launcher.fault_tolerance", "dp, cp or pp dims inside a replica group (mesh.shape)",
           lambda cfg, roles: _torchft(cfg) and bool(_dims_inside_a_replica_group(cfg, roles)),
           "a replica group holds TP ranks only; give the other dims inside it size 1", shown="torchft"),
    NotYet("adapter.dropout", "tensor parallelism (parallel.tp_dim)",
           lambda cfg, roles: _adapter(cfg) and cfg.adapter.dropout > 0 and roles.tp_size > 1,
           "each TP rank would draw its own mask of the adapter's input; use adapter.dropout=0 or a mesh without TP"),
    NotYet("data.streaming", "context parallelism (parallel.cp_dim)",
           lambda cfg, roles: bool(cfg.data.get("streaming")) and roles.cp_size > 1,
           "a stream's windows are not cut into CP chunks here; use data.streaming=false (the same records, indexed)"),
    NotYet("data.streaming", "launcher.fault_tolerance=torchft",
           lambda cfg, roles: bool(cfg.data.get("streaming")) and _torchft(cfg),
           "a healed replica group would not receive the live group's place in its stream; use data.streaming=false"),
    NotYet("float8", "adapter=lora / qlora",
           lambda cfg, roles: _adapter(cfg) and cfg.get("float8") is not None,
           "torchao swaps each converted layer for a new module, without an adapted layer's LoRA children and hook, "
           "and QLoRA's NF4 weight is no float8 input; use float8=null or adapter=none"),
    NotYet("checkpoint.final_hf", "adapter=lora / qlora",
           lambda cfg, roles: _adapter(cfg) and bool(cfg.checkpoint.final_hf),
           "the run writes no merged model itself; export its checkpoint: python -m framework.export CKPT OUT "
           "--format peft (the adapter) or --format hf (merged)"),
]


def check_not_yet(c: Checked) -> None:
    """The first pair of the table this config holds, refused in one line."""
    for pair in NOT_YET:
        pair.check(c.cfg, c.roles)
