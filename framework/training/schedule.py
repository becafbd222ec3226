"""The learning-rate schedule: linear warmup, then constant or cosine decay, as a LambdaLR."""
import math

import torch


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, decay: str) -> float:
    """For 0-based step `step`: linear warmup over warmup_steps, then constant, or cosine decay
    reaching 10% on the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = (step + 1 - warmup_steps) / max(1, max_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                    decay: str) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps, max_steps, decay))


def fitted_to_groups(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A saved schedule's state for `optimizer`, its state already loaded. The groups are one
    per kind of tensor (framework.parallel.dtensors.by_mesh), and a checkpoint from a mesh with
    another count (experts over 2 ranks: 2 groups; one process: 1) must resume too: each
    group's base and current lr come from its own loaded initial_lr and lr (optim=muon's groups
    differ: Muon's and AdamW's), the lr function, the same for all, repeated."""
    groups = optimizer.param_groups
    return {**state, "base_lrs": [g["initial_lr"] for g in groups], "_last_lr": [g["lr"] for g in groups],
            "lr_lambdas": [state["lr_lambdas"][0]] * len(groups) if state.get("lr_lambdas") else state.get("lr_lambdas")}
