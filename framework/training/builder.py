"""The run, built stage by stage in the fixed order of framework.config.schema.STAGES.

Each stage reads the config and what earlier stages built, and adds one thing to `Run`.
`cfg.pipeline` may stop early (a prefix of STAGES, e.g. the seed_mesh recipe stops after
`mesh`); any other order was refused by framework.validate before launch.
"""
import logging
import os
from datetime import timedelta
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset

from framework.checkpoint.base_model import base_model
from framework.checkpoint.compat import checkpoint_dir
from framework.checkpoint.manager import Checkpointer
from framework.config.schema import STAGES
from framework.data.loader import StreamEpochs, build_dataloader, build_sampler
from framework.checkpoint.weights import base_checkpoint, load_base, restart_count, starting_point, stream_hf_weights
from framework.models.float8 import apply_float8, float8_recipe
from framework.models.lifecycle import adapt, allocate, born_on_meta, new_model, on_meta
from framework.models.lora import init_adapters, load_peft_adapter
from framework.models.nf4 import nf4_of_adapted, quantize_base
from framework.parallel.device import settle_device
from framework.parallel.mesh import build_mesh, coordinates_on, layout_table
from framework.parallel.pipeline import split_model
from framework.parallel.pipeline_layout import last_stage_rank
from framework.parallel.data_parallel import apply_dp
from framework.parallel.dtensors import by_mesh
from framework.parallel.fully_shard import FullyShardedSync, apply_fsdp
from framework.parallel.context_parallel import SequenceChunks, apply_cp
from framework.parallel.expert_parallel import ExpertGradients, apply_ep, update_biases_after_each_step
from framework.parallel.fault_tolerance import build_fault_tolerance
from framework.parallel.fault_tolerance_config import spread_over_groups
from framework.parallel.tensor_parallel import apply_tp
from framework.training.schedule import build_scheduler
from framework.training.state import TrainState
from framework.training.trainer import Trainer
from framework.training.compile import apply_compile
from framework.training.run import Run
from framework.training.objectives.context import Group, ObjectiveContext
from framework.training.objectives.head import output_head
from framework.models.protocol import offered
from framework.models.transformers_model import TransformersModel
from framework.models.vision import parts_line

log = logging.getLogger("framework")


def backend_for(run: Run) -> str:
    """mesh.backend as named, else the device's (a cuda run keeps gloo for CPU tensors)."""
    if run.cfg.mesh.backend != "auto":
        return str(run.cfg.mesh.backend)
    return f"cpu:gloo,cuda:{run.device.backend}" if run.device.type == "cuda" else run.device.backend


def _store_of_this_attempt(timeout: timedelta) -> Optional[dist.Store]:
    """torch 2.13's elastic agent keeps one TCPStore for all restarts of a job, and its ranks
    join it without a per-attempt prefix (though torch.distributed.rendezvous assumes a new
    store per retry), so a restarted world reads the dead ranks' gloo addresses and fails to
    connect. Key this attempt's process group under its restart count instead. None: not a
    restarted agent-store world; the default env:// rendezvous is right."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timeout)
    return dist.PrefixStore(f"framework/attempt_{attempt}", agent_store)


def stage_distributed(run: Run) -> None:
    if not dist.is_initialized():
        timeout = timedelta(seconds=run.cfg.trainer.collective_timeout_s)
        store = _store_of_this_attempt(timeout)
        if store is None:
            dist.init_process_group(backend=backend_for(run), timeout=timeout)
        else:
            dist.init_process_group(backend=backend_for(run), timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    run.rank = dist.get_rank()
    if run.device.type == "cuda":
        torch.cuda.set_device(dist.get_node_local_rank())


def stage_mesh(run: Run) -> None:
    cfg = run.cfg
    run.mesh = build_mesh(run.device.type, cfg.mesh.shape, cfg.mesh.dim_names)
    run.dp_cp_mesh = run.roles.dp_cp_mesh(run.mesh)
    run.dp_cp = coordinates_on(run.dp_cp_mesh)
    run.samples = spread_over_groups(coordinates_on(run.roles.dp_mesh(run.mesh)))  # (and over replica groups)
    run.tp = coordinates_on(run.roles.tp_mesh(run.mesh))
    if run.rank == 0:
        log.info("%s\n%s", run.device.line(), layout_table(cfg.mesh.shape, cfg.mesh.dim_names, run.roles.spans()))


def stage_model(run: Run) -> None:
    """On the meta device, a model that draws its own weights (the framework's Transformer) and
    a Hugging Face one: their storage and weights come in the weights stage, once the parallel
    stages sharded them, so no rank holds the model whole. Any other module is built whole and
    seeded, the same on every rank (DataParallel also broadcasts it). The dry run's stays on meta."""
    device = "meta" if run.meta_only or born_on_meta(run.cfg.model) else run.device.type
    run.model = new_model(run.cfg.model, device, run.cfg.trainer.seed)


def stage_adapters(run: Run) -> None:
    """adapter=lora: LoRA adapters on the targeted layers, every base parameter frozen, before
    any parallel stage (they shard and sync the adapters as any parameter). adapter=qlora: the
    adapted layers' weights then quantized to NF4 (framework.models.nf4), which is made from
    the weights: a Hugging Face model's are read here one parameter at a time, each adapted
    weight quantized before the next is read (never the whole base in the files' precision)."""
    a, cfg = run.cfg.adapter, run.cfg
    adapt(run.module, a, cfg.trainer.seed)
    if a.kind != "qlora":
        return
    hf_path = offered(run.module).hf_path
    if hf_path and on_meta(run.module) and not run.meta_only:
        stream_hf_weights(run.module, hf_path, run.device.type, nf4_of_adapted(run.module, a.block_size,
                                                                                 a.scaler_block_size))
        init_adapters(run.module, cfg.trainer.seed)
        return
    if on_meta(run.module) and not run.meta_only:  # the framework's own model: the seed's weights drawn whole
        allocate(run.module, run.device.type, cfg.trainer.seed)
    quantize_base(run.module, a.block_size, a.scaler_block_size)


def stage_float8(run: Run) -> None:
    """float8: the linear layers as torchao's Float8Linear (framework.models.float8),
    before any parallel stage shards, compiles or wraps them (torchtitan's order). Under
    FSDP2 a tensorwise layer's weight is all-gathered in float8."""
    recipe = float8_recipe(run.cfg)
    if recipe:
        apply_float8(run.module, recipe, fsdp_all_gather=run.cfg.parallel.dp_strategy != "replicate")


def stage_pipeline_parallel(run: Run) -> None:
    """With a pp dim: keep this rank's pipeline stages of the model (the others' modules
    deleted, names unchanged), as StageModules the parallel stages after this one apply to."""
    pp_mesh = run.roles.pp_mesh(run.mesh)
    if pp_mesh is None:
        return
    p = run.cfg.parallel
    run.pp = {**coordinates_on(pp_mesh), "last": last_stage_rank(pp_mesh.size(), p.pp_stages_per_rank, p.pp_schedule)}
    run.stages = split_model(run.model, run.pp["rank"], run.pp["size"], p.pp_stages_per_rank, p.pp_schedule,
                             p.pp_layers_per_stage)


def stage_data_parallel(run: Run) -> None:
    """replicate: the outer DataParallel wrapper, before TP shards its .module; its gradients
    averaged over the DP group, or over torchft's replica groups (launcher.fault_tolerance)."""
    if run.cfg.parallel.dp_strategy == "replicate":
        run.fault_tolerance = build_fault_tolerance(run.cfg)
        experts = ExpertGradients(run.dp_cp_group, run.dp_cp["size"], run.roles.expert_replica_mesh(run.mesh))
        run.model = run.gradient_sync = apply_dp(run.model, run.dp_cp_mesh, run.cfg.parallel.overlap_dp_sync, experts,
                                                 run.fault_tolerance.gradients_across(), run.device.type)


def stage_tensor_parallel(run: Run) -> None:
    tp_mesh = run.roles.tp_mesh(run.mesh)
    if tp_mesh is not None:
        plan = OmegaConf.to_container(run.cfg.plan, resolve=True)
        run.module = apply_tp(run.module, tp_mesh, plan)
        offered(run.module).tie_weights()


def stage_expert_parallel(run: Run) -> None:
    """A mixture of experts: its experts over parallel.ep_dims, its routing pooled over DP."""
    roles = run.roles
    apply_ep(run.module, roles.ep_mesh(run.mesh), run.dp_cp_group, roles.tp_mesh(run.mesh) if roles.ep_spans_tp else None)


def stage_context_parallel(run: Run) -> None:
    """With a cp dim: attention gathers the keys and values of every CP rank's chunks."""
    apply_cp(run.module, run.roles.cp_mesh(run.mesh))


def stage_compile(run: Run) -> None:
    """trainer.compile's blocks, after TP and before FSDP2 (torchtitan's order)."""
    apply_compile(run.module, run.cfg.trainer.compile)


def stage_fully_shard(run: Run) -> None:
    """fsdp / hsdp: FSDP2 over the DP ranks, after TP (hsdp: the 2-D (dp_replicate, dp) mesh)."""
    strategy = run.cfg.parallel.dp_strategy
    if strategy != "replicate":
        mesh, precision = run.roles.sharding_mesh(run.mesh, strategy), run.cfg.trainer.mixed_precision
        shard = dict(dp_group=run.dp_cp_group, expert_replicas=run.roles.expert_replica_mesh(run.mesh))
        if run.stages:  # each pipeline stage is a root, as each model part is in torchtitan
            run.stages = [(index, apply_fsdp(module, mesh, precision, **shard)) for index, module in run.stages]
        else:
            run.model = apply_fsdp(run.model, mesh, precision, **shard)
            run.gradient_sync = FullyShardedSync(run.model)


def stage_weights(run: Run) -> None:
    """The weights the model starts from, where framework.checkpoint.weights says: a model still
    on meta gets its (sharded) storage; then checkpoint.init_from's weights, the Hugging Face
    files' or the seed's (drawn in the model stage), and adapter.init_from's PEFT adapters;
    none of them read when the run resumes a checkpoint that holds them all. QLoRA's base was
    read before it was quantized (stage_adapters). The dry run's model has no weights."""
    cfg = run.cfg
    if run.meta_only:
        return
    directory = checkpoint_dir(cfg, run.out_dir)
    run.start = starting_point(cfg, directory, run.rank)
    allocate(run.module, run.device.type, cfg.trainer.seed)
    if run.start.replaces_base():
        return
    # (a resume that does not replace the base holds adapters alone: their base first)
    init_from = run.start.path if run.start.kind == "init" else base_checkpoint(cfg, directory)
    model = offered(run.module)
    message = load_base(run.module, init_from, None if cfg.adapter.kind == "qlora" else model.hf_path)
    if isinstance(model, TransformersModel):  # (and why: model.backend=auto falls back to them)
        message += f" into transformers' {type(model.causal).__name__} ({model.chosen_because})"
        if model.vision:  # what trains of a vision-language model
            message += f"; parameters: {parts_line(model.part_sizes, model.frozen)}"
    if cfg.checkpoint.resume and run.start.kind == "fresh":
        message += f" (no checkpoint to resume in {directory})"
    peft = cfg.adapter.get("init_from")
    if peft and run.start.kind != "resume":  # (a resumed run's adapters are its checkpoint's)
        load_peft_adapter(run.module, peft)
        message += f"; LoRA adapters from the PEFT adapter in {peft}"
    if run.start.kind != "resume":
        say(run, message)


def dataset_of(run: Run, **split) -> Dataset:
    """The configured dataset; with a cp dim each sample cut to this rank's chunks."""
    dataset = instantiate(run.cfg.data.dataset, **split)
    cp_mesh = run.roles.cp_mesh(run.mesh)
    return dataset if cp_mesh is None else SequenceChunks(dataset, cp_mesh.get_local_rank(), cp_mesh.size())


def stage_sampler(run: Run) -> None:
    """Over the DP replicas alone: the CP ranks of a replica read the same samples."""
    s = run.cfg.sampler
    run.dataset = dataset_of(run)
    run.sampler = build_sampler(run.dataset, run.samples["size"], run.samples["rank"], s.shuffle, s.seed, s.drop_last)


def stage_dataloader(run: Run) -> None:
    """The training loader, and with trainer.eval_every one over the dataset's `val` split
    (in order, split across DP replicas the same way)."""
    replicas = run.samples["size"]
    per_replica = run.cfg.data.global_batch_size // replicas
    run.dataloader = build_dataloader(run.dataset, run.sampler, per_replica, run.cfg.data.num_workers)
    if run.cfg.trainer.eval_every:
        val = dataset_of(run, split="val")
        val_sampler = build_sampler(val, replicas, run.samples["rank"], shuffle=False, seed=0, drop_last=True)
        run.val_dataloader = build_dataloader(val, val_sampler, per_replica, run.cfg.data.num_workers)


def stage_optimizer(run: Run) -> None:
    """What a step needs besides data: the optimizer, built over the parameters as they are
    after DP and TP (DTensor shards included; a group for each mesh's, one for plain tensors,
    so a fused or foreach optimizer's kernels each take one kind), its warmup / decay schedule, and the objective."""
    t = run.cfg.trainer
    run.objective = instantiate(run.cfg.objective)
    factory = instantiate(run.cfg.optim)
    if hasattr(factory.func, "groups_of"):  # an optimizer that splits the model by role (optim=muon)
        groups, split = factory.func.groups_of(run.module, **factory.keywords)
        say(run, split)
    else:
        kinds = by_mesh(p for p in run.model.parameters() if p.requires_grad)
        groups = kinds[0] if len(kinds) == 1 else [{"params": k} for k in kinds]
    optimizer = factory(groups)
    update_biases_after_each_step(optimizer, run.module)
    run.optimizer, run.scheduler = optimizer, build_scheduler(optimizer, t.warmup_steps, t.max_steps, t.lr_decay)


def stage_checkpoint(run: Run) -> None:
    """Before the first step: continue the checkpoint the weights stage chose (model, optimizer,
    schedule, data position, history; after an elastic restart, the newest one). A LoRA run's
    checkpoints hold its adapters alone, over the base the weights stage loaded. Then the
    objective's setup, on the final weights."""
    run.state = TrainState()
    base = base_model(run.cfg, checkpoint_dir(run.cfg, run.out_dir), offered(run.module).hf_path) \
        if run.cfg.adapter.kind != "none" else None
    stream = run.dataloader if isinstance(run.sampler, StreamEpochs) else None
    run.checkpointer = Checkpointer(run.cfg, run.out_dir, run.rank, run.module, run.optimizer, run.scheduler,
                                    run.state, base, stream)
    run.checkpointer.remove_partial()
    if run.start.kind == "resume":
        run.resumed = run.checkpointer.load(run.start.path)
        say(run, f"resumed from {run.start.path} (step {run.resumed.step})")


def stage_objective(run: Run) -> None:
    """The objective's own stage, the weights final: what it derives from them (DPO's reference
    log-probabilities, GRPO's decoder), from an ObjectiveContext, never the run; the frozen
    reference model objective.reference=frozen_copy asks for is built here, by the model's stages."""
    reference = frozen_copy(run) if run.objective.wants_frozen_copy else None
    run.objective.setup(objective_context(run, reference))


def objective_context(run: Run, reference_model: Optional[nn.Module] = None) -> ObjectiveContext:
    """What the objective may know of the built run (framework.training.objectives.context)."""
    cfg, tp = run.cfg, run.tp.get("size", 1)
    return ObjectiveContext(
        cfg=cfg, device=run.device, module=run.module, model=run.model,
        head=output_head(run.module, cfg.trainer.get("loss_chunk_tokens"), run.device.type, tp, run.pp.get("size", 1)),
        dataset=run.dataset, val_dataset=run.val_dataloader.dataset if run.val_dataloader is not None else None,
        replicas=Group(run.dp_cp.get("size", 1), run.dp_cp.get("rank", 0), run.dp_cp_group),
        samples=Group(run.samples.get("size", 1), run.samples.get("rank", 0)),
        tp=Group(tp, run.tp.get("rank", 0), run.roles.tp_mesh(run.mesh).get_group() if tp > 1 else None),
        reference_model=reference_model, out_dir=run.out_dir, rank=run.rank, resumed=run.resumed is not None)


def frozen_copy(run: Run) -> nn.Module:
    """A second model from the policy's base (the seed, the Hugging Face files or
    checkpoint.init_from's weights, never a resumed policy's), through the same model and
    parallel stages (its TP plan, fsdp / hsdp), without adapters, frozen in eval mode: the module
    the loop would call."""
    cfg = OmegaConf.merge(run.cfg, {"adapter": {"kind": "none", "init_from": None}})
    copy = Run(cfg=cfg, out_dir=run.out_dir, rank=run.rank, mesh=run.mesh, dp_cp_mesh=run.dp_cp_mesh, dp_cp=run.dp_cp,
               samples=run.samples, tp=run.tp)
    build_and_run(cfg, run.out_dir, start="model", through="fully_shard", run=copy)
    allocate(copy.module, copy.device.type, cfg.trainer.seed)
    load_base(copy.module, base_checkpoint(cfg, checkpoint_dir(cfg, run.out_dir)), offered(copy.module).hf_path)
    for param in copy.module.parameters():
        param.requires_grad_(False)
    return copy.module.eval()


def say(run: Run, message: str) -> None:
    """Where the weights came from, on rank 0, after an elastic restart with its count."""
    if run.rank == 0:
        restarts = restart_count()
        log.info("%s%s", f"restart {restarts} of {os.environ['TORCHELASTIC_MAX_RESTARTS']}: " if restarts else "",
                 message)


def stage_trainer(run: Run) -> None:
    try:
        run.summary = Trainer(run).train()
    finally:
        run.fault_tolerance.close()


STAGE_FUNCTIONS: Dict[str, Callable[[Run], None]] = {
    "distributed": stage_distributed,
    "mesh": stage_mesh,
    "model": stage_model,
    "adapters": stage_adapters,
    "float8": stage_float8,
    "pipeline_parallel": stage_pipeline_parallel,
    "data_parallel": stage_data_parallel,
    "tensor_parallel": stage_tensor_parallel,
    "expert_parallel": stage_expert_parallel,
    "context_parallel": stage_context_parallel,
    "compile": stage_compile,
    "fully_shard": stage_fully_shard,
    "weights": stage_weights,
    "sampler": stage_sampler,
    "dataloader": stage_dataloader,
    "optimizer": stage_optimizer,
    "checkpoint": stage_checkpoint,
    "objective": stage_objective,
    "trainer": stage_trainer,
}
assert list(STAGE_FUNCTIONS) == STAGES


def build_and_run(cfg: DictConfig, out_dir: str, through: Optional[str] = None, start: Optional[str] = None,
                  run: Optional[Run] = None) -> Run:
    """Run cfg.pipeline's stages in order (framework.train), or the stages up to and including
    `through` whatever the pipeline (the commands that build a run without training it: verify,
    inspect, dryrun), from `start` on. `run` may come with what the skipped stages would have
    set (verify's one-process reference has no process group or mesh; the dry run's model stays
    on meta)."""
    run = run or Run(cfg=cfg, out_dir=out_dir)
    run.device = settle_device(cfg)  # (the launcher's, or, for a config none settled, this host's ranks')
    names = list(cfg.pipeline) if through is None else STAGES[: STAGES.index(through) + 1]
    for name in names[names.index(start) if start else 0:]:
        STAGE_FUNCTIONS[name](run)
    return run
