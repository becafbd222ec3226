"""The training loop: step (gradients finalize inside backward), clip, schedule, evaluate, log.

Losses stay on their ranks until a logging step; then one all-reduce over the DP group turns
the pending per-replica losses into global-batch losses (TP ranks already agree), so the hot
path has no extra collective.
"""
import json
import logging
import math
import os
import time
from contextlib import nullcontext
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from tqdm import tqdm

from framework.checkpoint.manager import DataPosition, restart_count
from framework.parallel.data_parallel import DataParallel
from framework.parallel.fully_shard import no_gradient_sync
from framework.parallel.grad_norm import clip_grad_norm, global_grad_norm
from framework.parallel.mesh import layout_table
from framework.parallel.replica_check import check_replicas
from framework.training.logger import TensorBoardLogger
from framework.training.memory import state_bytes
from framework.training.run import Run
from framework.training.watchdog import StallWatchdog

log = logging.getLogger("framework")

# Dense bf16 peak of GPUs MFU is commonly quoted against; trainer.peak_tflops overrides.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def batches(sampler, dataloader, position: DataPosition, global_batch: int) -> Iterator:
    """Endless batches from `position` on, which advances as batches are taken. Each pass over
    the data is one epoch, with set_epoch before it so every epoch gets its own (seeded)
    permutation; a resumed epoch skips the samples its global position says were consumed
    (this replica's share of them, whatever the DP size)."""
    while True:
        sampler.set_epoch(position.epoch)
        sampler.load_state_dict({"yielded": position.samples // sampler.num_replicas})
        for batch in dataloader:
            position.samples += global_batch
            yield batch
        position.epoch += 1
        position.samples = 0


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


def peak_flops(cfg) -> Optional[float]:
    if cfg.trainer.peak_tflops is not None:
        return cfg.trainer.peak_tflops * 1e12
    if cfg.mesh.device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def mfu(tokens_per_s: float, flops_per_token: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_per_token / peak_flops


def memory_per_rank(run: Run) -> dict:
    """This rank's training-state bytes and the largest over all ranks (one all-reduce)."""
    mine = state_bytes(run.module, run.optimizer)
    largest = torch.tensor(list(mine.values()), dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {f"rank{run.rank}": mine,
            "max_over_ranks": dict(zip(mine, (int(v) for v in largest.tolist())))}


def write_json_atomically(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def train(run: Run) -> Optional[dict]:
    """Steps from the first one not yet done (step 1, or the one after a resumed checkpoint) to
    trainer.max_steps, saving a checkpoint where checkpoint.every says; the history (losses,
    grad norms, validation losses, step times, saves) continues the checkpoint's. A resumed
    checkpoint at or past max_steps leaves nothing to do: None, and no summary."""
    cfg, model, optimizer = run.cfg, run.model, run.optimizer
    trainer = cfg.trainer
    device = torch.device(cfg.mesh.device_type)
    is_logger = run.rank == 0
    resumed = run.resumed
    first = resumed.step + 1 if resumed else 1
    if first > trainer.max_steps:
        if is_logger:
            log.info("nothing to train: resumed at step %d and trainer.max_steps=%d", resumed.step, trainer.max_steps)
        return None
    tb = None
    if is_logger and cfg.logger.tensorboard:
        # purge_step hides events a crashed attempt logged past the checkpoint: no duplicate points.
        tb = TensorBoardLogger(os.path.join(run.out_dir, "tb"), purge_step=first if resumed else None)
        tb.log_text("config", OmegaConf.to_yaml(cfg))
        tb.log_text("mesh_layout", layout_table(cfg.mesh.shape, cfg.mesh.dim_names))
    progress = tqdm(total=trainer.max_steps, initial=first - 1, desc="train",
                    disable=not (is_logger and trainer.progress_bar))
    global_batch = cfg.data.global_batch_size
    seq_len = getattr(run.dataset, "seq_len", None)  # token datasets: also report tokens/s
    flops_per_token = run.module.flops_per_token(seq_len) if seq_len and hasattr(run.module, "flops_per_token") else None
    peak = peak_flops(cfg)

    history = resumed.history if resumed else {"losses": [], "grad_norms": [], "val_losses": [],
                                               "step_times_s": [], "checkpoints": []}
    losses: List[float] = history["losses"]
    grad_norms: List[float] = history["grad_norms"]
    val_losses: List[List[float]] = history["val_losses"]
    step_times: List[float] = history["step_times_s"]
    saves: List[dict] = history["checkpoints"]
    pending: List[torch.Tensor] = []
    position = resumed.position if resumed else DataPosition()
    data = batches(run.sampler, run.dataloader, position, global_batch)
    start = window_start = step_start = time.perf_counter()
    window_first = first
    first_step_s = None
    first_step_unix = None
    memory = None
    watchdog = StallWatchdog(trainer.stall_timeout_s, run.rank, run.out_dir)
    # replicate only: fsdp holds one shard per DP rank; hsdp's replicas of a shard are not compared yet
    replicas = trainer.check_replicas_every and cfg.parallel.dp_strategy == "replicate"
    model.train()
    for step in range(first, trainer.max_steps + 1):
        watchdog.stage(f"step {step}: data, forward and backward")
        inputs, targets = (t.to(device) for t in next(data))
        loss = forward_backward(run, inputs, targets)
        logging_step = step % trainer.log_every == 0 or step == trainer.max_steps
        watchdog.stage(f"step {step}: gradient norm, optimizer step")
        if trainer.grad_clip is not None:
            grad_norm = clip_grad_norm(model.parameters(), trainer.grad_clip)
        elif logging_step:
            grad_norm = global_grad_norm(model.parameters())
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        run.scheduler.step()
        if replicas and step % trainer.check_replicas_every == 0:
            watchdog.stage(f"step {step}: replica check")
            check_replicas(run.module, run.dp_group, step)
        pending.append(local_value(loss))
        progress.update(1)
        if trainer.eval_every and step % trainer.eval_every == 0:
            eval_start = time.perf_counter()
            watchdog.stage(f"step {step}: evaluation")
            val_losses.append([step, evaluate(run, device)])
            if tb:
                tb.log_scalars(step, {"val_loss": val_losses[-1][1]})
            eval_s = time.perf_counter() - eval_start  # kept out of step times and throughput
            step_start, window_start, start = step_start + eval_s, window_start + eval_s, start + eval_s
        now = time.perf_counter()
        step_times.append(now - step_start)  # a save's blocking time is recorded with the save
        step_start = now
        if first_step_s is None:
            first_step_s, first_step_unix = now - start, time.time()
            memory = memory_per_rank(run)  # the optimizer's state exists from its first step on
            if tb:
                tb.log_scalars(step, {f"memory/{k}_bytes": v for k, v in memory["max_over_ranks"].items()})
        saving = run.checkpointer.due(step)
        if logging_step or saving:  # a checkpoint holds every loss up to its step
            watchdog.stage(f"step {step}: loss all-reduce")
            losses += mean_over_dp(run, pending)
            pending = []
        if logging_step:
            grad_norms.append(float(grad_norm))
        watchdog.finished()  # the step, and its evaluation
        if saving:
            watchdog.stage(f"step {step}: checkpoint save")
            saves.append({"step": step, "blocking_s": None})
            saves[-1]["blocking_s"] = run.checkpointer.save(run, step, position, history)
            step_start = time.perf_counter()
            watchdog.finished()
            if tb:
                tb.log_scalars(step, {"checkpoint_blocking_s": saves[-1]["blocking_s"]})
        else:
            run.checkpointer.poll()
        if not logging_step:
            continue
        step_time = (time.perf_counter() - window_start) / (step - window_first + 1)
        window_start, window_first = time.perf_counter(), step + 1
        progress.set_postfix(loss=f"{losses[-1]:.4f}")
        scalars = {"loss": losses[-1], "lr": lr, "grad_norm": grad_norms[-1],
                   "samples_per_s": global_batch / step_time, "step_time_s": step_time}
        if seq_len:
            scalars["tokens_per_s"] = global_batch * seq_len / step_time
        if flops_per_token and peak:
            scalars["mfu"] = mfu(scalars["tokens_per_s"], flops_per_token, peak * dist.get_world_size())
        if tb:
            tb.log_scalars(step, scalars)
    watchdog.stage("waiting for the last checkpoint save")
    run.checkpointer.close()  # the last async save finishes before the run ends
    watchdog.close()  # (a rank that raises exits, and its watchdog thread with it)
    progress.close()
    wall = time.perf_counter() - start  # training time, evaluation excluded
    steady_steps = trainer.max_steps - first  # this attempt's steps after its first
    # None (JSON null) when this attempt ran only its first step, which is not timed
    samples_per_s = global_batch * steady_steps / (wall - first_step_s) if steady_steps > 0 else None
    summary = {
        "mesh_shape": list(cfg.mesh.shape),
        "dim_names": list(cfg.mesh.dim_names),
        "plan": OmegaConf.to_container(cfg.plan, resolve=True),
        "steps": trainer.max_steps,
        "final_loss": losses[-1],
        "losses": losses,
        "grad_norms": grad_norms,
        "val_losses": val_losses,
        "overrides": list(cfg.get("overrides", [])),
        "first_step_s": first_step_s,  # this attempt's first step (compiles, warms caches): kept out of samples_per_s
        "first_step_done_unix": first_step_unix,  # for startup timing from outside (bench/)
        "step_times_s": step_times,
        "wall_s": wall,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * seq_len if seq_len and samples_per_s else None,
        "resumed_from": {"path": resumed.path, "step": resumed.step, "load_s": resumed.load_s} if resumed else None,
        "restarts": restart_count(),
        "checkpoints": saves,
        "memory": memory,  # bytes of parameters, gradients, optimizer state: rank 0's and the max over ranks
    }
    if is_logger:
        throughput = f"{samples_per_s:.1f} samples/s" if samples_per_s else "samples/s not measured (only a first step)"
        log.info("final loss %.6f after %d steps, %s", summary["final_loss"], summary["steps"], throughput)
        if tb:
            tb.log_hparams(
                {"mesh": "x".join(map(str, cfg.mesh.shape)), "dim_names": list(cfg.mesh.dim_names),
                 "plan": summary["plan"], "global_batch_size": global_batch, "max_steps": trainer.max_steps,
                 **dict(override.split("=", 1) for override in summary["overrides"] if "=" in override)},
                {"final/loss": summary["final_loss"],
                 **({"final/samples_per_s": samples_per_s} if samples_per_s else {})},
                trainer.max_steps,
            )
            tb.close()
        write_json_atomically(os.path.join(run.out_dir, "summary.json"), summary)
    return summary
