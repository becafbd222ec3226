"""The preference objectives, TRL's preference trainers: each learns which of a prompt's
responses is better rather than the text itself.

- `objective=dpo`, DirectPreference: Direct Preference Optimization (Rafailov et al. 2023, TRL's
  DPOTrainer) on preference pairs (framework.data.PreferenceDataset: each sample a prompt +
  chosen and the same prompt + rejected). With each response's log-ratio to the reference summed
  over its tokens, and m = beta x (the chosen one's - the rejected one's), a pair's loss per
  `loss_type` (TRL 1.16's DPOTrainer._compute_loss):
    sigmoid  -log sigmoid(m); with label_smoothing e, (1 - e) times that plus e times the same of
             the swapped pair (conservative DPO: TRL's sigmoid before 1.0; 1.16's ignores e);
    ipo      ((the chosen log-ratio / its tokens - the rejected one / its tokens) - 1 / (2 beta))^2:
             TRL's IPO averages each response's log-ratio over its tokens (its authors' form);
    hinge    relu(1 - m) (SLiC);
    robust   (-(1 - e) log sigmoid(m) + e log sigmoid(-m)) / (1 - 2e) (labels flipped with
             probability e = label_smoothing, unbiased).
- `objective=simpo`, SimplePreference: SimPO (Meng et al. 2024, TRL's CPOTrainer with
  loss_type=simpo and cpo_alpha=0) on the same pairs, with no reference: each response's
  log-probability averaged over its tokens, m = beta x (chosen's - rejected's) - gamma, gamma =
  gamma_beta_ratio x beta, and the loss sigmoid's above (label_smoothing as CPOTrainer's).
- `objective=kto`, KahnemanTversky: KTO (Ethayarajh et al. 2024, TRL's KTOTrainer, loss_type=kto)
  on unpaired examples (framework.data.UnpairedPreferenceDataset), each a prompt + response
  labelled desirable or not: with r the response's log-ratio to the reference (summed) and z the
  global batch's KL estimate (below), a desirable example's loss is desirable_weight x (1 -
  sigmoid(beta (r - z))), an undesirable one's undesirable_weight x (1 - sigmoid(beta (z - r))).
  z is TRL's estimate, not its APO-free z = 0: the mean over the batch's examples of the
  policy's log-probability less the reference's, of each prompt with another example's response
  (the dataset's row 1), detached and clamped at 0. TRL takes it per device batch, gathered over
  processes; here it is the global batch's, taken before the step's micro-batches (`rollout`),
  so micro-batching does not change it.

Each one's unit is the sample (a pair, an example): the step's loss is the sum over the global
batch's samples over their number, on every mesh and with micro-batches, as the lm objective's is
over tokens.

DPO's and KTO's reference (objective.reference) is the model training started from, never trained:
- `adapters_off` (with adapter=lora / qlora): the policy itself with its adapters skipped, no
  second copy of the weights (TRL's and torchtune's choice);
- `frozen_copy`: a second model built from the same source (the seed, the Hugging Face files or
  checkpoint.init_from) and sharded as the policy (its TP plan, fsdp / hsdp), frozen: no
  gradients and no optimizer state, its parameter bytes again;
- `precomputed`: each sample's reference log-probabilities (its two sequences'), computed once
  before the first step (the model as training starts, adapters off) over the train and val
  splits and stored beside the prepared data (`<data.path>/reference_logps/<id>-<split>.npy`,
  the id naming the base model and what changes the numbers); later runs read them, and a step
  runs no reference.
A logging step shows TRL's metrics (global-batch means): rewards/chosen, rewards/rejected
(beta times each response's log-ratio to the reference; SimPO's: to nothing, its averaged
log-probability), rewards/margins, rewards/accuracies (the share of pairs whose chosen reward
is the larger), logps/chosen, logps/rejected; KTO's are means over the desirable (chosen) and the
undesirable (rejected) examples, with kl, and no accuracies (nothing is paired).
"""
import sys
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.config.errors import ConfigError, check_rules
from framework.config.checked import Checked
from framework.data.batch import Batch
from framework.data.token_files import read_meta
from framework.parallel.dtensors import reshard
from framework.parallel.plan import final_output_layout
from framework.training.objectives.base import Objective, StepShare, check_data_pairing, objective_kind
from framework.training.objectives.head import OutputHead
from framework.training.objectives.logps import response_lengths, sequence_logps
from framework.training.objectives.reference import Reference, check_precomputed, check_reference

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")  # DPO's
SMOOTHED = ("sigmoid", "robust")  # the loss types that read label_smoothing
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def smoothed_sigmoid(margin: torch.Tensor, e: float) -> torch.Tensor:
    """-log sigmoid(margin), the labels trusted with probability 1 - e (conservative DPO, CPO)."""
    return -F.logsigmoid(margin) * (1 - e) - F.logsigmoid(-margin) * e


def pair_losses(loss_type: str, beta: float, e: float, logratios: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each pair's DPO loss of `loss_type` (the module's docstring), from its responses' log-ratios
    to the reference (pairs, 2: chosen, rejected), each summed over its `lengths` tokens."""
    rewards = beta * logratios
    margin = rewards[:, 0] - rewards[:, 1]  # beta x the log-ratio margin
    if loss_type == "sigmoid":
        return smoothed_sigmoid(margin, e)
    if loss_type == "robust":
        return (-(1 - e) * F.logsigmoid(margin) + e * F.logsigmoid(-margin)) / (1 - 2 * e)
    if loss_type == "hinge":
        return torch.relu(1 - margin)
    if loss_type == "ipo":
        per_token = logratios / lengths
        return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    raise ValueError(f"objective.loss_type={loss_type!r}: use one of {', '.join(LOSS_TYPES)}")


def pair_inputs(batch) -> Dict[str, torch.Tensor]:
    """A batch of pairs' model inputs besides the tokens, a row per sequence: each pair's images
    for both its rows (data=vision_preferences; the tower runs on each), per-token inputs
    flattened as the tokens are."""
    rows = batch.inputs.shape[1]
    return {name: value.repeat_interleave(rows, 0) if name in ("pixels", "image_counts") else value.flatten(0, 1)
            for name, value in batch.model_inputs().items()}


class PreferenceObjective(Objective):
    """What the preference objectives share: a sample (a pair, an example) is the unit and every
    one counts; loss_sum keeps the sample's metrics as sums (`_sums`), which the step adds up
    over its units, as its loss."""
    metrics: Tuple[str, ...] = METRICS
    reference: Optional[Reference] = None

    def __init__(self, aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self._sums: Dict[str, torch.Tensor] = {}
        self.head = OutputHead()  # the responses' logits alone, by chunks (setup: the run's)

    def setup(self, context) -> None:
        self.head = context.head
        if self.reference is not None:
            self.reference.setup(context)

    def __call__(self, outputs, targets, model, step: StepShare):
        """The share of the step's loss (as every objective's), and the metrics over the same
        units (the step's samples per replica), so summed over micro-batches and averaged over DP
        they are the global batch's means."""
        total = super().__call__(outputs, targets, model, step)
        if step.tokens is not None:
            for name, value in self._sums.items():
                step.add(name, value / step.units)
        return total

    def _keep_pairs(self, rewards: torch.Tensor, logps: torch.Tensor) -> None:
        """A pair objective's metrics, from each pair's rewards and log-probabilities (pairs, 2)."""
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        values = (chosen, rejected, chosen - rejected, (chosen > rejected).float(), logps[:, 0], logps[:, 1])
        self._sums = {name: value.detach().sum() for name, value in zip(METRICS, values)}

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.shape[0], device=targets.device)

    def fixed_count(self, targets: torch.Tensor) -> int:
        return targets.shape[0]  # every sample counts

    def held_bytes(self) -> Dict[str, int]:
        return {"reference": self.reference.held_bytes()} if self.reference is not None else {}

    def logged_terms(self, model: nn.Module) -> Dict[str, str]:
        return {**super().logged_terms(model), **{name: name for name in self.metrics}}


class DirectPreference(PreferenceObjective):
    """objective=dpo, its loss types (the module's docstring)."""
    kind = "dpo"

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, reference: str = "adapters_off",
                 loss_type: str = "sigmoid", aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.reference = Reference(reference)

    def forward(self, model: nn.Module, batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """The policy's logits for every sequence of the pairs (chosen, rejected, ...), and the
        reference's log-probabilities of each pair's two (pairs, 2)."""
        extra = pair_inputs(batch)
        reference = self.reference.logps(model, batch.inputs, batch.targets, batch.reference, **extra)
        policy = self.head(model, batch.inputs.flatten(0, 1), batch.targets.flatten(0, 1), per_token=True, **extra)
        return policy, reference

    def loss_sum(self, outputs: Tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        logits, reference = outputs
        policy = sequence_logps(logits, targets.flatten(0, 1)).view(-1, 2)
        logratios = policy - reference
        losses = pair_losses(self.loss_type, self.beta, self.label_smoothing, logratios, response_lengths(targets))
        self._keep_pairs(self.beta * logratios, policy)
        return losses.sum()


class SimplePreference(PreferenceObjective):
    """objective=simpo: DPO's pairs without a reference (the module's docstring)."""
    kind = "simpo"

    def __init__(self, beta: float = 2.0, gamma_beta_ratio: float = 0.5, label_smoothing: float = 0.0,
                 aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self.beta, self.gamma_beta_ratio, self.label_smoothing = beta, gamma_beta_ratio, label_smoothing

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        """The policy's logits for every sequence of the pairs: no reference."""
        return self.head(model, batch.inputs.flatten(0, 1), batch.targets.flatten(0, 1), per_token=True,
                         **pair_inputs(batch))

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        average = sequence_logps(outputs, targets.flatten(0, 1), average=True).view(-1, 2)
        rewards = self.beta * average
        margin = rewards[:, 0] - rewards[:, 1] - self.gamma_beta_ratio * self.beta
        self._keep_pairs(rewards, average)
        return smoothed_sigmoid(margin, self.label_smoothing).sum()


class KahnemanTversky(PreferenceObjective):
    """objective=kto on unpaired examples (the module's docstring)."""
    kind = "kto"
    metrics = KTO_METRICS

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 reference: str = "adapters_off", aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.reference = Reference(reference)
        self.labels: Optional[torch.Tensor] = None  # the prepared set's, by example (setup)
        self.replicas, self.replica_group, self.micro_batch = 1, None, None
        self._step: Optional[torch.Tensor] = None  # the step's KL estimate and counts (rollout)

    def setup(self, context) -> None:
        """The reference, the examples' labels (the samples carry their index), the DP group."""
        super().setup(context)
        labels = np.asarray(context.dataset.labels, dtype=np.bool_)
        self.labels = torch.from_numpy(labels).to(context.device.type)
        self.replicas, self.replica_group = context.replicas.size, context.replicas.group
        self.micro_batch = context.cfg.data.micro_batch_size

    def rollout(self, model: nn.Module, batch: Batch, step: int) -> Batch:
        """The loader's batch; the step's KL estimate, from the whole of it before the micro-batches."""
        self._step = self.estimate(model, batch)
        return batch

    @torch.no_grad()
    def estimate(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """(z, examples, desirable examples) of the global batch, z being KTO's KL estimate: the
        mean over the examples of the policy's log-probability of row 1 (the prompt with another
        example's response) less the reference's, clamped at 0; the sums over every DP replica.
        Its forwards go by micro-batches (data.micro_batch_size), as the step's."""
        sums = torch.zeros(3, dtype=torch.float64, device=batch.inputs.device)
        for part in batch.split(self.micro_batch or len(batch.inputs)):
            inputs, targets = part.inputs[:, 1], part.targets[:, 1]
            policy = sequence_logps(self.head(model, inputs, targets, per_token=True), targets)
            stored = part.reference[:, 1] if part.reference is not None else None
            reference = self.reference.logps(model, inputs, targets, stored)
            labels = self.labels_of(part)
            sums += torch.stack([(policy - reference).double().sum(), torch.ones_like(labels, dtype=torch.float64).sum(),
                                 labels.double().sum()])
        reshard(model)
        if self.replicas > 1:
            dist.all_reduce(sums, group=self.replica_group)
        return torch.stack([(sums[0] / sums[1]).clamp(min=0), sums[1], sums[2]]).float()

    def forward(self, model: nn.Module, batch: Batch):
        """The policy's logits of each example (row 0), the reference's log-probabilities of them,
        their labels, and the batch's KL estimate and counts: the step's (rollout), or in
        evaluation, which has no rollout, the held-out batch's own."""
        step = self._step if model.training else self.estimate(model, batch)
        stored = batch.reference[:, 0] if batch.reference is not None else None
        reference = self.reference.logps(model, batch.inputs[:, 0], batch.targets[:, 0], stored)
        return (self.head(model, batch.inputs[:, 0], batch.targets[:, 0], per_token=True), reference,
                self.labels_of(batch), step)

    def labels_of(self, batch: Batch) -> torch.Tensor:
        """The batch's examples' labels, by their index in the prepared set."""
        if self.labels is None:
            raise RuntimeError("objective=kto: no labels (the objective's setup reads the dataset's before training)")
        return self.labels[batch.index]

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        logits, reference, labels, (kl, examples, desirable) = outputs
        policy = sequence_logps(logits, targets[:, 0])
        logratios = policy - reference
        chosen = self.desirable_weight * (1 - torch.sigmoid(self.beta * (logratios - kl)))
        rejected = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - logratios)))
        self._keep_examples(self.beta * logratios, policy, labels, kl, examples, desirable)
        return torch.where(labels, chosen, rejected).sum()

    def _keep_examples(self, rewards, logps, labels, kl, examples, desirable) -> None:
        """TRL's metrics: means over the global batch's desirable (chosen) and undesirable
        (rejected) examples, each example's value scaled by the global count of examples over that
        of its kind, so the step's sum over all examples makes the kind's mean (0 when it has none)."""
        scale = torch.where(labels, examples / desirable.clamp(min=1), examples / (examples - desirable).clamp(min=1))
        chosen, rejected = labels.float() * scale, (~labels).float() * scale
        values = ((rewards * chosen).sum(), (rewards * rejected).sum(), (rewards * (chosen - rejected)).sum(),
                  (logps * chosen).sum(), (logps * rejected).sum(), kl * len(labels))
        self._sums = {name: value.detach() for name, value in zip(KTO_METRICS, values)}


def check_preference(c: Checked) -> None:
    """Before launch: pairs train under DPO or SimPO, whose data holds pairs, whose keys make
    sense, and whose reference (DPO's) exists."""
    cfg, objective, kind = c.cfg, c.cfg.objective, objective_kind(c.cfg)
    if not check_data_pairing(cfg, "preference", (DirectPreference.kind, SimplePreference.kind), "preference pairs",
                              "preferences", "--prompt-field --chosen-field --rejected-field",
                              also_under=(KahnemanTversky.kind,)):
        return
    if kind == DirectPreference.kind:
        check_reference(c)
        loss_type = objective.get("loss_type")
        _check_rules(objective, [
            ("beta", lambda v: v > 0, "must be > 0"),
            ("loss_type", lambda v: v in LOSS_TYPES, f"use one of {', '.join(LOSS_TYPES)}"),
            ("label_smoothing", lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
            ("label_smoothing", lambda v: loss_type in SMOOTHED or v == 0,
             f"objective.loss_type={loss_type} ignores it (only {' and '.join(SMOOTHED)} read it); set it to 0, or "
             f"use loss_type=robust for labels flipped with this probability")])
        check_precomputed(cfg)
    else:
        _check_rules(objective, [("beta", lambda v: v > 0, "must be > 0"),
                                 ("gamma_beta_ratio", lambda v: v >= 0, "must be >= 0 (the margin over beta)"),
                                 ("label_smoothing", lambda v: 0 <= v < 0.5, "must be in [0, 0.5)")])
    _check_mesh(c, kind)


def check_unpaired(c: Checked) -> None:
    """Before launch: unpaired preference data trains under KTO, whose data is unpaired, whose
    keys make sense, and whose reference exists; TRL's advice on the weights, as a warning."""
    cfg, objective = c.cfg, c.cfg.objective
    if not check_data_pairing(cfg, "unpaired", (KahnemanTversky.kind,), "unpaired preference data", "kto",
                              "--prompt-field --response-field --label-field", plural=False):
        return
    check_reference(c)
    _check_rules(objective, [("beta", lambda v: v > 0, "must be > 0"),
                             ("desirable_weight", lambda v: v > 0, "must be > 0"),
                             ("undesirable_weight", lambda v: v > 0, "must be > 0")])
    check_precomputed(cfg)
    _check_mesh(c, "kto")
    _warn_unbalanced(objective, read_meta(cfg.data.dataset.path))


def _check_rules(objective, rules) -> None:
    check_rules(rules, objective.get, lambda key: f"objective.{key}")


def _check_mesh(c: Checked, name: str) -> None:
    """Whole logits: each sequence's log-probabilities are summed from them (the mesh dims not
    yet composed are framework/not_yet.py's)."""
    roles = c.roles
    output = c.plan.get("output")
    if roles.tp_size > 1 and output and not final_output_layout(output)[1]:
        raise ConfigError("plan.output.use_local_output", False, f"{name.upper()} sums each sequence's "
                                                                 f"log-probabilities from whole logits, not vocabulary "
                                                                 f"shards (loss_parallel); use a plan whose output is "
                                                                 f"gathered, e.g. lm_tp_sp")


def _warn_unbalanced(objective, meta: dict) -> None:
    """TRL's advice when the data holds more of one kind: desirable_weight x desirable examples
    over undesirable_weight x undesirable ones in [1, 1.33] (Eq. 8 of the KTO paper). One warning
    line outside it."""
    desirable, examples = meta.get("desirable"), meta["documents"]
    if desirable is None or not 0 < desirable < examples or 2 * desirable == examples:
        return
    undesirable = examples - desirable
    ratio = objective.desirable_weight * desirable / (objective.undesirable_weight * undesirable)
    if not 1 <= ratio <= 1.33:
        low = objective.undesirable_weight * undesirable / desirable
        print(f"warning: objective.desirable_weight={objective.desirable_weight}: the data holds {desirable} desirable "
              f"and {undesirable} undesirable examples, and TRL advises desirable_weight x desirable / "
              f"(undesirable_weight x undesirable) in [1, 1.33] (it is {ratio:.2f}): e.g. desirable_weight in "
              f"[{low:.2f}, {1.33 * low:.2f}]", file=sys.stderr)
