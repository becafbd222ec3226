"""The preference-loss family beside DPO (framework.training.objectives.preference): objective.loss_type of
objective=dpo (ipo, hinge, robust), objective=simpo and objective=kto, each against TRL 1.16's
formula written out here (DPOTrainer._compute_loss, CPOTrainer.cpo_loss with loss_type=simpo,
KTOTrainer._compute_loss) on fixed log-probabilities; their refusals before launch; KTO's
unpaired data as framework.prepare writes it; and a short run of each new objective."""
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.data import UnpairedPreferenceDataset
from framework.data.batch import Batch
from framework.launch.local import launch_local
from framework.prepare import main as prepare
from framework.training.objectives.base import StepShare
from framework.training.objectives.preference import DirectPreference, KahnemanTversky, SimplePreference
from tests.conftest import compose_config
from tests.test_dpo import dpo_overrides, pairs, read_scalars  # noqa: F401 (pairs: a fixture)

PAIRS, SEQ, VOCAB = 5, 9, 7
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def fixed(seed: int):
    """Logits and targets of 2 x PAIRS sequences (a prompt of 1 to 3 ignored targets, then 1 to
    5 response targets, then padding) and reference log-probabilities (PAIRS, 2)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=generator)
    targets = torch.full((2 * PAIRS, SEQ), -100)
    for row in range(2 * PAIRS):
        prompt, response = 1 + row % 3, 1 + (row * 7) % 5
        targets[row, prompt:prompt + response] = torch.randint(VOCAB, (response,), generator=generator)
    reference = -10 * torch.rand(PAIRS, 2, generator=generator)
    return logits, targets, reference


def token_logps(logits: torch.Tensor, targets: torch.Tensor):
    """Each sequence's response log-probabilities summed, and its response tokens (TRL's
    completion_mask summed)."""
    mask = targets != -100
    picked = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def trl_dpo(loss_type: str, beta: float, label_smoothing: float, logits, targets, reference) -> torch.Tensor:
    """TRL 1.16 DPOTrainer._compute_loss (f_divergence_type=reverse_kl), the batch [chosen, rejected]:
    trl/trainer/dpo_trainer.py of trl 1.16.0 as installed here (lines 1387-1431). Its sigmoid does
    not read label_smoothing (DPOConfig: "used in Robust DPO and EXO")."""
    logps, lengths = token_logps(logits, targets)
    chosen_logps, rejected_logps = logps[0::2], logps[1::2]
    chosen_logratios = chosen_logps - reference[:, 0]
    rejected_logratios = rejected_logps - reference[:, 1]
    delta_score = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)
    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)
    elif loss_type == "ipo":
        chosen_avg_score = chosen_logratios / lengths[0::2].clamp(min=1.0)
        rejected_avg_score = rejected_logratios / lengths[1::2].clamp(min=1.0)
        per_sequence_loss = (chosen_avg_score - rejected_avg_score - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
    return per_sequence_loss.mean()


def step_of(objective, outputs, targets, model=torch.nn.Identity()):
    """The objective's loss for a step of this one micro-batch, and the terms it logs."""
    step = StepShare(units=float(targets.shape[0]))
    return objective(outputs, targets, model, step), {name: value.item() for name, value in step.terms.items()}


def conservative_dpo(beta: float, e: float, logits, targets, reference) -> torch.Tensor:
    """Conservative DPO (Mitchell 2023; TRL's sigmoid before 1.0; 1.16's trl.experimental CPOTrainer sigmoid):
    each label trusted with probability 1 - e, (1 - e) x -log sigmoid(m) + e x -log sigmoid(-m)."""
    logps, _ = token_logps(logits, targets)
    margin = beta * ((logps[0::2] - reference[:, 0]) - (logps[1::2] - reference[:, 1]))
    return (-(1 - e) * F.logsigmoid(margin) - e * F.logsigmoid(-margin)).mean()


def test_sigmoid_with_label_smoothing_is_conservative_dpo_where_trl_1_16_ignores_it():
    """The framework's sigmoid reads label_smoothing as conservative DPO (framework.training.
    preference's docstring, docs/dpo.md); TRL 1.16's DPOTrainer sigmoid ignores it, so the two part
    here: at e = 0.2 ours is conservative DPO by hand and not TRL 1.16's."""
    beta, e = 0.3, 0.2
    logits, targets, reference = fixed(0)
    objective = DirectPreference(beta=beta, label_smoothing=e, loss_type="sigmoid")
    loss, _ = step_of(objective, (logits, reference), targets.view(PAIRS, 2, SEQ))
    torch.testing.assert_close(loss, conservative_dpo(beta, e, logits, targets, reference), **TOLERANCE)
    assert abs(float(loss) - float(trl_dpo("sigmoid", beta, e, logits, targets, reference))) > 1e-2


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0),
                                                       ("robust", 0.0), ("robust", 0.2)])
def test_each_dpo_loss_type_is_trl_s(loss_type, label_smoothing):
    beta = 0.3
    logits, targets, reference = fixed(0)
    objective = DirectPreference(beta=beta, label_smoothing=label_smoothing, loss_type=loss_type)
    loss, terms = step_of(objective, (logits, reference), targets.view(PAIRS, 2, SEQ))
    expected = trl_dpo(loss_type, beta, label_smoothing, logits, targets, reference)
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    logps, _ = token_logps(logits, targets)
    chosen, rejected = beta * (logps[0::2] - reference[:, 0]), beta * (logps[1::2] - reference[:, 1])
    for name, value in {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),  # TRL's, every
                        "rewards/margins": (chosen - rejected).mean(), "logps/chosen": logps[0::2].mean(),  # loss type
                        "rewards/accuracies": (chosen > rejected).float().mean()}.items():
        assert terms[name] == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name


def test_ipo_differs_from_a_summed_ipo_where_the_lengths_differ():
    """TRL's IPO averages each response's log-ratio over its tokens (not the paper's sums)."""
    logits, targets, reference = fixed(1)
    objective = DirectPreference(beta=0.3, loss_type="ipo")
    loss = objective.loss_sum((logits, reference), targets.view(PAIRS, 2, SEQ)) / PAIRS
    logps, _ = token_logps(logits, targets)
    summed = ((logps[0::2] - reference[:, 0]) - (logps[1::2] - reference[:, 1]) - 1 / 0.6) ** 2
    assert abs(loss.item() - summed.mean().item()) > 1e-2


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_is_trl_s_cpo_trainer_with_loss_type_simpo(label_smoothing):
    beta, gamma_beta_ratio = 2.0, 0.5
    logits, targets, _ = fixed(2)
    objective = SimplePreference(beta=beta, gamma_beta_ratio=gamma_beta_ratio, label_smoothing=label_smoothing)
    loss, terms = step_of(objective, logits, targets.view(PAIRS, 2, SEQ))
    # TRL 1.16 CPOTrainer: get_batch_logps(average_log_prob=True) for simpo, then cpo_loss (alpha=0)
    logps, lengths = token_logps(logits, targets)
    policy_chosen_logps, policy_rejected_logps = logps[0::2] / lengths[0::2], logps[1::2] / lengths[1::2]
    simpo_gamma = gamma_beta_ratio * beta
    cpo_logits = (policy_chosen_logps - policy_rejected_logps) - simpo_gamma / beta
    losses = (-F.logsigmoid(beta * cpo_logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * cpo_logits) * label_smoothing)
    torch.testing.assert_close(loss, losses.mean(), **TOLERANCE)
    chosen_rewards, rejected_rewards = beta * policy_chosen_logps, beta * policy_rejected_logps
    assert terms["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-5)
    assert terms["rewards/margins"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), rel=1e-5)
    assert terms["logps/rejected"] == pytest.approx(policy_rejected_logps.mean().item(), rel=1e-5)


class TableModel(torch.nn.Module):
    """Logits looked up by token: a model whose log-probabilities are fixed by its table."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, VOCAB)
        torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(seed))

    def forward(self, inputs):
        return self.table(inputs)


def kto_batch(seed: int, shift: float):
    """PAIRS unpaired examples (row 0) with their mismatched rows (row 1), precomputed reference
    log-probabilities of both (the reference of the mismatched rows lowered by `shift`), and labels."""
    generator = torch.Generator().manual_seed(seed)
    _, targets, _ = fixed(seed)
    inputs = torch.randint(VOCAB, (PAIRS, 2, SEQ), generator=generator)
    reference = -10 * torch.rand(PAIRS, 2, generator=generator) - torch.tensor([0.0, shift])
    labels = torch.tensor([True, False, True, True, False])
    return Batch(inputs, targets.view(PAIRS, 2, SEQ), reference=reference, index=torch.arange(PAIRS)), labels


def trl_kto(model, batch: Batch, labels, beta: float, desirable_weight: float, undesirable_weight: float):
    """TRL 1.16 KTOTrainer._compute_loss (loss_type=kto, precompute_ref_log_probs, one process)."""
    completion_logps, _ = token_logps(model(batch.inputs[:, 0]), batch.targets[:, 0])
    KL_logps, _ = token_logps(model(batch.inputs[:, 1]), batch.targets[:, 1])
    ref_KL_logps = batch.reference[:, 1]
    chosen_idx, rejected_idx = labels.nonzero().view(-1), (~labels).nonzero().view(-1)
    chosen_logps, rejected_logps = completion_logps[chosen_idx], completion_logps[rejected_idx]
    ref_chosen_logps, ref_rejected_logps = batch.reference[chosen_idx, 0], batch.reference[rejected_idx, 0]
    kl = (KL_logps - ref_KL_logps).mean().detach().clamp(min=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    rejected_logratios = rejected_logps - ref_rejected_logps
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    metrics = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
               "rewards/margins": chosen_rewards.mean() - rejected_rewards.mean(), "logps/chosen": chosen_logps.mean(),
               "logps/rejected": rejected_logps.mean(), "kl": kl}
    return losses.nanmean(), kl, metrics


@pytest.mark.parametrize("shift", [30.0, -30.0], ids=["kl_above_0", "kl_clamped_at_0"])
def test_kto_is_trl_s_kto_trainer(shift):
    beta, desirable_weight, undesirable_weight = 0.2, 1.3, 0.7
    model = TableModel(3)
    batch, labels = kto_batch(3, shift)
    objective = KahnemanTversky(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                                reference="precomputed")
    objective.labels = labels  # (setup reads them from the dataset; the samples carry their index)
    with torch.no_grad():
        expected, kl, metrics = trl_kto(model, batch, labels, beta, desirable_weight, undesirable_weight)
        loss, terms = step_of(objective, objective.forward(model, objective.rollout(model, batch, 1)), batch.targets,
                              model)
    assert (kl > 0) == (shift > 0)
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    for name, value in metrics.items():
        assert terms[name] == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name
    model.eval()  # evaluation runs no rollout: forward estimates the held-out batch's own KL
    objective._step = None
    with torch.no_grad():
        torch.testing.assert_close(objective.loss_sum(objective.forward(model, batch), batch.targets) / PAIRS, expected,
                                   **TOLERANCE)


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory) -> str:
    """Examples labelled desirable when the response repeats "ab", undesirable when it is letters
    at random (every other one), prepared by framework.prepare."""
    root = tmp_path_factory.mktemp("unpaired")
    rng = random.Random(0)
    lines = []
    for i in range(240):
        n, good = rng.randint(2, 6), i % 2 == 0
        response = "ab" * n if good else "".join(rng.choice("xyz") for _ in range(2 * n))
        lines.append(json.dumps({"prompt": f"q{i}:", "completion": response, "label": good}))
    (root / "kto.jsonl").write_text("\n".join(lines) + "\n")
    assert prepare([str(root / "kto.jsonl"), "--out", str(root / "prepared"), "--prompt-field", "prompt",
                    "--response-field", "completion", "--label-field", "label"]) == 0
    return str(root / "prepared")


def test_prepare_writes_labelled_examples_each_beside_its_prompt_with_another_response(unpaired):
    data = UnpairedPreferenceDataset(unpaired, seq_len=24)
    meta = json.loads(Path(unpaired, "meta.json").read_text())
    assert meta["kind"] == "unpaired" and meta["desirable"] == 120 and data.labels[:4].tolist() == [1, 0, 1, 0]
    sample = data[1]
    assert sample["inputs"].shape == sample["targets"].shape == (2, 24) and sample["index"].item() == 1
    text = [bytes(t for t in row.tolist() if t) for row in sample["inputs"]]
    assert text[0].startswith(b"q1:") and text[1].startswith(b"q1:ab")  # its prompt, example 0's response
    assert sample["targets"][1, :2].tolist() == [-100, -100]  # the prompt is never a target
    first = data[0]["inputs"][1]
    assert bytes(t for t in first.tolist() if t).startswith(b"q0:") and len(data) == 228  # the split's last's


@pytest.mark.parametrize("fields,message", [
    ({"label": "yes"}, "its 'label' is not true or false"),
    ({"label": 1}, "its 'label' is not true or false")])
def test_prepare_wants_a_boolean_label(fields, message, tmp_path, capsys):
    (tmp_path / "k.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a", **fields}) + "\n")
    assert prepare([str(tmp_path / "k.jsonl"), "--out", str(tmp_path / "out"), "--prompt-field", "prompt",
                    "--response-field", "completion", "--label-field", "label"]) == 2
    assert message in capsys.readouterr().err


def test_prepare_wants_a_response_with_the_label(tmp_path, capsys):
    (tmp_path / "k.jsonl").write_text(json.dumps({"prompt": "q", "label": True}) + "\n")
    assert prepare([str(tmp_path / "k.jsonl"), "--out", str(tmp_path / "out"), "--prompt-field", "prompt",
                    "--label-field", "label"]) == 2
    assert "--label-field: give it with --prompt-field and --response-field" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,message", [
    (["objective.loss_type=kto_pair"], r"objective.loss_type='kto_pair': use one of sigmoid, ipo, hinge, robust"),
    (["objective.loss_type=hinge", "objective.label_smoothing=0.1"],
     r"objective.label_smoothing=0.1: objective.loss_type=hinge ignores it \(only sigmoid and robust read it\)"),
    (["objective.loss_type=ipo", "objective.label_smoothing=0.1"],
     r"objective.label_smoothing=0.1: objective.loss_type=ipo ignores it"),
    (["objective.loss_type=robust", "objective.label_smoothing=0.5"], r"objective.label_smoothing=0.5: must be in "
                                                                      r"\[0, 0.5\)"),
    (["objective=simpo", "objective.gamma_beta_ratio=-1"], r"objective.gamma_beta_ratio=-1: must be >= 0"),
    (["objective=simpo", "mesh=pp2x1x1"], r"objective='simpo': not yet with pipeline parallelism"),
    (["objective=kto"], r"objective='kto': needs unpaired preference data, and data.dataset is "
                        r"framework.data.PreferenceDataset; prepare it with framework.prepare --prompt-field "
                        r"--response-field --label-field and use data=kto"),
    (["data=kto", "objective=lm"], r"objective='framework.training.objectives.lm.NextTokenCrossEntropy': unpaired "
                                   r"preference data \(data=kto\) trains under objective=kto"),
    (["data=kto", "objective=simpo"], r"objective='simpo': needs preference pairs"),
    (["data=kto", "adapter=none"], r"objective.reference='adapters_off': is the base model with the adapters off"),
    (["data=kto", "objective.undesirable_weight=0"], r"objective.undesirable_weight=0: must be > 0"),
    (["data=kto", "mesh=1x2", "plan=lm_tp_sp_loss_parallel"], r"plan.output.use_local_output=False: KTO sums each "
                                                               r"sequence's log-probabilities from whole logits"),
])
def test_bad_preference_configs_are_refused_before_launch_naming_the_key(overrides, message, hf_dirs, pairs,
                                                                         unpaired):
    data = [f"data.path={unpaired}"] if "data=kto" in overrides else []
    cfg = compose_config([*dpo_overrides(hf_dirs["llama"], pairs), "mesh=1x1", *overrides, *data])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.timeout(120)
def test_simpo_learns_to_prefer_the_pattern_without_a_reference(hf_dirs, pairs, tmp_path):
    overrides = [o for o in dpo_overrides(hf_dirs["llama"], pairs, steps=6) if o != "logger.tensorboard=false"]
    summary = launch_local(compose_config([*overrides, "objective=simpo", "objective.beta=2.0", "optim.lr=0.1",
                                           "mesh=1x1", "data.global_batch_size=8"]), str(tmp_path))
    margins = read_scalars(tmp_path / "tb")["rewards/margins"]
    print("SimPO losses:", [round(v, 3) for v in summary["losses"]], "margins:", [round(v, 2) for v in margins])
    assert margins[-1] > margins[0] + 0.5 and summary["losses"][-1] < summary["losses"][0] - 0.1
    assert "reference" not in summary["memory"]["max_over_ranks"]  # no reference model


@pytest.mark.timeout(120)
def test_kto_learns_the_desirable_pattern(hf_dirs, pairs, unpaired, tmp_path):
    overrides = [o for o in dpo_overrides(hf_dirs["llama"], unpaired, steps=6) if o != "logger.tensorboard=false"]
    summary = launch_local(compose_config([*overrides, "data=kto", "optim.lr=0.5", "mesh=1x1",
                                           "data.global_batch_size=8"]), str(tmp_path))
    scalars = read_scalars(tmp_path / "tb")
    print("KTO losses:", [round(v, 3) for v in summary["losses"]], "kl:", [round(v, 2) for v in scalars["kl"]])
    assert summary["losses"][0] == 0.5  # step 0: the policy is its reference and the KL estimate 0
    assert summary["losses"][-1] < 0.4 and scalars["rewards/margins"][-1] > 1.0
    assert scalars["kl"][0] == 0.0 and max(scalars["kl"]) > 0


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kto_trains_the_same_on_every_mesh_and_with_micro_batches(hf_dirs, unpaired, tmp_path):
    """The KL estimate is the global batch's, whatever holds its examples: 2 fsdp replicas with 2
    micro-batches each, and TP+SP, on 1x1's curve."""
    base = [*dpo_overrides(hf_dirs["llama"], unpaired), "data=kto", "data.global_batch_size=8", "adapter=none",
            "objective.reference=frozen_copy", "optim.lr=0.05"]
    one = launch_local(compose_config([*base, "mesh=1x1"]), str(tmp_path / "a"))["losses"]
    for extra in (["mesh=2x1", "parallel.dp_strategy=fsdp", "data.micro_batch_size=2"], ["mesh=1x2", "plan=lm_tp_sp"]):
        losses = launch_local(compose_config([*base, *extra]), str(tmp_path / extra[0]))["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one), rtol=1e-4, atol=1e-6)


def test_the_responses_logits_alone_give_the_whole_logits_log_probabilities():
    """OutputHead's select: only the counted targets' positions reach the output layer (TRL's fused LM head
    does the same); their sequence log-probabilities are the whole logits' (measured: 3.8e-6 at
    sums near -50 in fp32, the logits themselves equal)."""
    from framework.models.transformer import Transformer
    from framework.training.objectives.head import OutputHead
    from framework.training.objectives.logps import sequence_logps

    torch.manual_seed(0)
    model = Transformer(vocab_size=64, dim=32, n_layers=2, n_heads=4)
    inputs = torch.randint(64, (4, 12))
    targets = torch.full((4, 12), -100)
    for row, start in enumerate((3, 5, 11, 0)):
        targets[row, start:] = torch.randint(64, (12 - start,))
    whole = OutputHead(model.output, select=False)(model, inputs, targets, per_token=True)
    selected = OutputHead(model.output, select=True)(model, inputs, targets, per_token=True)
    assert selected.shape == (int((targets != -100).sum()), 64)
    torch.testing.assert_close(selected, whole[targets != -100], rtol=1e-5, atol=1e-5)
    for average in (False, True):
        torch.testing.assert_close(sequence_logps(selected, targets, average), sequence_logps(whole, targets, average),
                                   rtol=1e-5, atol=1e-5)
