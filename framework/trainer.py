"""The training loop: step, sync (inside backward), clip, log, summarize.

Losses stay on their ranks until a logging step; then one all-reduce over the DP group turns
the pending per-replica losses into global-batch losses (TP ranks already agree), so the hot
path has no extra collective.
"""
import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Iterator, List

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm import tqdm

from framework.logger import TensorBoardLogger
from framework.mesh import layout_table
from framework.parallel.grad_norm import clip_grad_norm, global_grad_norm

if TYPE_CHECKING:
    from framework.builder import Run

log = logging.getLogger("framework")


def batches(run: "Run") -> Iterator:
    """Endless batches; each pass over the data is one epoch, with set_epoch before it so
    every epoch gets its own (seeded) permutation."""
    epoch = 0
    while True:
        run.sampler.set_epoch(epoch)
        yield from run.dataloader
        epoch += 1


def global_losses(run: "Run", pending: List[torch.Tensor]) -> List[float]:
    """Mean over DP replicas of each pending per-replica loss: the global-batch loss."""
    losses = torch.stack(pending).float()
    if run.dp["size"] > 1:
        dist.all_reduce(losses, group=run.model.dp_group)
        losses /= run.dp["size"]
    return losses.cpu().tolist()


def write_json_atomically(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def train(run: "Run") -> dict:
    cfg, model, optimizer = run.cfg, run.model, run.optimizer
    loss_fn = instantiate(cfg.data.loss)
    device = torch.device(cfg.mesh.device_type)
    is_logger = run.rank == 0
    tb = TensorBoardLogger(os.path.join(run.out_dir, "tb")) if is_logger and cfg.logger.tensorboard else None
    if tb:
        tb.log_text("config", OmegaConf.to_yaml(cfg))
        tb.log_text("mesh_layout", layout_table(cfg.mesh.shape, cfg.mesh.dim_names))
    progress = tqdm(total=cfg.trainer.max_steps, desc="train", disable=not (is_logger and cfg.trainer.progress_bar))
    global_batch = cfg.data.global_batch_size

    losses: List[float] = []
    grad_norms: List[float] = []
    pending: List[torch.Tensor] = []
    data = batches(run)
    start = window_start = time.perf_counter()
    first_step_s = None
    model.train()
    for step in range(1, cfg.trainer.max_steps + 1):
        inputs, targets = (t.to(device) for t in next(data))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()  # DataParallel averages gradients over DP as backward finishes
        logging_step = step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps
        if cfg.trainer.grad_clip is not None:
            grad_norm = clip_grad_norm(model.parameters(), cfg.trainer.grad_clip)
        elif logging_step:
            grad_norm = global_grad_norm(model.parameters())
        optimizer.step()
        pending.append(loss.detach())
        if first_step_s is None:
            first_step_s = time.perf_counter() - start
        if logging_step:
            grad_norms.append(float(grad_norm))
        progress.update(1)
        if not logging_step:
            continue
        new_losses = global_losses(run, pending)
        losses += new_losses
        elapsed = time.perf_counter() - window_start
        step_time = elapsed / len(pending)
        pending, window_start = [], time.perf_counter()
        progress.set_postfix(loss=f"{new_losses[-1]:.4f}")
        if tb:
            tb.log_scalars(step, {
                "loss": new_losses[-1],
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norms[-1],
                "samples_per_s": global_batch / step_time,
                "step_time_s": step_time,
            })
    progress.close()
    wall = time.perf_counter() - start
    steady_steps = cfg.trainer.max_steps - 1
    summary = {
        "mesh_shape": list(cfg.mesh.shape),
        "dim_names": list(cfg.mesh.dim_names),
        "plan": OmegaConf.to_container(cfg.plan, resolve=True),
        "steps": cfg.trainer.max_steps,
        "final_loss": losses[-1],
        "losses": losses,
        "grad_norms": grad_norms,
        "time_to_first_step_s": first_step_s,
        "wall_s": wall,
        "samples_per_s": global_batch * steady_steps / (wall - first_step_s) if steady_steps else math.nan,
    }
    if is_logger:
        log.info("final loss %.6f after %d steps, %.1f samples/s", summary["final_loss"], summary["steps"],
                 summary["samples_per_s"])
        if tb:
            tb.log_hparams(
                {"mesh": "x".join(map(str, cfg.mesh.shape)), "dim_names": list(cfg.mesh.dim_names),
                 "plan": summary["plan"], "global_batch_size": global_batch, "max_steps": cfg.trainer.max_steps},
                {"final/loss": summary["final_loss"], "final/samples_per_s": summary["samples_per_s"]},
                cfg.trainer.max_steps,
            )
            tb.close()
        write_json_atomically(os.path.join(run.out_dir, "summary.json"), summary)
    return summary
