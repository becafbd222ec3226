"""Single-process training written by hand, with plain torch: the independent reference the
distributed runs are compared against (same seed, same global batches, same optimizer). A
mixture of experts is routed here too (HandRouting), not by framework.models.moe, so a routing
bug the layouts share cannot hide in the reference."""
from typing import Collection, Dict, List, Optional

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler

from framework.models.moe import MoE, RoutingStats

# Each objective's loss as torch computes it by hand: the mean over the units that count.
REFERENCE_LOSSES = {
    "framework.training.objectives.lm.NextTokenCrossEntropy":
        lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=-100),
    "framework.training.objectives.lm.MeanSquaredError": F.mse_loss,
}


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class HandRouting:
    """Each MoE block of a model computed here instead of by its own forward: every expert on
    every token (a dense mixture), weighted by a combine matrix that is zero outside the token's
    top_k; the experts chosen by the router's probabilities plus the expert bias, weighted by the
    probabilities alone (DeepSeek-V3). The load-balancing term is transformers'
    load_balancing_loss_func written out over the choices made here, and the bias moves after
    each step by the rate times sign(mean load - the expert's load)."""

    def __init__(self, model: torch.nn.Module, bias_update_rate: Optional[float]):
        self.blocks = [module for module in model.modules() if isinstance(module, MoE)]
        self.rate = bias_update_rate
        self.biases = [torch.zeros(block.experts.n_experts) for block in self.blocks]
        self.routed: List[tuple] = []  # (probabilities, chosen experts) of each block, this forward
        self.loads: List[List[torch.Tensor]] = []  # per step, each block's token slots per expert
        self.bias_history: List[List[torch.Tensor]] = []  # per step, each block's bias after it
        for i, block in enumerate(self.blocks):
            block.forward = lambda x, i=i: self.moe_forward(i, x)

    def moe_forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        block, tokens = self.blocks[i], x.reshape(-1, x.shape[-1])
        probabilities = F.softmax(block.gate(tokens), dim=-1, dtype=torch.float32)
        scores = probabilities + self.biases[i] if self.rate is not None else probabilities
        chosen = scores.topk(block.top_k, dim=-1).indices
        weights = probabilities.gather(1, chosen)
        if block.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        combine = torch.zeros_like(probabilities).scatter(1, chosen, weights)
        experts = block.experts
        out = sum(combine[:, e, None] * swiglu(tokens, experts.w1[e], experts.w2[e], experts.w3[e])
                  for e in range(experts.n_experts))
        if block.shared_expert is not None:
            shared = block.shared_expert(tokens)
            if block.shared_expert_gate is not None:
                shared = torch.sigmoid(block.shared_expert_gate(tokens)) * shared
            out = out + shared
        self.routed.append((probabilities, chosen))
        # (the model's own bookkeeping reads its blocks' stats; the reference never uses its term)
        block.stats = RoutingStats(torch.bincount(chosen.flatten(), minlength=experts.n_experts),
                                   probabilities.sum(dim=0))
        return out.view_as(x)

    def load_balance(self) -> torch.Tensor:
        """n_experts x sum over (k, e) of the share of tokens whose k-th choice is e times e's mean
        probability, over every MoE layer's tokens of this forward."""
        probabilities = torch.cat([p for p, _ in self.routed])
        chosen = F.one_hot(torch.cat([c for _, c in self.routed]), probabilities.shape[-1]).float()
        return probabilities.shape[-1] * (chosen.mean(dim=0) * probabilities.mean(dim=0)).sum()

    @torch.no_grad()
    def step(self) -> None:
        """After the optimizer step: each block's load of this step kept (`loads`), and each
        biased block's bias moved toward the step's mean load (`bias_history`)."""
        loads = [torch.bincount(chosen.flatten(), minlength=bias.numel()).float()
                 for bias, (_, chosen) in zip(self.biases, self.routed)]
        if self.rate is not None:
            for bias, load in zip(self.biases, loads):
                bias += self.rate * torch.sign(load.mean() - load)
        self.loads.append(loads)
        self.bias_history.append([bias.clone() for bias in self.biases])
        self.routed = []


def load_balance_weight(cfg: DictConfig) -> float:
    return (cfg.objective.get("aux_coefficients") or {}).get("load_balance", cfg.model.moe.get("aux_loss_coef", 0.0))


@torch.no_grad()
def validation_loss(model: torch.nn.Module, cfg: DictConfig, loss_fn) -> float:
    """The loss over the first trainer.eval_batches global batches of the val split, in order:
    the mean of their batch means (every target counts, so each batch weighs the same)."""
    val = instantiate(cfg.data.dataset, split="val")
    loader = DataLoader(val, batch_size=cfg.data.global_batch_size, shuffle=False, drop_last=True)
    means = []
    for _, (inputs, targets, *positions) in zip(range(cfg.trainer.eval_batches), loader):
        means.append(loss_fn(model(inputs, **({"positions": positions[0]} if positions else {})), targets).item())
    return sum(means) / len(means)


def reference_training(cfg: DictConfig, first_replica_alone: Collection[int] = (),
                       replicas: int = 1, optimizer_of=None) -> Dict[str, List[float]]:
    """`first_replica_alone`: the steps (from 1) that the first of `replicas` DP replicas trained
    alone (a torchft replica group whose peers had failed): on its share of the global batch,
    every replicas-th sample, as DistributedSampler deals them. `optimizer_of(model)`: an
    optimizer written for the test (torch's Muon beside AdamW), else cfg.optim's."""
    torch.manual_seed(cfg.trainer.seed)
    model = instantiate(cfg.model)
    moe = cfg.model.get("moe")
    routing = HandRouting(model, moe.get("bias_update_rate")) if moe else None
    optimizer = optimizer_of(model) if optimizer_of else instantiate(cfg.optim)(model.parameters())
    dataset = instantiate(cfg.data.dataset)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=cfg.sampler.shuffle,
                                 seed=cfg.sampler.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.data.global_batch_size, sampler=sampler, drop_last=True)
    loss_fn = REFERENCE_LOSSES[cfg.objective._target_]
    losses, grad_norms, val_losses = [], [], []
    batches = iter(loader)
    for step in range(1, cfg.trainer.max_steps + 1):
        inputs, targets, *positions = next(batches)  # positions: document-masked token data
        if step in first_replica_alone:
            inputs, targets, *positions = (t[::replicas] for t in (inputs, targets, *positions))
        optimizer.zero_grad()
        loss = loss_fn(model(inputs, **({"positions": positions[0]} if positions else {})), targets)
        if routing is not None:
            loss = loss + load_balance_weight(cfg) * routing.load_balance()
        loss.backward()
        if cfg.trainer.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        if routing is not None:
            routing.step()
        losses.append(loss.item())
        grad_norms.append(norm.item())
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and routing is None:
            val_losses.append([step, validation_loss(model, cfg, loss_fn)])
    return {"losses": losses, "grad_norms": grad_norms, "val_losses": val_losses, "param_names": [n for n, _ in model.named_parameters()],
            "numel": sum(p.numel() for p in model.parameters()), "state_dict_keys": sorted(model.state_dict()),
            "routing": routing, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}

