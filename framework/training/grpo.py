"""`objective=grpo`: Group Relative Policy Optimization (Shao et al. 2024; TRL's GRPOTrainer) on
prompts (data=prompts) with a reward (the `reward` group, framework.training.rewards).

Each step rolls out before it learns (`rollout`, called by the Trainer before the step's units
are counted): every DP replica continues each of its prompts `group_size` times with the model as
it trains (its own KV-cache decoding, framework.models.decode.generate_groups, all its prompts at
once, on the module the parallel stages made: FSDP2 shards gather as in any forward; with
`compile_decode`, null: on for CUDA without FSDP or TP, a compiled one-token step), sampled with temperature / top-p
from a generator (on the device) seeded by (trainer.seed, the step, the prompt's index in its dataset), so a
prompt draws the same completions on every mesh. The completions are scored, and each one's
advantage is its reward less its group's mean, over the group's std (`scale_rewards: group`),
the batch's (`batch`: over every DP replica) or nothing (`none`), as TRL computes them.

The loss is TRL's: per completion token, -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
with r = pi / pi_old, plus beta times the k3 estimate of the KL to a reference
(exp(ref - logp) - (ref - logp) - 1). With one policy update per rollout (num_iterations 1) the old
log-probabilities are the new ones detached: r is 1, its gradient the policy gradient. With
num_iterations k > 1 a rollout is learned from for k steps (TRL's mu), pi_old being the policy
as it generated (its log-probabilities taken then); the loader's prompts of the k - 1 steps
that reuse a rollout are passed over. The token sum is normalized by `loss_type`:
- grpo: each completion's mean over its tokens, averaged over the global batch's completions;
- dapo: the sum over the global batch's completion tokens over their number;
- dr_grpo: the sum over (completions x max_new_tokens), a constant.
Each is a sum over units (completions, tokens, completions x max_new_tokens) over the global
count of them: the same numbers on every mesh. The reference (beta > 0) is DPO's
(adapters_off, frozen_copy; framework.training.preference).
"""
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.data.batch import Batch
from framework.data.tokens import IGNORE, kind_of
from framework.models.decode import compiled_step, decoding_generators, generate_groups
from framework.models.protocol import offered
from framework.parallel.plan import shards_sequence
from framework.training.objectives import Objective, StepShare
from framework.training.chunked_loss import Projection, output_projection
from framework.training.preference import Reference, response_logits, reshard, token_logps

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
REFERENCES = ("adapters_off", "frozen_copy")
ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                   "completions/max_length", "completions/clipped_ratio", "clip_ratio")
STD_FLOOR = 1e-4  # TRL's: advantages over (std + this)


def sampling_seed(seed: int, step: int, index: int) -> int:
    """The seed of a prompt's completions at a step: a function of the three alone, the same on
    every mesh, after a resume and under any Python."""
    return ((seed * 1_000_003 + step) * 1_000_003 + index) % (1 << 62)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str,
                     batch_std: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rewards (completions,), each group's `group_size` in a row, less their group's mean, over
    the group's std (unbiased, as TRL's nanstd), `batch_std` or 1 (`scale`), plus STD_FLOOR."""
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()
    if scale == "none":
        return centred
    std = grouped.std(1).repeat_interleave(group_size) if scale == "group" else batch_std.expand_as(rewards)
    return centred / (std + STD_FLOOR)


class GroupRelativePolicy(Objective):
    def __init__(self, group_size: int = 4, max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                 scale_rewards: str = "group", loss_type: str = "grpo", epsilon: float = 0.2,
                 epsilon_high: Optional[float] = None, beta: float = 0.0, reference: str = "adapters_off",
                 num_iterations: int = 1, compile_decode: Optional[bool] = None,
                 aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_p, self.scale_rewards = temperature, top_p, scale_rewards
        self.loss_type, self.epsilon, self.beta = loss_type, epsilon, beta
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.num_iterations, self.compile_decode = num_iterations, compile_decode
        self.step = None  # (setup: the compiled one-token decode step, where compile_decode)
        self.tp_group = None  # (setup: under TP, the group whose rank 0 scores the completions for all)
        self.reference = Reference(reference) if beta > 0 else None  # DPO's (beta 0: no KL term)
        self.select, self.projection = False, Projection()  # (setup: output_projection)
        self._rollout_terms: Dict[str, torch.Tensor] = {}
        self._kl: Optional[torch.Tensor] = None
        self._clipped: Optional[torch.Tensor] = None
        self._samples = ""  # the last rollout's first group, as text
        self._cycle: Optional[tuple] = None  # num_iterations > 1: (the step it generated at, its batch, its terms)
        self.rollout_s: List[float] = []  # each step's seconds spent generating and scoring (this attempt)

    def setup(self, run) -> None:
        """The reward, the tokenizer that turns ids into the texts it scores, the stop ids, and
        frozen_copy's reference."""
        from framework.data.tokenizer import load_tokenizer
        from framework.generate import stop_ids
        from framework.training.rewards import make_reward

        self.reward = make_reward(run.cfg.reward)
        self.tokenizer = load_tokenizer(run.cfg.data.get("tokenizer") or run.dataset.documents.tokenizer["path"])
        self.stop = stop_ids(offered(run.module).hf_path, self.tokenizer)
        self.pad_id = run.dataset.pad_id
        self.seed, self.device = run.cfg.trainer.seed, torch.device(run.cfg.mesh.device_type)
        self.replicas, self.replica_group = run.dp_cp["size"], run.dp_cp_group
        if run.tp.get("size", 1) > 1:
            self.tp_group = run.roles.tp_mesh(run.mesh).get_group()
        self.sharded = run.cfg.parallel.dp_strategy != "replicate"
        self.micro_batch = run.cfg.data.micro_batch_size
        plan = OmegaConf.to_container(run.cfg.plan, resolve=True) if run.cfg.plan else {}
        self.block = run.tp.get("size", 1) if shards_sequence(plan) else 1  # (generate_groups' `block`)
        plain = not self.sharded and run.tp.get("size", 1) == 1
        if self.compile_decode if self.compile_decode is not None else self.device.type == "cuda" and plain:
            self.step = compiled_step(self.device)
        self.projection = output_projection(run)  # the policy's logits at the completions' tokens alone, by chunks
        self.select = self.projection.select
        if self.reference is not None:
            self.reference.setup(run)

    # -- the generation phase -----------------------------------------------------------

    @torch.no_grad()
    def rollout(self, model: nn.Module, batch: Batch, step: int) -> Batch:
        """The prompts' completions as a batch to learn from (`generated`), or with num_iterations
        k > 1, within k steps of the last rollout, that rollout again."""
        if self._cycle is not None and 0 < step - self._cycle[0] < self.num_iterations:
            start = time.perf_counter()
            _, rolled_out, self._rollout_terms = self._cycle
            self._rollout_terms = dict(self._rollout_terms)
            self.rollout_s.append(time.perf_counter() - start)
            return rolled_out
        rolled_out = self.generated(model, batch, step)
        if self.num_iterations > 1:
            self._cycle = (step, rolled_out, dict(self._rollout_terms))
        return rolled_out

    def generated(self, model: nn.Module, batch: Batch, step: int) -> Batch:
        """The prompts' completions as a batch to learn from, a prompt's group together as DPO's
        pairs are (so micro-batches count prompts and never part a group): inputs (prompts,
        group_size, seq_len) each prompt + completion (padded), targets the completion's tokens (the
        rest -100), each completion's advantage (prompts, group_size), with beta > 0 the
        reference's per-token log-probabilities, with num_iterations > 1 the policy's."""
        start = time.perf_counter()
        rows, answer_rows = batch.inputs.cpu(), batch.targets.cpu()
        prompts = [row[row != IGNORE].tolist() for row in rows]
        answers = [self.tokenizer.decode(row[row != IGNORE].tolist()) or None for row in answer_rows]
        width, n = batch.inputs.shape[1], self.group_size
        generators = decoding_generators([sampling_seed(self.seed, step, index) for index in batch.index.tolist()],
                                         self.device)
        model.eval()
        tokens, counts = generate_groups(model, prompts, n, self.max_new_tokens, self.temperature, self.top_p,
                                         generators, self.stop, self.pad_id, self.device,
                                         stop_early=not self.sharded, block=self.block, last_only=self.select,
                                         capacity=width + self.block if self.step else None, step=self.step)
        model.train()
        if self.sharded:
            reshard(model)
        tokens, counts = tokens.cpu(), counts.cpu()  # the decoder's one transfer
        inputs, targets, texts = self._sequences(prompts, tokens, counts, width)
        prompt_texts = [self.tokenizer.decode(p) for p in prompts for _ in range(n)]
        scores, curves = self._scored(prompt_texts, texts, [a for a in answers for _ in range(n)])
        rewards = torch.tensor(scores, dtype=torch.float64)
        advantages = group_advantages(rewards, n, self.scale_rewards, self._batch_std(rewards))
        self._note_rollout(rewards, curves, counts.double(), targets)
        self._samples = "\n\n".join(f"{prompt_text!r} -> {text!r} (reward {reward:.4g})"
                                     for prompt_text, text, reward in zip(prompt_texts[:n], texts[:n], rewards.tolist()))
        reference = old = None
        if self.reference is not None:
            reference = self._logps(lambda rows, counted: self.reference.logits(model, rows, counted), model, inputs,
                                    targets)
        if self.num_iterations > 1:
            old = self._logps(lambda rows, counted: response_logits(model, rows, counted, self.projection), model,
                              inputs, targets)
        self.rollout_s.append(time.perf_counter() - start)
        grouped = (len(prompts), n, width)
        return Batch(inputs.view(grouped), targets.view(grouped),
                     reference=reference.view(grouped) if reference is not None else None,
                     advantages=advantages.float().to(self.device).view(grouped[:2]),
                     old_logps=old.view(grouped) if old is not None else None)

    def _sequences(self, prompts: List[List[int]], tokens: torch.Tensor, counts: torch.Tensor,
                   width: int) -> Tuple[torch.Tensor, torch.Tensor, List[str]]:
        """Each prompt + completion as a row to learn from (inputs; targets the completion's
        tokens, the rest -100; on the device) and the completions' texts, made on the host from
        the decoder's tokens and lengths (moved once, not a sync per completion)."""
        n = self.group_size
        inputs = torch.full((len(prompts) * n, width), self.pad_id, dtype=torch.int64)
        targets = torch.full_like(inputs, IGNORE)
        texts = []
        for r, length in enumerate(counts.tolist()):
            prompt, completion = prompts[r // n], tokens[r, :length]
            sequence = torch.cat([torch.tensor(prompt, dtype=torch.int64), completion])
            inputs[r, :len(sequence) - 1] = sequence[:-1]
            targets[r, len(prompt) - 1:len(sequence) - 1] = completion
            texts.append(self.tokenizer.decode([t for t in completion.tolist() if t not in self.stop]))
        return inputs.to(self.device), targets.to(self.device), texts

    def _scored(self, prompts: List[str], completions: List[str],
                answers: List[Optional[str]]) -> Tuple[List[float], Dict[str, List[float]]]:
        """The completions' rewards and the reward's curves. Under TP every rank of a TP group
        holds the same completions: its rank 0 scores them and hands the scores to the rest, so a
        user's reward (which may call a compiler or a sandbox) runs once a replica; what it raises
        is raised on every rank of the group (none is left waiting)."""
        if self.tp_group is None:
            return self.reward(prompts, completions, answers), self.reward.curves()
        scored: List[object] = [None]
        if dist.get_rank(self.tp_group) == 0:
            try:
                scored = [(self.reward(prompts, completions, answers), self.reward.curves())]
            except Exception as error:  # noqa: BLE001 (handed to the group, raised below)
                scored = [error]
        dist.broadcast_object_list(scored, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        if isinstance(scored[0], Exception):
            raise scored[0]
        return scored[0]

    def _batch_std(self, rewards: torch.Tensor) -> Optional[torch.Tensor]:
        """scale_rewards=batch: the std of every replica's rewards (one all-reduce over DP)."""
        if self.scale_rewards != "batch":
            return None
        moments = torch.stack([rewards.sum(), (rewards ** 2).sum(), torch.tensor(float(rewards.numel()),
                                                                                 dtype=torch.float64)])
        if self.replicas > 1:
            moments = moments.to(self.device)
            dist.all_reduce(moments, group=self.replica_group)
            moments = moments.cpu()
        total, squares, count = moments
        return ((squares - total ** 2 / count) / (count - 1).clamp(min=1)).clamp(min=0).sqrt()

    def _note_rollout(self, rewards: torch.Tensor, curves: Dict[str, List[float]], lengths: torch.Tensor,
                      targets: torch.Tensor) -> None:
        """This replica's means of the rollout's metrics (the Trainer averages them over DP), and
        the longest completion of every replica (TRL's max_length: the global one)."""
        grouped = rewards.view(-1, self.group_size)
        self._rollout_terms = {
            "reward": rewards.mean(), "reward_std": grouped.std(1).mean(),
            "frac_reward_zero_std": torch.isclose(grouped.std(1), torch.zeros_like(grouped[:, 0])).double().mean(),
            "completions/mean_length": lengths.mean(), "completions/max_length": self._longest(lengths.max()),
            "completions/clipped_ratio": (lengths >= self.max_new_tokens).double().mean(),
            **{f"rewards/{name}": torch.tensor(scores, dtype=torch.float64).mean()
               for name, scores in curves.items()}}
        self._tokens = float((targets != IGNORE).sum())

    def _longest(self, length: torch.Tensor) -> torch.Tensor:
        """The longest completion over every DP replica (one all-reduce MAX: the same on all, so
        the Trainer's average over DP keeps it)."""
        if self.replicas > 1:
            length = length.to(self.device)
            dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.replica_group)
            length = length.cpu()
        return length

    def _logps(self, forward, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each completion token's log-probability (0 elsewhere) under `forward` (rows, their
        targets -> logits: the policy `model`'s or its reference's), in the step's micro-batches."""
        size, parts = (self.micro_batch or len(inputs)) * self.group_size, []
        for begin in range(0, len(inputs), size):
            rows, counted = inputs[begin:begin + size], targets[begin:begin + size]
            parts.append(token_logps(forward(rows, counted), counted))
        if self.sharded:
            reshard(model)
        return torch.cat(parts)

    # -- the learning phase -------------------------------------------------------------

    def forward(self, model: nn.Module, batch: Batch):
        """The policy's logits of every completion (completions, seq_len, vocab; where the mesh
        allows, at the completions' tokens alone: the prompts' positions skip the output layer),
        their advantages, the reference's and the old policy's log-probabilities, a completion a row."""
        reference, old = (t.flatten(0, 1) if t is not None else None for t in (batch.reference, batch.old_logps))
        logits = response_logits(model, batch.inputs.flatten(0, 1), batch.targets.flatten(0, 1), self.projection)
        return logits, batch.advantages.flatten(), reference, old

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        logits, advantages, reference, old = outputs
        targets = targets.flatten(0, -2)  # (prompts, group_size, seq_len): a completion a row
        mask = (targets != IGNORE).float()
        logps = token_logps(logits, targets)
        ratio = torch.exp(logps - (logps.detach() if old is None else old))  # (num_iterations 1: r = 1)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
        # TRL's clip_ratio/region_mean: tokens whose ratio left the clip range on the side that stops their gradient
        outside = ((ratio < 1 - self.epsilon) & (advantages[:, None] < 0)) | \
            ((ratio > 1 + self.epsilon_high) & (advantages[:, None] > 0))
        self._clipped = (outside.float() * mask).sum().detach()
        if self.beta > 0:
            kl = torch.exp(reference - logps) - (reference - logps) - 1
            per_token = per_token + self.beta * kl
            self._kl = (kl * mask).sum().detach()
        per_token = per_token * mask
        if self.loss_type == "grpo":
            return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
        return per_token.sum()

    def __call__(self, outputs, targets, model, step: StepShare):
        """The share of the step's loss, and the step's metrics: the rollout's (once a step) and
        the KL over the replica's completion tokens, which summed over micro-batches and averaged
        over DP are the global batch's means."""
        total = super().__call__(outputs, targets, model, step)
        if step.tokens is not None:
            for name, value in self._rollout_terms.items():
                step.add(name, value.float().to(total.device))
            self._rollout_terms = {}
            step.add("clip_ratio", self._clipped / max(self._tokens, 1.0))
            if self._kl is not None:
                step.add("kl", self._kl / max(self._tokens, 1.0))
        return total

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """The completions (grpo), their tokens (dapo) or completions x max_new_tokens (dr_grpo)."""
        if self.loss_type == "dapo":
            return (targets != IGNORE).sum()
        return torch.tensor(self.fixed_count(targets), device=targets.device)

    def count_is_fixed(self, dataset) -> bool:
        return self.loss_type != "dapo"

    def fixed_count(self, targets: torch.Tensor) -> int:
        return targets[..., 0].numel() * (self.max_new_tokens if self.loss_type == "dr_grpo" else 1)

    def forwarded_tokens(self, batch: Batch) -> int:
        """Each prompt's group_size sequences (prompt + completion, the prompt's width): the learning forward's."""
        return batch.inputs.numel() * self.group_size

    def held_bytes(self) -> Dict[str, int]:
        return {"reference": self.reference.held_bytes() if self.reference is not None else 0}

    def logged_text(self) -> Dict[str, str]:
        """The last rollout's first prompt with its completions and their rewards."""
        return {"completions": self._samples} if self._samples else {}

    def summary(self) -> Dict[str, object]:
        """Each step's seconds spent generating, scoring and taking the reference's log-probabilities
        (rank 0's; the rest of step_times_s is learning)."""
        return {"rollout_s": self.rollout_s}

    def logged_terms(self, model: nn.Module) -> Dict[str, str]:
        names = ROLLOUT_METRICS + (("kl",) if self.beta > 0 else ()) + \
            tuple(f"rewards/{name}" for name in self.reward.curves())
        return {**super().logged_terms(model), **{name: name for name in names}}


GRPO = f"{__name__}.GroupRelativePolicy"


def check_grpo(c: Checked) -> None:
    """Before launch: GRPO's data holds prompts (and prompts train under GRPO alone), its keys
    make sense, a reward is named, and every prompt leaves room for max_new_tokens in seq_len."""
    from hydra.utils import instantiate

    cfg = c.cfg
    objective, dataset = cfg.objective, cfg.data.dataset
    prompts = kind_of(dataset) == "prompts"
    grpo = objective.get("_target_") == GRPO
    if prompts and not grpo:
        raise ConfigError("objective", objective.get("_target_"), "prompts (data=prompts) train under objective=grpo")
    if not grpo:
        return
    if not prompts:
        raise ConfigError("objective", "grpo", f"needs prompts, and data.dataset is "
                                               f"{dataset.get('_target_') if dataset else None}; prepare them with "
                                               f"framework.prepare FILE --prompt-field prompt [--answer-field answer] "
                                               f"and use data=prompts")
    rules = [("group_size", lambda v: v >= 2, "must be >= 2: advantages compare completions of one prompt"),
             ("max_new_tokens", lambda v: v >= 1, "must be >= 1"),
             ("temperature", lambda v: v >= 0, "must be >= 0 (0: greedy, every completion of a group the same)"),
             ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
             ("loss_type", lambda v: v in LOSS_TYPES, f"use one of {', '.join(LOSS_TYPES)}"),
             ("scale_rewards", lambda v: v in SCALE_REWARDS, f"use one of {', '.join(SCALE_REWARDS)}"),
             ("epsilon", lambda v: v > 0, "must be > 0"),
             ("epsilon_high", lambda v: v is None or v >= objective.epsilon, "must be >= objective.epsilon (or null)"),
             ("beta", lambda v: v >= 0, "must be >= 0 (0: no KL term, no reference)"),
             ("num_iterations", lambda v: v >= 1, "must be >= 1 (policy updates per rollout)"),
             ("compile_decode", lambda v: v in (None, True, False), "use true, false or null (null: on for cuda)")]
    for key, allowed, rule in rules:
        if not allowed(objective.get(key)):
            raise ConfigError(f"objective.{key}", objective.get(key), rule)
    every = cfg.checkpoint.every
    if objective.num_iterations > 1 and every and every % objective.num_iterations:
        raise ConfigError("checkpoint.every", every, f"a checkpoint inside a rollout's "
                                                     f"objective.num_iterations={objective.num_iterations} steps "
                                                     f"would resume without that rollout; make it a multiple of "
                                                     f"{objective.num_iterations}")
    if objective.beta > 0:
        if objective.reference not in REFERENCES:
            raise ConfigError("objective.reference", objective.reference, f"use one of {', '.join(REFERENCES)}")
        if objective.reference == "adapters_off" and cfg.adapter.kind == "none":
            raise ConfigError("objective.reference", "adapters_off", "is the base model with the adapters off, and "
                                                                     "this run has none (adapter=none); use "
                                                                     "adapter=lora, or objective.reference="
                                                                     "frozen_copy, or objective.beta=0")
    data = instantiate(dataset, split="train")
    room = data.seq_len - objective.max_new_tokens
    if data.longest_prompt() > room:
        raise ConfigError("data.dataset.seq_len", data.seq_len,
                          f"the longest prompt in {data.path} has {data.longest_prompt()} tokens, and with "
                          f"objective.max_new_tokens={objective.max_new_tokens} a completion needs "
                          f"{data.longest_prompt() + objective.max_new_tokens}; raise seq_len or lower max_new_tokens")
