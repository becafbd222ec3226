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


def fitted_to_groups(state: dict, groups: int) -> dict:
    """A saved schedule's state for an optimizer of `groups` param groups. The groups are one per
    kind of tensor (framework.parallel.dtensors.by_mesh) and share every hyperparameter, so its
    per-group lists hold one value repeated, and a checkpoint from a mesh with another count
    (experts over 2 ranks: 2 groups; one process: 1) resumes with that value in each group."""
    return {key: [value[0]] * groups if key in ("base_lrs", "_last_lr", "lr_lambdas") and value else value
            for key, value in state.items()}
