"""Whole-config validation, run in the launcher before any worker starts (and again, cheaply,
in every rank). Each failure is one ConfigError naming the key, the value and the fix."""
import inspect
import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch.utils.data import IterableDataset
from hydra.utils import get_class, get_object
from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.compat import (check_checkpoint_keys, check_checkpoint_sources, check_checkpoint_writable,
                                         checkpoint_dir)
from framework.config.schema import STAGES, did_you_mean, unknown_key
from framework.config.checked import Checked, instantiate_checked, reads_config
from framework.config.errors import ConfigError
from framework.not_yet import check_not_yet
from framework.config.trust import check_targets
from framework.data.loader import check_loader
from framework.launch.threads import available_cores
from framework.data.mixture import source_nodes
from framework.training.logger import check_loggers
from framework.data.checks import check_document_masking, check_responses, check_token_data
from framework.data.dataset_config import tokenizer_of
from framework.models.hf import check_final_hf, check_length, check_model_path, check_vocab, check_weights
from framework.models.meta import SkipRandomInit
from framework.parallel.device import check_devices, settle_device
from framework.parallel.roles import MeshRoles
from framework.models.lifecycle import adapt
from framework.models.lora import check_adapter, check_adapter_init_from
from framework.models.float8 import check_float8
from framework.models.nf4 import check_qlora
from framework.training.objectives.grpo import check_grpo
from framework.training.objectives.preference import check_preference, check_unpaired
from framework.training.objectives.reference import check_reference_on_resume
from framework.training.objectives.environments import check_environment
from framework.training.objectives.rewards import check_reward
from framework.parallel.context_parallel_checks import check_context_parallel
from framework.parallel.expert_parallel_checks import check_expert_parallel
from framework.parallel.fault_tolerance_config import check_fault_tolerance
from framework.training.objectives.base import check_objective, check_objective_options
from framework.parallel.pipeline_layout import check_pipeline_parallel
from framework.parallel.plan import check_output_layout, check_plan, matching_modules, shards_sequence
from framework.training.compile import compiled_blocks
from framework.training.muon import check_muon
from framework.models.protocol import from_hugging_face, offered
from framework.models.vision import check_vision
from framework.models.transformers_model import TransformersModel, check_transformers_model


def check_known_keys(cfg: DictConfig) -> None:
    """A key added with `+` (or by a recipe) that no typed section has would be ignored, and
    the run would train something else than asked: refuse it, naming the likely key."""
    found = unknown_key(cfg)
    if found:
        key, known = found
        raise ConfigError(key, OmegaConf.select(cfg, key), f"no such key; {did_you_mean(key, known)}")


def check_mesh(cfg: DictConfig) -> None:
    """The mesh's dims and roles (framework.parallel.roles), its host and backend settings, and
    what the DP strategy needs of the roles."""
    if cfg.mesh.get("auto"):
        raise ConfigError("mesh", "auto", "is chosen by framework.train, self-launched or under torchrun (the "
                                          "planner's first choice); give this command a mesh (python -m "
                                          "framework.planner planner.world=N ranks them)")
    roles = MeshRoles.from_config(cfg)
    roles.check()
    if cfg.mesh.ranks_per_host is not None and cfg.mesh.ranks_per_host < 1:
        raise ConfigError("mesh.ranks_per_host", cfg.mesh.ranks_per_host, "must be >= 1, or null for all ranks on one host")
    if cfg.mesh.device_type == "cpu" and cfg.mesh.backend == "nccl":
        raise ConfigError("mesh.backend", "nccl", "nccl needs mesh.device_type=cuda; use gloo (or auto) on cpu")
    roles.check_strategy(cfg.parallel.dp_strategy)


def check_ranks_per_node(cfg: DictConfig) -> None:
    """Each node of a submitted job runs the same number of ranks (framework.launch.slurm)."""
    world, per_node, per_host = math.prod(cfg.mesh.shape), cfg.launcher.ranks_per_node, cfg.mesh.ranks_per_host
    if per_node is not None and (per_node < 1 or world % per_node):
        raise ConfigError("launcher.ranks_per_node", per_node,
                          f"must divide the mesh size {world} (mesh.shape={list(cfg.mesh.shape)}): each node runs "
                          f"the same number of ranks")
    if per_node is not None and per_host is not None and per_node != per_host:
        raise ConfigError("launcher.ranks_per_node", per_node,
                          f"differs from mesh.ranks_per_host={per_host}; both say how many ranks share a node: set one")


def check_threads(cfg: DictConfig) -> None:
    threads = cfg.launcher.threads_per_rank
    if threads is not None and threads < 1:
        raise ConfigError("launcher.threads_per_rank", threads,
                          "must be >= 1, or null for this host's cores shared out among its ranks")


# (stage, stage it must come after, why): the orders torch needs, named when a pipeline breaks them
STAGE_ORDER_REASONS = [
    ("tensor_parallel", "data_parallel",
     "DP is the outer wrapper and the TP plan applies to its .module (TP first leaves DTensors that DDP cannot "
     "broadcast)"),
    ("fully_shard", "tensor_parallel",
     "torch's fully_shard shards the DTensor parameters TP made (over the DP dims, on the same mesh); it cannot "
     "be handed to TP afterwards"),
]


def check_pipeline(cfg: DictConfig) -> None:
    stages = list(cfg.pipeline)
    if stages == STAGES[: len(stages)] and stages:
        return
    for later, earlier, why in STAGE_ORDER_REASONS:
        if later in stages and earlier in stages and stages.index(later) < stages.index(earlier):
            raise ConfigError("pipeline", stages,
                              f"{later} must come after {earlier}: {why}; use {STAGES} or a prefix of it")
    raise ConfigError("pipeline", stages, f"the stages run in the fixed order {STAGES}; give that list or a prefix of it")


def check_trainer_and_data(cfg: DictConfig) -> None:
    for key in ("max_steps", "log_every", "eval_batches"):
        if cfg.trainer[key] < 1:
            raise ConfigError(f"trainer.{key}", cfg.trainer[key], "must be >= 1")
    for key, what in (("trainer.seed", "the model's init and every draw of the run"), ("sampler.seed", "the data's order")):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(key, OmegaConf.select(cfg, key), f"must be an integer >= 0 (the seed of {what})")
    if cfg.trainer.check_replicas_every is not None and cfg.trainer.check_replicas_every < 1:
        raise ConfigError("trainer.check_replicas_every", cfg.trainer.check_replicas_every, "must be >= 1, or null")
    if cfg.trainer.eval_every is not None and cfg.trainer.eval_every < 1:
        raise ConfigError("trainer.eval_every", cfg.trainer.eval_every, "must be >= 1, or null for no evaluation")
    stall = cfg.trainer.stall_timeout_s
    if stall is not None and not 0 < stall < cfg.trainer.collective_timeout_s:
        raise ConfigError("trainer.stall_timeout_s", stall,
                          f"must be > 0 and below trainer.collective_timeout_s={cfg.trainer.collective_timeout_s} "
                          f"(else the collective timeout fires first, with no stacks), or null for no watchdog")
    if cfg.trainer.grad_clip is not None and cfg.trainer.grad_clip <= 0:
        raise ConfigError("trainer.grad_clip", cfg.trainer.grad_clip, "must be > 0, or null for no clipping")
    dp = MeshRoles.from_config(cfg).dp_size
    gbs = cfg.data.global_batch_size
    if gbs < 1 or gbs % dp:
        raise ConfigError("data.global_batch_size", gbs,
                          f"must be a positive multiple of the DP size {dp} (each replica takes global/DP)")
    micro = cfg.data.micro_batch_size
    if micro is not None and (micro < 1 or (gbs // dp) % micro):
        raise ConfigError("data.micro_batch_size", micro,
                          f"must divide the per-replica batch {gbs // dp} (data.global_batch_size={gbs} over DP size "
                          f"{dp}), or be null for no gradient accumulation")
    for key in ("model", "optim", "data.dataset", "objective"):
        if OmegaConf.select(cfg, key) is None or "_target_" not in OmegaConf.select(cfg, key):
            raise ConfigError(key, OmegaConf.select(cfg, key), "give a node with a _target_")


def check_model_and_plan(cfg: DictConfig) -> torch.nn.Module:
    """Build the model on the meta device (no memory) to check the plan against its modules,
    and the counts the plan splits whole (attention heads; the sequence, under SP); return it."""
    return check_model_plan(cfg, meta_model(cfg))


def meta_model(cfg: DictConfig) -> torch.nn.Module:
    """The configured model on the meta device (no memory); a Hugging Face model's files checked."""
    recompute = cfg.model.get("activation_checkpointing")
    if recompute is not None and not _accepts(get_object(cfg.model._target_), activation_checkpointing=recompute):
        raise ConfigError("model.activation_checkpointing", recompute,
                          f"{cfg.model._target_} has no blocks to recompute (it takes no activation_checkpointing); "
                          f"remove the key, or use a model that does, such as framework.models.Transformer")
    with torch.device("meta"), SkipRandomInit():
        model = instantiate_checked(cfg.model)
    if from_hugging_face(model):
        check_hf_model(model, cfg)
    return model


def check_model_plan(cfg: DictConfig, model: torch.nn.Module) -> torch.nn.Module:
    """The plan against the model's modules, and the counts it splits whole; the model returned."""
    if cfg.trainer.compile != "none":
        compiled_blocks(model)
    plan = OmegaConf.to_container(cfg.plan, resolve=True)
    tp = MeshRoles.from_config(cfg).tp_size
    check_plan(plan, model, tp)
    check_output_layout(plan, model, tp)
    if not plan or tp == 1:
        return model
    check_tied_layouts(plan, model)
    must_cover = offered(model).tp_plan_must_cover()
    for name, why in must_cover.items():
        if not any(name in matching_modules(model, pattern) for pattern in plan):
            raise ConfigError(f"plan.{name}", None, f"the plan has no entry for it: {why}")
    counts = dict(offered(model).tp_sharded_counts())
    if shards_sequence(plan):
        counts["data.dataset.seq_len"] = cfg.data.dataset.get("seq_len")
    for key, count in counts.items():
        if count is not None and count % tp:
            raise ConfigError(key, count, f"the TP plan splits it across {tp} ranks; make it a multiple of {tp} "
                                          f"or pick a TP size that divides it")
    return model


def check_tied_layouts(plan: dict, model: torch.nn.Module) -> None:
    """A tied output projection is the embedding matrix: TP must give both the same rows of it
    (rowwise embedding and colwise output both shard the vocabulary), or leave both whole."""
    declared = offered(model)
    embedding, output = declared.input_embeddings(), declared.output_layer()
    if not declared.tie_word_embeddings or embedding is None or output is None:  # (the loss reads the logits)
        return
    names = {module: name for name, module in model.named_modules()}
    embedding, output = names[embedding], names[output]
    styles = [next((entry.get("style") for pattern, entry in plan.items() if name in matching_modules(model, pattern)),
                   None) for name in (embedding, output)]
    if styles not in (["rowwise", "colwise"], [None, None]):
        raise ConfigError(f"plan.{output}", styles[1], f"the model ties its output to {embedding} ({styles[0]} here), "
                                                       f"so both must hold the same rows of the matrix: {embedding} "
                                                       f"rowwise and {output} colwise (as plan=lm_tp_sp), or neither "
                                                       f"in the plan")


def check_hf_model(model: torch.nn.Module, cfg: DictConfig) -> None:
    """A Hugging Face model's safetensors match its config.json, the token data's ids fit its
    vocabulary and the sequence its positions (framework.models.hf, as framework.generate checks)."""
    check_weights(model)
    dataset = cfg.data.dataset
    for node in source_nodes(dataset).values():
        tokenizer = tokenizer_of(node)
        if tokenizer is not None:
            check_vocab(model, tokenizer["vocab_size"], f"{tokenizer['path']}, which {tokenizer['source']} "
                                                        f"comes from")
    if dataset.get("seq_len") is not None:
        check_length(model, "data.dataset.seq_len", dataset.seq_len, opt_out=True)


def _accepts(callable_: Any, **options: Any) -> bool:
    try:
        inspect.signature(callable_).bind_partial(**options)
        return True
    except TypeError:
        return False


def check_optimizer(c: Checked) -> None:
    """The optimizer takes every option given (checked against its signature) and accepts their
    values (its own checks). Building one on a real parameter would import torch's compiler
    stack, seconds the launcher should not spend."""
    cfg = c.cfg
    options = {k: v for k, v in OmegaConf.to_container(cfg.optim, resolve=True).items() if not k.startswith("_")}
    optimizer = get_class(cfg.optim._target_)
    signature = inspect.signature(optimizer).parameters
    unknown = [] if any(p.kind is p.VAR_KEYWORD for p in signature.values()) else \
        [key for key in options if key not in signature]  # (say, a recipe's AdamW betas under optim=muon)
    if unknown:
        key = unknown[0]
        theirs = f" (its AdamW side's go under optim.adamw: optim.adamw.{key})" if "adamw" in signature else ""
        raise ConfigError(f"optim.{key}", options[key], f"{optimizer.__name__} takes no such option{theirs}; "
                                                        f"remove it: ~optim.{key} on the command line")
    try:
        inspect.signature(optimizer).bind(None, **options)  # None: the parameters, given later
    except TypeError as error:
        raise ConfigError("optim", options, f"{optimizer.__name__} cannot be built: {error}; fix or remove the "
                                            f"option (e.g. ~optim.KEY on the command line)") from None
    # a switch (fused, foreach, amsgrad, ...) the optimizer takes as any truthy value: yes, 0.5
    for key, value in options.items():
        switch = signature[key].annotation in (bool, Optional[bool], bool | None) if key in signature else False
        if switch and not isinstance(value, bool) and value is not None:
            raise ConfigError(f"optim.{key}", value, "must be true or false")
    error = _refusal(optimizer, options)
    if error is not None:
        # The option without which the optimizer accepts the rest is the one to name.
        key = next((k for k in options if _refusal(optimizer, {o: v for o, v in options.items() if o != k}) is None),
                   None)
        raise ConfigError(f"optim.{key}" if key else "optim", options[key] if key else options,
                          f"{optimizer.__name__} refuses it: {error}")


def _refusal(optimizer: type, options: dict) -> Optional[str]:
    """The optimizer's own checks of its options (a negative lr, say), run on an empty parameter
    list: they come before the parameters are looked at, and cost microseconds."""
    try:
        optimizer([], **options)
    except ValueError as error:
        return None if "empty parameter list" in str(error) else str(error)
    return None


def check_dataset(c: Checked) -> None:
    """Each split used fills at least one global batch (a stream's length is unknown)."""
    cfg = c.cfg
    splits = {"train": {}}
    if cfg.trainer.eval_every:
        if "split" not in inspect.signature(get_class(cfg.data.dataset._target_)).parameters:
            raise ConfigError("trainer.eval_every", cfg.trainer.eval_every,
                              f"{cfg.data.dataset._target_} has no `split` argument, so no held-out data; "
                              f"set trainer.eval_every=null or use a dataset with a val split")
        splits["val"] = {"split": "val"}
    for name, kwargs in splits.items():
        dataset = instantiate_checked(cfg.data.dataset, **kwargs)
        if isinstance(dataset, IterableDataset):  # a stream (its fields are checked as it opens): no length
            continue
        size = len(dataset)
        if size < cfg.data.global_batch_size:
            raise ConfigError("data.global_batch_size", cfg.data.global_batch_size,
                              f"the dataset's {name} split has only {size} samples; lower the batch or give "
                              f"more data")


def check_world_size(c: Checked) -> None:
    mesh_size = math.prod(c.cfg.mesh.shape)
    if c.world_size is not None and c.world_size != mesh_size:
        raise ConfigError("mesh.shape", list(c.cfg.mesh.shape),
                          f"its {mesh_size} positions differ from the launched world size {c.world_size}; "
                          f"launch {mesh_size} processes or pick a mesh of {c.world_size}")


def check_tp_placement(c: Checked) -> None:
    c.roles.check_tp_placement(c.ranks_per_host, c.cfg.parallel.enforce_tp_innermost,
                               c.cfg.parallel.allow_tp_across_hosts)


def check_loader_workers(c: Checked) -> None:
    check_loader(c.cfg, available_cores())


def build_meta_model(c: Checked) -> None:
    """The model on meta with the run's adapters, as the adapters stage adds them (the checks
    after it read it): the launcher's deep pass, which the ranks skip."""
    c.model = model = meta_model(c.cfg)
    check_transformers_model(c)  # (before the plan's checks, which name the native model's modules)
    if isinstance(model, TransformersModel):  # TP by the model's own plan, for every rank; on one TP rank
        c.cfg.plan = model.tp_plan() if c.roles.tp_size > 1 else {}  # none (a recipe's names native modules)
    check_model_plan(c.cfg, model)
    check_adapter(c.cfg, model)  # on the base model, before its adapters
    adapt(model, c.cfg.adapter, seed=0)


# Every check, in order, each `check(c: Checked)` raising one ConfigError. Each capability's
# checks live in a light module beside its code (none imports DTensor, FSDP, pipelining or DCP).
# Those before build_meta_model read the config alone and run in every rank too; from it on the
# launcher's deep pass builds the meta model (and the dataset, the optimizer). Checks read and
# change nothing, so their order only decides which of two refusals shows.
CHECKS: Tuple[Callable[[Checked], None], ...] = (
    reads_config(check_pipeline),          # (here) the stages' order
    reads_config(check_mesh),              # (here) dims, roles, backend
    check_world_size,                      # (here) the mesh against a launched world
    check_not_yet,                         # framework.not_yet: the pairs that do not compose yet
    reads_config(check_ranks_per_node),    # (here) a submitted job's nodes
    reads_config(check_threads),           # (here) threads per rank
    reads_config(check_fault_tolerance),   # framework.parallel.fault_tolerance_config: torchft, the lighthouse
    check_tp_placement,                    # framework.parallel.roles: TP innermost, inside a host
    check_devices,                         # framework.parallel.device: a GPU per rank on this host
    reads_config(check_targets),           # framework.config.trust: every _target_ allowed
    reads_config(check_trainer_and_data),  # (here) steps, seeds, batch sizes
    reads_config(check_model_path),        # framework.models.hf: model.path (before data.tokenizer reads it)
    reads_config(check_token_data),        # framework.data.checks: tokens, tokenizer, vocabulary
    check_loader_workers,                  # framework.data.loader: worker processes for this host's cores
    reads_config(check_checkpoint_keys),   # framework.checkpoint.compat: every, keep_last, ...
    reads_config(check_loggers),           # framework.training.logger: packages, W&B's mode, MLflow's server
    build_meta_model,                      # (here) the deep pass: the model on meta, its plan, its adapters
    check_pipeline_parallel,     # framework.parallel.pipeline_layout: the split, the schedule
    check_expert_parallel,       # framework.parallel.expert_parallel_checks: experts, EP dims, the plan
    check_adapter_init_from,     # framework.models.lora: a PEFT adapter to start from
    check_qlora,                 # framework.models.nf4: NF4 blocks, torchao
    check_float8,                # framework.models.float8: the recipe, torchao, an sm_89+ GPU
    check_context_parallel,      # framework.parallel.context_parallel_checks: the chunks, the model's attention
    check_document_masking,      # framework.data.checks: packed data, positions
    check_vision,                # framework.models.vision: image data, a VLM, its objective and mesh
    check_objective,             # framework.training.objectives: auxiliary terms
    check_preference,            # framework.training.objectives.preference: pairs, DPO's reference
    check_unpaired,              # framework.training.objectives.preference: unpaired examples, KTO's reference
    check_grpo,                  # framework.training.objectives.grpo: prompts, GRPO's keys, room for completions
    check_environment,           # framework.training.objectives.environments: GRPO's turns, a user's class
    check_reward,                # framework.training.objectives.rewards: the reward and a user's file
    check_objective_options,     # framework.training.objectives: objective.KEY is an option (after the pairings above)
    check_optimizer,             # (here) the optimizer's options
    check_muon,                  # framework.training.muon: optim=muon's split of the model
    check_dataset,               # (here) a global batch per split
    check_responses,             # framework.data.checks: instruction data keeps a response
    check_checkpoint_sources,    # framework.checkpoint.compat: the checkpoint the run starts from
    check_checkpoint_writable,   # framework.checkpoint.compat: where the run saves
    check_reference_on_resume,   # framework.training.objectives.reference: DPO's stored reference on resume
    check_final_hf,              # framework.models.hf: checkpoint.final_hf's model and directory
)


def checked_config(cfg: DictConfig, model: Optional[torch.nn.Module] = None, out_dir: Optional[str] = None,
                   **launch: Any) -> Checked:
    """What the checks read: the config, its mesh roles, validation's meta model, (with the
    job's dir) where its checkpoints go, and what the launcher knows (world size, ranks per host)."""
    return Checked(cfg, MeshRoles.from_config(cfg), model, out_dir,
                   checkpoint_dir(cfg, out_dir) if out_dir is not None else None, **launch)


def validate(cfg: DictConfig, world_size: Optional[int] = None, ranks_per_host: Optional[int] = None,
             deep: bool = True, out_dir: Optional[str] = None, devices_here: bool = True) -> None:
    """Every check of CHECKS. `world_size` is the world a launcher joined (torchrun); `deep` also
    builds the model on meta and the dataset, which the launcher does once and the ranks skip;
    with the job's `out_dir`, also the checkpoint the run would start from; without
    `devices_here` (the dry run, which simulates the ranks on this CPU) not this host's GPUs."""
    check_known_keys(cfg)  # before anything reads a key
    per_host = cfg.mesh.ranks_per_host or cfg.launcher.ranks_per_node or ranks_per_host or math.prod(cfg.mesh.shape)
    settle_device(cfg, per_host)  # mesh.device_type=auto: cuda or cpu from here on, for the ranks too
    checked = checked_config(cfg, out_dir=out_dir, world_size=world_size, ranks_per_host=per_host,
                             devices_here=devices_here)
    for check in CHECKS:
        if check is build_meta_model and not deep:
            return
        check(checked)
