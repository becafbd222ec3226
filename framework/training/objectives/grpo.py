"""`objective=grpo`: Group Relative Policy Optimization (Shao et al. 2024; TRL's GRPOTrainer) on
prompts (data=prompts) with a reward (the `reward` group, framework.training.objectives.rewards).

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
(adapters_off, frozen_copy; framework.training.objectives.reference).
"""
from typing import Dict, List, Optional

import torch
from hydra.utils import instantiate
from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError, check_rules
from framework.data.batch import Batch
from framework.data.batch import IGNORE
from framework.training.objectives.base import Objective, StepShare, check_data_pairing
from framework.training.objectives.correction import (CORRECTION_METRICS, plain_sampling, sampling_logps,
                                                     truncated_weights)
from framework.training.objectives.head import OutputHead
from framework.training.objectives.logps import token_logps
from framework.training.objectives.reference import Reference, check_reference
from framework.training.objectives.rollout import ENVIRONMENT_METRICS, ROLLOUT_METRICS, GroupRollout

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
REFERENCES = ("adapters_off", "frozen_copy")


class GroupRelativePolicy(GroupRollout, Objective):
    kind = "grpo"
    headline = ("reward",)

    def __init__(self, group_size: int = 4, max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                 scale_rewards: str = "group", loss_type: str = "grpo", epsilon: float = 0.2,
                 epsilon_high: Optional[float] = None, beta: float = 0.0, reference: str = "adapters_off",
                 num_iterations: int = 1, compile_decode: Optional[bool] = None, max_staleness: int = 0,
                 sampling_correction: Optional[bool] = None, sampling_cap: float = 2.0,
                 aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_p, self.scale_rewards = temperature, top_p, scale_rewards
        self.loss_type, self.epsilon, self.beta = loss_type, epsilon, beta
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.num_iterations, self.compile_decode = num_iterations, compile_decode
        self.max_staleness, self.sampling_cap = max_staleness, sampling_cap
        # truncated importance sampling against the decoder's own log-probabilities (correction.py)
        self.correct = max_staleness > 0 if sampling_correction is None else sampling_correction
        self.step = None  # (setup: the compiled one-token decode step, where compile_decode)
        self.tp_group = None  # (setup: under TP, the group whose rank 0 scores the completions for all)
        self.environment = None  # (setup: environment=..., what answers completions between turns)
        self.reference = Reference(reference) if beta > 0 else None  # DPO's (beta 0: no KL term)
        self.select, self.head = False, OutputHead()  # (setup: the run's)
        self._rollout_terms: Dict[str, torch.Tensor] = {}
        self._kl: Optional[torch.Tensor] = None
        self._clipped: Optional[torch.Tensor] = None
        self._ratio: Optional[Dict[str, torch.Tensor]] = None  # (the sampling correction's sums, this micro-batch)
        self._ratio_max = torch.zeros((), dtype=torch.float64)  # (the step's largest ratio so far)
        self._samples = ""  # the last rollout's first group, as text
        self._cycle: Optional[tuple] = None  # num_iterations > 1: (the step it generated at, its batch, its terms)
        self.rollout_s: List[float] = []  # each step's seconds spent generating and scoring (this attempt)

    def setup(self, context) -> None:
        """The generation phase's (setup_rollout), the policy's OutputHead and the reference's."""
        self.setup_rollout(context)
        self.head = context.head  # the policy's logits at the completions' tokens alone, by chunks
        self.select = self.head.select
        if self.reference is not None:
            self.reference.setup(context)

    # -- the learning phase -------------------------------------------------------------

    def forward(self, model: nn.Module, batch: Batch):
        """The policy's logits of every completion (completions, seq_len, vocab; where the mesh
        allows, at the completions' tokens alone: the prompts' positions skip the output layer),
        their advantages, the reference's and the old policy's log-probabilities, a completion a row."""
        reference, old, sampled = (t.flatten(0, 1) if t is not None else None
                                   for t in (batch.reference, batch.old_logps, batch.sampled_logps))
        logits = self.head(model, batch.inputs.flatten(0, 1), batch.targets.flatten(0, 1), per_token=True)
        return logits, batch.advantages.flatten(), reference, old, sampled

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        logits, advantages, reference, old, sampled = outputs
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
        if sampled is not None:  # (TRL's order: the sampling correction weighs the policy term, not the KL)
            per_token = per_token * self._weights(logits, logps, sampled, targets)
        if self.beta > 0:
            kl = torch.exp(reference - logps) - (reference - logps) - 1
            per_token = per_token + self.beta * kl
            self._kl = (kl * mask).sum().detach()
        per_token = per_token * mask
        if self.loss_type == "grpo":
            return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
        return per_token.sum()

    def _weights(self, logits, logps: torch.Tensor, sampled: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sampling correction's truncated weights (framework.training.objectives.correction),
        the learner's side from this forward's logits; the ratio's sums kept for the step's terms."""
        with torch.no_grad():
            learner = logps if plain_sampling(self.temperature, self.top_p) else \
                sampling_logps(logits, targets, self.temperature, self.top_p)
            weights, self._ratio = truncated_weights(learner, sampled, targets, self.sampling_cap)
        return weights

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
            if self._ratio is not None:  # (each micro-batch's; its largest added as the rise over the step's so far)
                largest = torch.maximum(self._ratio_max, self._ratio["max"].double())
                step.add("sampling/ratio_max", largest - self._ratio_max)
                step.add("sampling/ratio_mean", self._ratio["sum"] / max(self._tokens, 1.0))
                step.add("sampling/truncated", self._ratio["truncated"] / max(self._tokens, 1.0))
                self._ratio_max, self._ratio = largest, None
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
            (ENVIRONMENT_METRICS if self.environment is not None else ()) + \
            (("staleness",) if self.max_staleness > 0 else ()) + (CORRECTION_METRICS if self.correct else ()) + \
            tuple(f"rewards/{name}" for name in (self.reward.curves() if self.reward is not None else ()))
        return {**super().logged_terms(model), **{name: name for name in names}}


def check_grpo(c: Checked) -> None:
    """Before launch: GRPO's data holds prompts (and prompts train under GRPO alone), its keys
    make sense, a reward is named, and every prompt leaves room for max_new_tokens in seq_len."""
    cfg = c.cfg
    objective, dataset = cfg.objective, cfg.data.dataset
    if not check_data_pairing(cfg, "prompts", (GroupRelativePolicy.kind,), "prompts", "prompts",
                              "FILE --prompt-field prompt [--answer-field answer]"):
        return
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
             ("compile_decode", lambda v: v in (None, True, False), "use true, false or null (null: on for cuda)"),
             ("max_staleness", lambda v: isinstance(v, int) and v >= 0,
              "must be a whole number >= 0 (updates the generating policy may lag; 0: synchronous)"),
             ("sampling_correction", lambda v: v in (None, True, False),
              "use true, false or null (null: on when objective.max_staleness > 0)"),
             ("sampling_cap", lambda v: v >= 1, "must be >= 1 (the truncation of the importance weights; TRL's: 2)")]
    check_rules(rules, objective.get, lambda key: f"objective.{key}")
    sharded = [what for what, on in (
        (f"parallel.dp_strategy={getattr(cfg.parallel.dp_strategy, 'value', cfg.parallel.dp_strategy)} shards it over the DP ranks",
         cfg.parallel.dp_strategy != "replicate"),
        (f"tensor parallelism splits it over {c.roles.tp_size} ranks", c.roles.tp_size > 1)) if on]
    if objective.compile_decode and sharded:
        raise ConfigError("objective.compile_decode", True, f"the compiled one-token decode step (one graph) needs the "
                                                            f"whole model on the rank, and {sharded[0]}; use "
                                                            f"parallel.dp_strategy=replicate without TP, or "
                                                            f"objective.compile_decode=null (off when sharded)")
    every = cfg.checkpoint.every
    if objective.num_iterations > 1 and every and every % objective.num_iterations:
        raise ConfigError("checkpoint.every", every, f"a checkpoint inside a rollout's "
                                                     f"objective.num_iterations={objective.num_iterations} steps "
                                                     f"would resume without that rollout; make it a multiple of "
                                                     f"{objective.num_iterations}")
    if objective.max_staleness > 0 and objective.num_iterations > 1:
        raise ConfigError("objective.num_iterations", objective.num_iterations,
                          f"learns from each rollout {objective.num_iterations} times, and "
                          f"objective.max_staleness={objective.max_staleness} already learns from rollouts of an "
                          f"older policy; use one of the two (num_iterations=1, or max_staleness=0)")
    correcting = objective.max_staleness > 0 if objective.sampling_correction is None else objective.sampling_correction
    plain = objective.temperature in (0, 1) and objective.top_p >= 1
    if correcting and not plain and (c.roles.tp_size > 1 or cfg.trainer.get("loss_chunk_tokens")):
        raise ConfigError("objective.sampling_correction", objective.sampling_correction,
                          f"weighs each token by the sampling distribution (temperature {objective.temperature}, "
                          f"top_p {objective.top_p}), which needs the whole logits on a rank, and "
                          f"{'tensor parallelism splits them' if c.roles.tp_size > 1 else 'trainer.loss_chunk_tokens scores by chunks'}; "
                          f"use temperature 1 and top_p 1, or objective.sampling_correction=false")
    check_reference(c, REFERENCES, used=objective.beta > 0, otherwise=", or objective.beta=0")
    data = instantiate(dataset, split="train")
    room = data.seq_len - objective.max_new_tokens
    if data.longest_prompt() > room:
        raise ConfigError("data.dataset.seq_len", data.seq_len,
                          f"the longest prompt in {data.path} has {data.longest_prompt()} tokens, and with "
                          f"objective.max_new_tokens={objective.max_new_tokens} a completion needs "
                          f"{data.longest_prompt() + objective.max_new_tokens}; raise seq_len or lower max_new_tokens")
