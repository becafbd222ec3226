"""A mixture-of-experts feed-forward (Qwen3-MoE, Mixtral and Qwen2-MoE as transformers computes
them; the framework's own LMs with `model.moe`).

Router: the linear `gate` scores every token for every expert (softmax in fp32), each token goes
to its top_k experts with those scores as weights, renormalized to sum to 1 when norm_topk_prob
(Qwen3-MoE, Mixtral) or not (Qwen2-MoE). Dropless: every expert runs every token routed to it.
Experts are SwiGLU, stacked ([n_experts, ...] per weight), so their names do not depend on how
they are spread over ranks (framework.parallel.expert_parallel shards the stacks and sends the
tokens to their experts' ranks; here, `dispatch` runs them all locally). An optional shared
expert (Qwen2-MoE) sees every token, scaled by sigmoid(shared_expert_gate(x)).

Load balancing, either or both: the auxiliary loss of Switch / Mixtral, as transformers'
load_balancing_loss_func computes it over the routing of every MoE layer pooled
(load_balance_loss; each block keeps the statistics of its last forward, the model turns them
into the `load_balance` term it reports, framework.training.objectives); and DeepSeek-V3's
aux-loss-free expert bias (`bias_update_rate`): a per-expert bias added to the scores only to
choose the experts, moved after each optimizer step by bias_update_rate x the sign of the mean
load minus each expert's load over the step's global batch (update_expert_biases).
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.config.errors import ConfigError
from framework.parallel.dtensors import local_part


def swiglu_per_expert(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                      counts: List[int]) -> torch.Tensor:
    """SwiGLU of expert e on its run of `counts[e]` consecutive tokens: one matmul per expert."""
    outputs = [F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e])
               for e, chunk in enumerate(tokens.split(counts))]
    return torch.cat(outputs) if outputs else tokens[:0]


def swiglu_grouped(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   counts: List[int]) -> torch.Tensor:
    """The same with one grouped GEMM per weight over every expert's run (torch._grouped_mm,
    the offsets the runs' ends), as torchtitan computes its experts."""
    offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
    hidden = F.silu(torch._grouped_mm(tokens, w1.transpose(-2, -1), offs=offsets)) \
        * torch._grouped_mm(tokens, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)


def grouped_gemm_runs(dtype: torch.dtype) -> bool:
    """Where torch 2.13's grouped GEMM runs: bf16 (CPU and CUDA); fp32 fails on CPU ("Invalid
    strides/sizes"), so it takes the per-expert loop."""
    return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def dispatch_locally(experts: "Experts", tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Every expert on this rank: token slots (one per token and choice) sorted by expert, run,
    and returned in the order of `expert_ids` (flattened)."""
    order = expert_ids.argsort(stable=True)
    counts = experts.slots_per_expert(expert_ids).tolist()
    return experts(tokens[order], counts)[order.argsort()]


class Experts(nn.Module):
    """n_experts SwiGLU experts, each weight stacked: w1 / w3 [E, hidden, dim] (gate / up), w2
    [E, dim, hidden] (down), as Linear weights are laid out. Under expert parallelism the stacks
    are DTensors sharded on the expert dim; `local_weights` is this rank's experts."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        for weight in (self.w1, self.w2, self.w3):  # as nn.Linear initializes each expert's matrix
            for matrix in weight.data:
                nn.init.kaiming_uniform_(matrix, a=5 ** 0.5)

    def slots_per_expert(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """How many token slots chose each expert. On meta (framework.dryrun) the ids hold no
        values: the balanced routing load balancing aims at is assumed (an even share, the
        remainder to the first experts), counted on the CPU so that the sizes can be read."""
        n_experts = self.n_experts
        if expert_ids.is_meta:
            slots = expert_ids.numel()
            return torch.tensor([slots // n_experts + (e < slots % n_experts) for e in range(n_experts)])
        return torch.bincount(expert_ids, minlength=n_experts)

    def local_weights(self):
        return tuple(local_part(w) for w in (self.w1, self.w2, self.w3))

    def forward(self, tokens: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """Each local expert on its consecutive run of `tokens` (sorted by expert; `counts` tokens
        each): a grouped GEMM where it runs, else one matmul per expert (the same numbers: tested).
        In the tokens' dtype: FSDP2's bf16 compute leaves EP's experts (not its to cast) in fp32.
        A module call, so FSDP2 gathers the experts it shards over the DP ranks EP leaves out."""
        weights = tuple(w.to(tokens.dtype) for w in self.local_weights())
        swiglu = swiglu_grouped if grouped_gemm_runs(tokens.dtype) and len(tokens) else swiglu_per_expert
        return swiglu(tokens, *weights, counts)


@dataclass
class RoutingStats:
    """One MoE block's routing of its last forward: per expert, the token slots it was chosen for
    (no gradient) and the sum of its router probabilities over the tokens (with gradient)."""
    chosen: torch.Tensor
    probability_sums: torch.Tensor


class MoE(nn.Module):
    """The routed experts (+ an optional shared expert) in place of a block's feed-forward."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool = True,
                 shared_expert: Optional[nn.Module] = None, shared_gate: bool = False,
                 bias_update_rate: Optional[float] = None):
        """shared_expert: a dense feed-forward every token also passes through (the block makes
        it), gated per token with shared_gate. bias_update_rate: the expert bias's step (null: no bias)."""
        super().__init__()
        if n_experts < 1:
            raise ConfigError("model.moe.n_experts", n_experts, "must be >= 1 (for a dense block, leave the block "
                                                                "out of model.moe.layers)")
        if not 1 <= top_k <= n_experts:
            raise ConfigError("model.moe.top_k", top_k, f"must be between 1 and model.moe.n_experts={n_experts}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden_dim)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_expert is not None and shared_gate else None
        # how token slots reach their experts: all here, or over the EP ranks (framework.parallel.expert_parallel)
        self.dispatch: Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor] = dispatch_locally
        self.stats: Optional[RoutingStats] = None
        if bias_update_rate is not None and not bias_update_rate > 0:
            raise ConfigError("model.moe.bias_update_rate", bias_update_rate, "must be > 0 (the bias's step toward "
                                                                              "the mean load), or null for no bias")
        self.bias_update_rate = bias_update_rate
        # token slots per expert since the last logging step (routing_metrics): made from the first
        # routing, so a model allocated later (to_empty, a Hugging Face model) holds no garbage
        self.logged_load: Optional[torch.Tensor] = None
        self.counts_load = True  # False for a forward that trains nothing (a pipeline's shape inference)
        if bias_update_rate is not None:
            self.register_buffer("expert_bias", torch.zeros(n_experts))  # checkpointed with the model
            self.register_buffer("step_load", torch.zeros(n_experts), persistent=False)  # token slots this step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        # the gate and the shared expert see x as it comes (batch first: verify compares them per sample)
        probabilities = F.softmax(self.gate(x), dim=-1, dtype=torch.float32).flatten(0, -2)
        if self.bias_update_rate is None:
            weights, expert_ids = probabilities.topk(self.top_k, dim=-1)
        else:  # the bias chooses the experts; the weights stay the router's own probabilities
            expert_ids = (probabilities + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = probabilities.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.stats = RoutingStats(self.experts.slots_per_expert(expert_ids.flatten()).to(x.device),
                                  probabilities.sum(dim=0))
        slots = tokens.repeat_interleave(self.top_k, dim=0)  # token t's k-th choice at t * top_k + k
        routed = self.dispatch(self.experts, slots, expert_ids.flatten())
        out = (routed.view(-1, self.top_k, tokens.shape[-1]) * weights.to(routed.dtype)[..., None]).sum(dim=1).view_as(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def load_balance_loss(blocks: List[MoE], group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The auxiliary load-balancing loss as a sum over this rank's tokens: n_experts x sum_i f_i
    x P_i (transformers' load_balancing_loss_func), where f_i is the share of all token slots of
    every MoE layer that went to expert i and P_i the mean router probability of expert i over
    every layer's tokens. f_i counts the whole global micro-batch (its counts all-reduced over
    `group`, the ranks holding other tokens); P_i is linear in the tokens, so this rank's sum
    over its own tokens carries its part of the gradient, and the normalization over the
    global batch's tokens (framework.training.trainer) makes it the pooled mean."""
    chosen = torch.stack([block.stats.chosen for block in blocks]).sum(dim=0).float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(chosen, group=group)
    slots = chosen.sum()  # layers x global tokens x top_k
    top_k, n_experts = blocks[0].top_k, blocks[0].experts.n_experts
    share = chosen / slots * top_k  # f_i as transformers sums it over the top_k choices
    probability_sums = torch.stack([block.stats.probability_sums for block in blocks]).sum(dim=0)
    return n_experts * (share * probability_sums).sum() / len(blocks)


def moe_blocks(model: nn.Module) -> List[MoE]:
    """The model's mixture-of-experts blocks, in order (none for a dense model)."""
    return [module for module in model.modules() if isinstance(module, MoE)]


@contextmanager
def loads_uncounted(blocks: List[MoE]) -> Iterator[None]:
    """Forwards inside count no routing load: they train nothing (a pipeline's shape inference),
    and the expert biases move by the load of the step's micro-batches alone."""
    for block in blocks:
        block.counts_load = False
    try:
        yield
    finally:
        for block in blocks:
            block.counts_load = True


def count_step_load(blocks: List[MoE]) -> None:
    """Add each block's routing of the forward just run to its load since the last logging step
    and, when biased, to its step's load (called once per training micro-batch, outside the
    blocks: not again when activation checkpointing recomputes them)."""
    for block in blocks:
        if block.training and block.counts_load:
            block.logged_load = block.stats.chosen.clone() if block.logged_load is None \
                else block.logged_load + block.stats.chosen
            if block.bias_update_rate is not None:
                block.step_load += block.stats.chosen


@torch.no_grad()
def routing_metrics(blocks: Dict[int, MoE], group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
    """Per MoE layer (by its index in the model), since the last logging step, over the global
    batches: the busiest expert's token slots over the mean (1: balanced), and the spread (max -
    min) of the expert bias when there is one. One all-reduce over `group`; the loads start again."""
    loads = torch.stack([block.logged_load if block.logged_load is not None else torch.zeros_like(block.stats.chosen)
                         for block in blocks.values()]).float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    metrics = {}
    for i, block, load in zip(blocks, blocks.values(), loads):
        metrics[f"moe/layer{i}_load_max_over_mean"] = float(load.max() / load.mean().clamp(min=1))
        if block.bias_update_rate is not None:
            metrics[f"moe/layer{i}_bias_spread"] = float(block.expert_bias.max() - block.expert_bias.min())
        block.logged_load = None
    return metrics


@torch.no_grad()
def update_expert_biases(blocks: List[MoE], group: Optional[dist.ProcessGroup] = None) -> None:
    """After an optimizer step: each biased block's load over the global batch (all-reduced over
    `group`, the ranks holding other tokens), its bias moved toward balance, the load reset."""
    biased = [block for block in blocks if block.bias_update_rate is not None]
    if not biased:
        return
    loads = torch.stack([block.step_load for block in biased])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for block, load in zip(biased, loads):
        block.expert_bias += block.bias_update_rate * torch.sign(load.mean() - load)
        block.step_load.zero_()
