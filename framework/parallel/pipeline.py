"""Pipeline parallelism over the mesh's `pp` dim (parallel.pp_dim), with torch.distributed.pipelining.

The model's blocks are split into pp x parallel.pp_stages_per_rank stages (the embedding with the
first, the final norm and output with the last). `split_model` keeps, on each rank, the model
itself with only its own stages' modules (the others deleted, as torchtitan does), so parameter
names stay the whole model's: checkpoints do not depend on the PP size. Each of the rank's stages
is a `StageModule` over those modules; DP, TP and FSDP then apply as without PP (FSDP2 roots are
the stage modules). `Pipeline` runs a schedule (parallel.pp_schedule) over
parallel.pp_microbatches micro-batches of each replica's batch: the loss is computed on the last
stage, gradients are scaled to the batch mean by the schedule, and DataParallel's gradients are
synced once after the schedule.
"""
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from framework.data.batch import Batch
from framework.models.protocol import ModelProtocol, offered
from framework.parallel.pipeline_layout import SCHEDULES, layers_per_stage, stage_indices


class StageModule(ModelProtocol, nn.Module):
    """One pipeline stage: the embedding (first stage), a run of the model's blocks, the final
    norm and output (last stage). It holds the model's own modules, so parameters keep their
    names in the model (checkpoints); a stage's own FQNs are for the schedule alone. FSDP2 takes
    it as a root: its protocol offers its own blocks and experts."""

    def __init__(self, model: nn.Module, layer_keys: List[str], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({key: model.layers[key] for key in layer_keys})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.run_blocks, self.prepare_rotation = model.run_blocks, model.prepare_rotation
        self.attention_layout = model.attention_layout
        declared = offered(model)
        self.model_experts, self.model_uncounted_forwards = declared.expert_modules, declared.uncounted_forwards

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: tokens (first stage) or the previous stage's hidden states; `positions`: the
        micro-batch's, which the schedule hands every stage (document masking)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        h = self.run_blocks(self.layers.values(), h, self.attention_layout(positions, h))
        return self.output(self.norm(h)) if self.output is not None else h

    def fsdp_units(self) -> List[nn.Module]:
        return list(self.layers.values())

    def expert_modules(self) -> List[nn.Module]:
        """The model's experts in this stage's blocks."""
        held = set(self.modules())
        return [experts for experts in self.model_experts() if experts in held]

    def uncounted_forwards(self) -> ContextManager[None]:
        return self.model_uncounted_forwards()


def gathered_over_stages(values: Dict[str, float], pp_group) -> Dict[str, float]:
    """Every stage's named values in one dict on every rank (each stage holds other layers; rank
    0 logs them all)."""
    parts: List[Optional[Dict[str, float]]] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, values, group=pp_group)
    return {name: value for part in parts for name, value in part.items()}


def split_model(model: nn.Module, pp_rank: int, pp_size: int, per_rank: int, schedule: str,
                given: Optional[List[int]]) -> List[Tuple[int, StageModule]]:
    """Delete from `model` what this rank's stages do not run; return (stage index, StageModule)
    for each of them, in the order the rank runs them."""
    n_stages = pp_size * per_rank
    counts = layers_per_stage(len(model.layers), n_stages, given)
    starts = [sum(counts[:i]) for i in range(n_stages)]
    mine = stage_indices(pp_rank, pp_size, per_rank, schedule)
    keys = {s: [str(i) for i in range(starts[s], starts[s] + counts[s])] for s in mine}
    model.layers = nn.ModuleDict({k: model.layers[int(k)] for s in sorted(mine) for k in keys[s]})
    stages = [(s, StageModule(model, keys[s], s == 0, s == n_stages - 1)) for s in mine]
    for name, owned in (("tok_embeddings", 0 in mine), ("norm", n_stages - 1 in mine), ("output", n_stages - 1 in mine)):
        if not owned:
            setattr(model, name, None)
    return stages


def routing_stage_class():
    """torch's PipelineStage, but its first step's shape inference (one forward of each stage,
    on the first micro-batch or on uninitialized tensors, that trains nothing) is among the
    model's uncounted_forwards: the expert biases move by the load of the step's micro-batches."""
    if not hasattr(PipelineStage, "_forward_metadata_inference"):  # (torch 2.13's; fail loudly if it moves)
        raise RuntimeError("torch.distributed.pipelining.PipelineStage has no _forward_metadata_inference: this "
                           "torch infers stage shapes otherwise; framework/parallel/pipeline.py needs updating")

    class RoutingStage(PipelineStage):
        def _forward_metadata_inference(self, *args, **kwargs):
            with offered(self.submod).uncounted_forwards():
                return super()._forward_metadata_inference(*args, **kwargs)

    return RoutingStage


class Pipeline:
    """This rank's stages under the configured schedule. `step` is forward and backward of one
    replica batch (returning its loss on the last stage's ranks, zero elsewhere); `evaluate`
    forward only."""

    def __init__(self, stages: List[Tuple[int, nn.Module]], n_stages: int, pp_group, schedule: str, microbatches: int,
                 loss_fn, device: torch.device, make_stage: Optional[Callable] = None):
        """loss_fn(outputs, targets): a micro-batch's share of the step's loss, so the schedule does
        not rescale the gradients. make_stage(module, index, n_stages, device, group): torch's
        PipelineStage unless given (the dry run's give their tensor shapes, which the fake process
        group cannot exchange)."""
        self.n_stages, self.device = n_stages, device
        self.prepare_rotation = stages[0][1].prepare_rotation
        make_stage = make_stage or routing_stage_class()
        self.stages = [make_stage(module, index, n_stages, device, group=pp_group) for index, module in stages]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        schedule_class = getattr(pipelining, SCHEDULES[schedule][0])
        one = SCHEDULES[schedule][1] == "1"
        self.schedule = schedule_class(self.stages[0] if one else self.stages, n_microbatches=microbatches,
                                       loss_fn=loss_fn, scale_grads=False)

    def _run(self, method, batch: Batch) -> torch.Tensor:
        losses: List[torch.Tensor] = []
        # every rank has the step's tokens, so every stage's blocks read the rotation table (a
        # stage after the first sees only hidden states, under SP a slice of the sequence); the
        # schedule splits the model's keyword inputs into micro-batches for every stage
        self.prepare_rotation(batch.inputs)
        args = (batch.inputs,) if self.first else ()
        method(*args, target=batch.targets if self.last else None, losses=losses if self.last else None,
               **batch.model_inputs())
        # only the last stage has the losses (framework.training.trainer.mean_over_dp shares them)
        return (torch.stack([loss.detach().float() for loss in losses]).sum() if self.last
                else torch.zeros((), device=self.device))

    def step(self, batch: Batch) -> torch.Tensor:
        """The sum of the micro-batches' losses as the loss function returned them."""
        return self._run(self.schedule.step, batch)

    def evaluate(self, batch: Batch) -> torch.Tensor:
        return self._run(self.schedule.eval, batch)
