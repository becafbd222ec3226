"""The training loop: step (gradients finalize inside backward), clip, schedule, evaluate, save;
what it measures and reports is framework.training.metrics.

Losses stay on their ranks until a logging step; then one all-reduce over the DP group turns
the pending per-replica losses into global-batch losses (TP ranks already agree), so the hot
path has no extra collective.
"""
import logging
import math
import time
from contextlib import nullcontext
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from framework.data.loader import DataPosition, batches
from framework.parallel.data_parallel import DataParallel
from framework.parallel.fully_shard import no_gradient_sync
from framework.parallel.grad_norm import clip_grad_norm, global_grad_norm
from framework.parallel.replica_check import check_replicas
from framework.training.metrics import Metrics
from framework.training.run import Run
from framework.training.watchdog import StallWatchdog

log = logging.getLogger("framework")

def lr_multiplier(step: int, warmup_steps: int, max_steps: int, decay: str) -> float:
    """For 0-based step `step`: linear warmup over warmup_steps, then constant, or cosine decay
    reaching 10% on the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = (step + 1 - warmup_steps) / max(1, max_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def compute_loss(run: Run, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward and loss, under autocast with trainer.mixed_precision=bf16 (fp32 master weights:
    autocast casts per op, and its fp32 ops, the loss among them, stay fp32); logits the plan
    leaves sharded on the vocabulary (output_layouts shard(-1), use_local_output false) get
    torch's loss_parallel instead of a gather."""
    # fsdp / hsdp: FSDP2's MixedPrecisionPolicy casts instead (framework.parallel.fully_shard)
    bf16 = run.cfg.trainer.mixed_precision == "bf16" and run.cfg.parallel.dp_strategy == "replicate"
    with torch.autocast(run.cfg.mesh.device_type, dtype=torch.bfloat16) if bf16 else nullcontext():
        logits = run.model(inputs)
        sharded = isinstance(logits, DTensor) and logits.placements[0].is_shard(logits.ndim - 1)
        with loss_parallel() if sharded else nullcontext():
            return run.loss_fn(logits, targets)


def forward_backward(run: Run, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Zero the gradients, then forward, loss and backward (gradients come out final): the part
    of a step the training loop and the comm audit share; clipping and the optimizer step follow.
    With data.micro_batch_size, per micro-batch: each loss is weighted by its share of the batch
    so the gradients add up to the whole batch's, and DataParallel finalizes them (TP partials,
    DP average) once, after the last. Returns the replica batch's loss."""
    run.optimizer.zero_grad(set_to_none=True)
    chunks = list(zip(inputs.split(run.cfg.data.micro_batch_size or len(inputs)),
                      targets.split(run.cfg.data.micro_batch_size or len(targets))))
    total = None
    for i, (micro_inputs, micro_targets) in enumerate(chunks):
        loss = compute_loss(run, micro_inputs, micro_targets)
        if len(chunks) > 1:
            loss = loss * (len(micro_inputs) / len(inputs))
        with nullcontext() if i == len(chunks) - 1 else paused_gradient_sync(run.model):
            with loss_parallel() if isinstance(loss, DTensor) else nullcontext():
                loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def paused_gradient_sync(model):
    """Micro-batches before the last add up their gradients without syncing them over DP."""
    return model.no_sync() if isinstance(model, DataParallel) else no_gradient_sync(model)


def local_value(loss: torch.Tensor) -> torch.Tensor:
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()


def mean_over_dp(run: Run, values: List[torch.Tensor]) -> List[float]:
    """Mean over DP replicas of each per-replica value: the global-batch value."""
    stacked = torch.stack(values)
    if run.dp["size"] > 1:
        dist.all_reduce(stacked, group=run.dp_group)
        stacked /= run.dp["size"]
    return stacked.cpu().tolist()


@torch.no_grad()
def evaluate(run: Run, device: torch.device) -> float:
    """Mean loss over trainer.eval_batches batches of the held-out split, over all replicas."""
    run.model.eval()
    data = iter(run.val_dataloader)
    losses = [local_value(compute_loss(run, *(t.to(device) for t in next(data))))
              for _ in range(min(run.cfg.trainer.eval_batches, len(run.val_dataloader)))]
    run.model.train()
    return sum(mean_over_dp(run, losses)) / len(losses)


def train_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, measure_norm: bool,
               on_gradients: Callable[[], None] = lambda: None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One optimizer step, the one the loop and verify share: forward and backward
    (forward_backward), `on_gradients` (verify reads them before clipping spreads one wrong
    gradient over all), trainer.grad_clip's clipping (or, when `measure_norm`, the global
    gradient norm alone), the optimizer and the LR schedule. Returns the replica batch's loss
    and the norm (None when neither was asked for)."""
    loss = forward_backward(run, inputs, targets)
    on_gradients()
    clip = run.cfg.trainer.grad_clip
    if clip is not None:
        norm = clip_grad_norm(run.model.parameters(), clip)
    else:
        norm = global_grad_norm(run.model.parameters()) if measure_norm else None
    run.optimizer.step()
    run.scheduler.step()
    return loss, norm


def new_history() -> dict:
    return {"losses": [], "grad_norms": [], "val_losses": [], "step_times_s": [], "checkpoints": []}


def train(run: Run) -> Optional[dict]:
    """Steps from the first one not yet done (step 1, or the one after a resumed checkpoint) to
    trainer.max_steps, saving a checkpoint where checkpoint.every says; the history (losses,
    grad norms, validation losses, step times, saves) continues the checkpoint's. A resumed
    checkpoint at or past max_steps leaves nothing to do: None, and no summary."""
    trainer, resumed = run.cfg.trainer, run.resumed
    first = resumed.step + 1 if resumed else 1
    if first > trainer.max_steps:
        if run.rank == 0:
            log.info("nothing to train: resumed at step %d and trainer.max_steps=%d", resumed.step, trainer.max_steps)
        return None
    history = resumed.history if resumed else new_history()
    position = resumed.position if resumed else DataPosition()
    data = batches(run.sampler, run.dataloader, position, run.cfg.data.global_batch_size)
    device = torch.device(run.cfg.mesh.device_type)
    metrics = Metrics(run, first, history["step_times_s"])
    watchdog = StallWatchdog(trainer.stall_timeout_s, run.rank, run.out_dir)
    # replicate only: fsdp holds one shard per DP rank; hsdp's replicas of a shard are not compared yet
    replicas = trainer.check_replicas_every and run.cfg.parallel.dp_strategy == "replicate"
    pending: List[torch.Tensor] = []
    run.model.train()
    for step in range(first, trainer.max_steps + 1):
        logging_step = step % trainer.log_every == 0 or step == trainer.max_steps
        watchdog.stage(f"step {step}: data, forward and backward")
        inputs, targets = (t.to(device) for t in next(data))
        lr = run.optimizer.param_groups[0]["lr"]
        loss, grad_norm = train_step(run, inputs, targets, logging_step,
                                     on_gradients=lambda: watchdog.stage(f"step {step}: gradient norm, optimizer step"))
        if replicas and step % trainer.check_replicas_every == 0:
            watchdog.stage(f"step {step}: replica check")
            check_replicas(run.module, run.dp_group, step)
        pending.append(local_value(loss))
        if trainer.eval_every and step % trainer.eval_every == 0:
            watchdog.stage(f"step {step}: evaluation")
            metrics.exclude(evaluate_and_log(run, device, step, history, metrics))
        metrics.step_done()
        saving = run.checkpointer.due(step)
        if logging_step or saving:  # a checkpoint holds every loss up to its step
            watchdog.stage(f"step {step}: loss all-reduce")
            history["losses"] += mean_over_dp(run, pending)
            pending = []
        if logging_step:
            history["grad_norms"].append(float(grad_norm))
        watchdog.finished()  # the step, and its evaluation
        if saving:
            watchdog.stage(f"step {step}: checkpoint save")
            metrics.saved(step, run.checkpointer.save(run, step, position, history))  # it records the save
            watchdog.finished()
        else:
            run.checkpointer.poll()
        if logging_step:
            metrics.log_step(step, history["losses"][-1], lr, history["grad_norms"][-1])
    watchdog.stage("waiting for the last checkpoint save")
    run.checkpointer.close()  # the last async save finishes before the run ends
    watchdog.close()  # (a rank that raises exits, and its watchdog thread with it)
    return metrics.summary(history)


def evaluate_and_log(run: Run, device: torch.device, step: int, history: dict, metrics: Metrics) -> float:
    """The validation loss at `step`, into the history and TensorBoard; returns its seconds."""
    start = time.perf_counter()
    history["val_losses"].append([step, evaluate(run, device)])
    metrics.scalars(step, {"val_loss": history["val_losses"][-1][1]})
    return time.perf_counter() - start
