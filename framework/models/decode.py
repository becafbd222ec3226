"""The decoder: KV-cache generation, which framework.generate (the command) and GRPO's rollout
(framework.training.objectives.grpo) both call.

Everything stays on the model's device until the end: sampling draws its noise there from
per-prompt generators (made on that device), temperature and top-p are tensor operations, the
stop test reads `done` back every `check_every` tokens, and the caller gets the tokens in one
transfer. The cache is static (StaticCache: every layer's keys and values preallocated for the
prompt and the new tokens, written at a position held in a tensor), so each one-token step has
the same shapes and can be compiled once (`compile`: torch.compile of the step; on CUDA with
mode reduce-overhead, CUDA graphs).
"""
import json
import os
from typing import List, Optional, Set, Tuple

import torch
from torch import nn

from framework.models.documents import AttentionLayout, additive_mask
from framework.models.protocol import offered, project

CHECK_EVERY = 8  # tokens between two looks at `done` (bench/README.md, GRPO: the stop check)


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float, generators: List[torch.Generator],
                with_logps: bool = False):
    """One token per row of `logits` (rows, vocab): the most likely (temperature 0), else sampled
    from the smallest set of most likely tokens whose probability reaches top_p (all of them at
    top_p 1, with no sort). The rows are split evenly among `generators` (on the logits' device)
    in order, each part drawn from its own: a prompt's draws do not depend on which prompts decode
    beside it. The draw is torch.multinomial's for one sample (argmax of p / q, q ~ Exp(1)), with
    no host sync (multinomial checks its input on the host): on the CPU the same tokens.
    `with_logps`: also each drawn token's log-probability under the distribution it was drawn
    from (the nucleus renormalized; greedy: the softmax at temperature 1), as (tokens, logps)."""
    if temperature == 0:
        drawn = logits.argmax(-1)
        return (drawn, torch.log_softmax(logits.float(), -1).gather(-1, drawn[:, None])[:, 0]) if with_logps else drawn
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0)
    parts = probs.split(len(probs) // len(generators))
    noise = torch.cat([torch.empty_like(part).exponential_(1, generator=g) for part, g in zip(parts, generators)])
    drawn = (probs / noise).argmax(-1, keepdim=True)
    tokens = (drawn if order is None else order.gather(-1, drawn)).squeeze(-1)
    if not with_logps:
        return tokens
    return tokens, (probs.gather(-1, drawn)[:, 0] / probs.sum(-1)).log()


class StaticCache:
    """One layer's keys and values for `capacity` positions, zeroed (a masked key's weight is 0,
    and 0 x garbage could be NaN), written at `position` (a 0-d tensor every layer shares). A
    compiled step (`static_address`) and a GPU's attend over every position: each step's shapes
    are the same, so a compiled step never recompiles, and the position is never read back to
    the host. An eager step on the CPU, where that read costs nothing, attends over the positions
    written so far (`span`): over the whole buffer, a 64-token rollout's attention read 2-3x the
    keys it needed (bench/README.md). `pad` (rows,): each row's left padding.
    Transformer.forward asks it for the layout (`layout`), rotated by the table made for the whole
    capacity before decoding (`prepare`)."""

    def __init__(self, capacity: int, position: torch.Tensor, pad: torch.Tensor, static_address: bool = False):
        self.capacity, self.position, self.pad = capacity, position, pad
        self.static_address = static_address  # (CUDA graphs: the buffers keep their address)
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write `keys`/`values` (rows, seq, heads, head_dim) at position ..; the whole buffers back."""
        if self.keys is None:
            shape = (keys.shape[0], self.capacity, *keys.shape[2:])
            self.keys, self.values = keys.new_zeros(shape), values.new_zeros(shape)
            if self.static_address:
                torch._dynamo.mark_static_address(self.keys)
                torch._dynamo.mark_static_address(self.values)
        at = self.position + torch.arange(keys.shape[1], device=keys.device)
        self.keys.index_copy_(1, at, keys)
        self.values.index_copy_(1, at, values)
        span = self.span(keys.shape[1])
        return self.keys[:, :span], self.values[:, :span]

    def span(self, new: int) -> int:
        """The positions attention reads when `new` tokens are written at `position`."""
        if self.static_address or self.position.device.type != "cpu":
            return self.capacity
        return int(self.position) + new

    def layout(self, rope, head_dim: int, tokens: torch.Tensor, hidden: torch.Tensor) -> AttentionLayout:
        """Each token rotated by its place after its row's padding; query i (position .. + i)
        sees its row's real keys up to itself (a padding query itself alone)."""
        device = tokens.device
        index = self.position + torch.arange(tokens.shape[1], device=device)
        places = (index[None, :] - self.pad[:, None]).clamp(min=0)
        cos, sin = rope.cos_sin(head_dim, 0, self.capacity, device)
        keys = torch.arange(self.span(tokens.shape[1]), device=device)[None, None, :]
        queries = index[None, :, None]
        seen = ((keys >= self.pad[:, None, None]) | (keys == queries)) & (keys <= queries)
        return AttentionLayout(cos[places], sin[places], additive_mask(seen, hidden)[:, None])


def prepare(model: nn.Module, capacity: int, device: torch.device) -> None:
    """The rotation table for every position the cache holds, made before the first forward."""
    model.rope.prepare(model.head_dim, capacity, device)


def _step(model: nn.Module, tokens: torch.Tensor, cache: List[StaticCache]) -> torch.Tensor:
    """The logits of `tokens` (rows, block: one new token a row, then block filler) at the new
    token, after the cache (the unit compiled_step compiles)."""
    return model(tokens, cache)[:, 0]


def compiled_step(device: torch.device):
    """torch.compile of the one-token step; on CUDA mode reduce-overhead (CUDA graphs)."""
    return torch.compile(_step, mode="reduce-overhead" if device.type == "cuda" else None, fullgraph=True)


def decoding_generators(seeds: List[int], device: torch.device) -> List[torch.Generator]:
    """One generator a prompt, seeded, on the device its draws are made on (CUDA's must be)."""
    return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


@torch.no_grad()
def generate_groups(model: nn.Module, prompts: List[List[int]], n: int, max_new_tokens: int, temperature: float,
                    top_p: float, generators: List[torch.Generator], stop: Set[int], pad_id: int,
                    device: Optional[torch.device] = None, stop_early: bool = True, block: int = 1,
                    last_only: bool = False, capacity: Optional[int] = None, step=None,
                    check_every: int = CHECK_EVERY, with_logps: bool = False):
    """`n` continuations of each of `prompts`, all decoded side by side with a static KV cache,
    prompt p's rows sampled from generators[p]: (tokens (prompts x n, max_new_tokens), prompt p's
    rows p*n .. p*n + n - 1, each ending at its first stop id and padded with pad_id after it;
    lengths (prompts x n,), the stop id counted), both on the device. Shorter prompts are
    left-padded to the longest, their padding rotated past and masked.
    `stop_early` False decodes all max_new_tokens positions even when every row has stopped: a
    model sharded over ranks (FSDP2) gathers its weights in every forward, so every rank must
    run as many; True looks every `check_every` tokens (one host sync each). `block` > 1 (a plan
    with sequence parallelism, whose forwards split the sequence over the TP ranks) feeds each
    forward a multiple of it: the tokens, then pad_id up to it, written after every real
    position (no real query sees them) and overwritten by the next. `last_only` (the output
    layer whole on this rank: no TP plan, no pipeline): the prompts' forward projects each row's
    last position alone (its hidden states, a forward with skip_output, through the model's
    output_layer), not every prompt position (2,048 of them over a 150k vocabulary: 1.2 GB of
    logits a row), as transformers' generate keeps one. `capacity`:
    the cache's positions (default the longest prompt + max_new_tokens + block; a fixed one
    keeps a compiled `step`'s shapes from one call to the next). `step`: compiled_step's, or
    None for the eager one-token step. A model with its own decoding (ModelProtocol.own_decoder:
    transformers' classes, their own cache) is sampled the same way, through it. `with_logps`:
    also each token's log-probability as it was drawn (next_tokens'; 0 after the stop), third."""
    longest = max(len(prompt) for prompt in prompts)
    first = torch.tensor([[pad_id] * (longest - len(prompt)) + prompt for prompt in prompts],
                         device=device).repeat_interleave(n, 0)
    pad = torch.tensor([longest - len(prompt) for prompt in prompts], device=device).repeat_interleave(n)
    own = offered(model).own_decoder(pad)
    if own is not None:  # (a model with its own cache: transformers' classes)
        return _sample_loop(lambda new: own(new[:, None]), own(first), max_new_tokens, temperature, top_p, generators,
                            stop, pad_id, check_every if stop_early else 0, with_logps)
    capacity = capacity or longest + max_new_tokens + block
    position = torch.zeros((), dtype=torch.int64, device=first.device)
    prepare(model, capacity, first.device)
    cache = [StaticCache(capacity, position, pad, static_address=step is not None) for _ in model.layers]
    output = offered(model).output_layer()

    def forward(tokens: torch.Tensor, one_step) -> torch.Tensor:
        filler = -tokens.shape[1] % block
        padded = torch.cat([tokens, tokens.new_full((len(tokens), filler), pad_id)], 1) if filler else tokens
        if one_step is not None:
            logits = one_step(model, padded, cache)
        elif last_only:  # the output layer on each row's last position alone
            logits = project(output, model(padded, cache, skip_output=True)[:, tokens.shape[1] - 1])
        else:
            logits = model(padded, cache)[:, tokens.shape[1] - 1]
        position.add_(tokens.shape[1])
        return logits

    logits = forward(first, None)
    return _sample_loop(lambda new: forward(new[:, None], step or _step), logits, max_new_tokens, temperature,
                        top_p, generators, stop, pad_id, check_every if stop_early else 0, with_logps)


def _sample_loop(forward, logits: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float,
                 generators: List[torch.Generator], stop: Set[int], pad_id: int, check_every: int,
                 with_logps: bool = False):
    """Draw, record and feed back one token a row until max_new_tokens, or (check_every > 0)
    until a look every check_every tokens finds every row stopped."""
    rows = len(logits)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.int64, device=logits.device)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=logits.device) if with_logps else None
    lengths = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    done = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    stops = torch.tensor(sorted(stop), dtype=torch.int64, device=logits.device)
    for position in range(max_new_tokens):
        drawn = next_tokens(logits, temperature, top_p, generators, with_logps)
        if with_logps:
            drawn, logp = drawn
            logps[:, position] = torch.where(done, 0.0, logp)
        new = torch.where(done, pad_id, drawn)
        tokens[:, position] = new
        lengths += (~done).long()
        done |= torch.isin(new, stops)
        last = position == max_new_tokens - 1
        if last or (check_every and (position + 1) % check_every == 0 and bool(done.all())):
            break
        logits = forward(new)
    return (tokens, lengths, logps) if with_logps else (tokens, lengths)


def stop_ids(model_dir: Optional[str], tokenizer) -> Set[int]:
    """The model's own end-of-text ids (generation_config.json, else config.json), else the tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(model_dir or "", name)
        if model_dir and os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {eos}
    return set() if tokenizer.eos_id is None else {tokenizer.eos_id}
