"""A loss that never holds the whole logits (`trainer.loss_chunk_tokens`).

At a 128k vocabulary the fp32 logits of 8 x 2048 tokens are 8.4 GB, and the loss's backward
holds as much again. Here the objective's OutputHead (framework.training.objectives.head) hands
the final norm's hidden states and the model's output layer to score_by_chunks, which scores
them a chunk of tokens at a time (Liger's fused linear cross entropy, torchtitan's
ChunkedLossWrapper, TRL's chunked NLL):
- the LM objective's summed cross entropy computes each chunk's gradients of the hidden states
  and the output weight in the forward (the chunk's logits freed at once), the backward only
  scales them (_CrossEntropySum): no logits kept, none recomputed;
- the per-token log-probabilities DPO / KTO / SimPO and GRPO read keep each token's gradient
  unknown until their nonlinear loss is taken, so their backward recomputes each chunk's logits
  (_TokenLogps);
- an output layer that is not a bare weight (TP's vocabulary-sharded DTensor under
  loss_parallel, LoRA's hook, NF4) is called as a module on chunks of rows under
  torch.utils.checkpoint, whose backward recomputes the chunk.
The peak then holds one chunk's logits, not all. The result is wrapped (LossSum, TokenLogps)
and the objectives read it where they read logits.
"""
from typing import Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.data.batch import IGNORE
from framework.models.protocol import project
from framework.training.objectives.logps import LossSum, TokenLogps, cross_entropy_sum, token_logps


def score_by_chunks(hidden: torch.Tensor, output: nn.Module, targets: torch.Tensor, chunk: int, per_token: bool):
    """`output` (the model's output layer) scored on the final hidden states, (rows, seq, dim) or
    (count, dim) at the counted targets alone, by chunks of `chunk` tokens: a TokenLogps in the
    targets' shape (`per_token`), or a LossSum."""
    counted = targets != IGNORE
    picked = targets[counted] if hidden.dim() == 2 else targets
    if bare_weight(output):
        flat = hidden.reshape(-1, hidden.shape[-1])
        scored = fused(flat, output.weight, picked.reshape(-1), chunk, per_token)
    else:
        scored = by_module(hidden, output, picked, chunk, per_token)
    if not per_token:
        return LossSum(scored)
    if hidden.dim() == 2:  # back to the targets' places
        return TokenLogps(torch.zeros(targets.shape, dtype=scored.dtype, device=scored.device)
                          .masked_scatter(counted, scored))
    return TokenLogps(scored.view(targets.shape))


def bare_weight(output: nn.Module) -> bool:
    """Whether the output layer is hidden @ weight.T and nothing else (no bias, no hook, a plain
    tensor: not TP's DTensor, not NF4), so the fused functions may use its weight directly."""
    return type(output) is nn.Linear and output.bias is None and not output._forward_hooks \
        and not output._forward_pre_hooks and type(output.weight) in (nn.Parameter, torch.Tensor) \
        and type(output.weight.data) is torch.Tensor


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul's dtype: autocast's where it is on (as F.linear would compute), else the output
    layer's own (FSDP2's bf16 parameters; framework.models.protocol.project)."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, per_token: bool):
    """hidden (tokens, dim) @ weight.T scored by chunks: per-token log-probabilities (tokens,), or the
    summed cross entropy (a 0-dim tensor)."""
    dtype = compute_dtype(hidden, weight)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.autocast(hidden.device.type, enabled=False):
            lse, picked, _, _ = by_chunks(hidden, weight.to(dtype), targets, chunk)
        counted = targets != IGNORE
        return torch.where(counted, picked - lse, 0.0) if per_token else torch.where(counted, lse - picked, 0.0).sum()
    function = _TokenLogps if per_token else _CrossEntropySum
    return function.apply(hidden, weight, targets, chunk, dtype)


def by_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
              scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
    """Each token's logsumexp and target logit (fp32 at least, as cross entropy's upcast), a chunk
    of `chunk` tokens' logits at a time (`weight` already in the matmul's dtype); with `scale`
    (tokens,), also the gradients of sum(scale x (logsumexp - target logit)) w.r.t. hidden (its
    dtype) and weight (fp32 at least), from each chunk's logits turned in place into softmax - one-hot."""
    tokens, upcast = hidden.shape[0], torch.promote_types(weight.dtype, torch.float32)
    lse = torch.empty(tokens, dtype=upcast, device=hidden.device)
    picked = torch.empty_like(lse)
    grad_hidden = torch.empty_like(hidden) if scale is not None else None
    grad_weight = torch.zeros(weight.shape, dtype=upcast, device=weight.device) if scale is not None else None
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        h, t = hidden[start:end].to(weight.dtype), targets[start:end].clamp(min=0)
        logits = torch.mm(h, weight.t()).to(upcast)
        lse[start:end] = logits.logsumexp(-1)
        picked[start:end] = logits.gather(1, t[:, None]).squeeze(1)
        if scale is None:
            continue
        grad = logits.sub_(lse[start:end, None]).exp_()  # softmax
        grad[torch.arange(end - start, device=grad.device), t] -= 1
        grad = grad.mul_(scale[start:end, None]).to(weight.dtype)
        grad_hidden[start:end] = torch.mm(grad, weight)
        grad_weight += torch.mm(grad.t(), h)
    return lse, picked, grad_hidden, grad_weight


class _CrossEntropySum(torch.autograd.Function):
    """The summed cross entropy; its gradients made in the forward, chunk by chunk (Liger's way):
    the backward scales them by the loss's gradient, a scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype):
        counted = (targets != IGNORE).float()
        with torch.autocast(hidden.device.type, enabled=False):
            lse, picked, grad_hidden, grad_weight = by_chunks(hidden, weight.to(dtype), targets, chunk, counted)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return ((lse - picked) * counted).sum()

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad.to(grad_hidden.dtype), grad_weight * grad.to(grad_weight.dtype), None, None, None


class _TokenLogps(torch.autograd.Function):
    """Per-token log-probabilities; the backward recomputes each chunk's logits (a token's
    gradient is known only then)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            lse, picked, _, _ = by_chunks(hidden, weight.to(dtype), targets, chunk)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.dtype = chunk, dtype
        return torch.where(targets != IGNORE, picked - lse, 0.0)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets = ctx.saved_tensors
        scale = -grad * (targets != IGNORE)  # d(logp)/d(logits) = one-hot - softmax
        with torch.autocast(hidden.device.type, enabled=False):
            _, _, grad_hidden, grad_weight = by_chunks(hidden, weight.to(ctx.dtype), targets, ctx.chunk, scale)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def by_module(hidden: torch.Tensor, output: nn.Module, targets: torch.Tensor, chunk: int, per_token: bool):
    """The output layer called as a module on chunks of `chunk` tokens' rows (whole rows of
    (rows, seq, dim) hidden states, whatever the sequence's TP layout), each under
    torch.utils.checkpoint so its backward recomputes the chunk's logits; vocabulary-sharded
    logits (TP's loss_parallel plans) scored under the loss_parallel the Trainer enters around
    forward and backward (framework.parallel.plan.vocabulary_sharded)."""
    rows = max(1, chunk // hidden.shape[1]) if hidden.dim() == 3 else chunk
    score = _score_tokens if per_token else _score_sum
    parts = [checkpoint(score, output, h, t, use_reentrant=False) if torch.is_grad_enabled() else score(output, h, t)
             for h, t in zip(hidden.split(rows), targets.split(rows))]
    return torch.cat(parts) if per_token else sum(parts[1:], parts[0])


def _score_sum(output: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = project(output, hidden)
    if hidden.dim() == 2:
        logits, targets = logits[:, None], targets[:, None]
    return cross_entropy_sum(logits, targets)


def _score_tokens(output: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = project(output, hidden)
    return token_logps(logits[:, None] if hidden.dim() == 2 else logits, targets[:, None] if hidden.dim() == 2
                       else targets).flatten()
