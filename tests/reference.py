"""Single-process training written by hand, with plain torch: the independent reference the
distributed runs are compared against (same seed, same global batches, same optimizer)."""
from typing import Dict, List

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler

# Each objective's loss as torch computes it by hand: the mean over the units that count.
REFERENCE_LOSSES = {
    "framework.training.objectives.NextTokenCrossEntropy":
        lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=-100),
    "framework.training.objectives.MeanSquaredError": F.mse_loss,
}


def reference_training(cfg: DictConfig) -> Dict[str, List[float]]:
    torch.manual_seed(cfg.trainer.seed)
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optim)(model.parameters())
    dataset = instantiate(cfg.data.dataset)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=cfg.sampler.shuffle,
                                 seed=cfg.sampler.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.data.global_batch_size, sampler=sampler, drop_last=True)
    loss_fn = REFERENCE_LOSSES[cfg.objective._target_]
    losses, grad_norms = [], []
    batches = iter(loader)
    for _ in range(cfg.trainer.max_steps):
        inputs, targets, *positions = next(batches)  # positions: document-masked token data
        optimizer.zero_grad()
        loss = loss_fn(model(inputs, **({"positions": positions[0]} if positions else {})), targets)
        for name, value in getattr(model, "auxiliary_losses", {}).items():  # a sum over the batch's tokens
            loss = loss + model.aux_coefficients[name] * value / inputs.numel()
        loss.backward()
        if cfg.trainer.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        losses.append(loss.item())
        grad_norms.append(norm.item())
    return {"losses": losses, "grad_norms": grad_norms, "param_names": [n for n, _ in model.named_parameters()],
            "numel": sum(p.numel() for p in model.parameters()), "state_dict_keys": sorted(model.state_dict())}

