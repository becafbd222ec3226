"""objective.max_staleness and objective.sampling_correction (framework.training.objectives.staleness,
.correction): the decoder's log-probabilities against the sampling distribution worked by hand
and against a full forward of the same weights (the two sides at staleness 0), the truncated
importance-sampling loss against TRL's formula written out, the kept weights K updates old, and
whole runs: K=0 with the correction logs a ratio of 1 on every mesh, K=1 and K=2 learn the toy
as K=0 does while their ratio departs from 1, and the refusals."""
import math

import pytest
import torch
import torch.nn.functional as F

from framework.config.errors import ConfigError
from framework.data.batch import IGNORE
from framework.models.decode import decoding_generators, generate_groups, next_tokens
from framework.models.transformer import Transformer
from framework.training.objectives.base import StepShare
from framework.training.objectives.correction import sampling_logps, truncated_weights
from framework.training.objectives.grpo import GroupRelativePolicy
from framework.training.objectives.staleness import StalePolicy
from tests.test_grpo import nucleus_by_hand, scalars, trl_loss


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.8), (1.3, 0.9), (1.0, 1.0), (0.0, 1.0)])
def test_each_drawn_token_s_log_probability_is_its_nucleus_s_by_hand(temperature, top_p):
    torch.manual_seed(3)
    logits = torch.randn(6, 9)
    generators = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    tokens, logps = next_tokens(logits, temperature, top_p, generators, with_logps=True)
    assert torch.equal(tokens, next_tokens(logits, temperature, top_p,
                                           [torch.Generator().manual_seed(s) for s in (1, 2, 3)]))  # the same draws
    for row, token, logp in zip(logits.tolist(), tokens.tolist(), logps.tolist()):
        if temperature == 0:
            expected = math.log(math.exp(row[token]) / sum(math.exp(v) for v in row))
        else:
            expected = math.log(nucleus_by_hand(row, temperature, top_p)[token])
        assert logp == pytest.approx(expected, abs=1e-5)
    targets = torch.full((6, 2), IGNORE)
    targets[:, 1] = tokens
    learner = sampling_logps(logits[:, None].expand(6, 2, 9), targets, temperature, top_p)
    assert torch.allclose(learner[:, 1], logps, atol=1e-6) and learner[:, 0].eq(0).all()


def test_a_token_outside_the_learner_s_nucleus_gets_weight_zero():
    logits = torch.tensor([[[3.0, 2.0, -4.0]]])
    targets = torch.tensor([[2]])  # far in the tail: outside top_p 0.9's nucleus
    learner = sampling_logps(logits, targets, 1.0, 0.9)
    weights, sums = truncated_weights(learner, torch.tensor([[-5.0]]), targets, 2.0)
    assert learner.item() == -math.inf and weights.item() == 0.0 and float(sums["truncated"]) == 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_at_staleness_0_the_decoder_s_and_a_full_forward_s_log_probabilities_agree(temperature, top_p):
    """The same weights: the decoder (KV cache, one token at a time, left padding) and the full
    forward of prompt + completion (what the learner runs) give each drawn token the same
    log-probability up to float32 rounding; measured at most 2.4e-7 (temperature 1) and 3.6e-7
    (0.7, top-p 0.9) here; bound 1e-5."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2).eval()
    prompts = [[3, 5, 7], [2, 9, 4, 6, 1]]
    tokens, lengths, logps = generate_groups(model, prompts, 3, 8, temperature, top_p,
                                             decoding_generators([11, 12], torch.device("cpu")), {0}, 0,
                                             with_logps=True)
    worst = 0.0
    for r in range(len(tokens)):
        prompt, completion = prompts[r // 3], tokens[r, :lengths[r]].tolist()
        sequence = torch.tensor([prompt + completion])
        targets = torch.full((1, len(prompt) + len(completion) - 1), IGNORE)
        targets[0, len(prompt) - 1:] = torch.tensor(completion)
        with torch.no_grad():
            learner = sampling_logps(model(sequence[:, :-1]), targets, temperature, top_p)[0, len(prompt) - 1:]
        worst = max(worst, float((learner - logps[r, :lengths[r]]).abs().max()))
    assert worst < 1e-5, worst


def test_the_corrected_loss_is_trl_s_truncated_importance_sampling():
    """TRL's GRPOTrainer._compute_loss with vllm_importance_sampling_correction: the clipped policy
    term times min(ratio, cap) (the ratio of the learner's log-probabilities, this forward's, to
    the sampler's), then the KL added (not weighed)."""
    torch.manual_seed(2)
    rows, seq, vocab, max_new, cap, beta = 6, 8, 7, 4, 2.0, 0.04
    logits = torch.randn(rows, seq, vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.full((rows, seq), IGNORE)
    for r in range(rows):
        targets[r, 2:3 + r % max_new] = torch.randint(vocab, (1 + r % max_new,))
    mask = (targets != IGNORE).double()
    logps = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                             reduction="none").view(rows, seq)
    sampler = (logps.detach() + 0.5 * torch.randn(rows, seq, dtype=torch.float64)) * mask  # another policy
    reference = (logps.detach() - 0.3) * mask
    weights, sums = truncated_weights(logps, sampler, targets, cap)
    assert float(weights.max()) == cap and (weights[mask.bool()] < cap).any() and float(sums["truncated"]) > 0
    advantages = torch.randn(rows, dtype=torch.float64)
    objective = GroupRelativePolicy(group_size=2, max_new_tokens=max_new, beta=beta, max_staleness=1)
    ours = objective((logits, advantages, reference, None, sampler), targets, torch.nn.Linear(1, 1),
                     StepShare(float(objective.count(targets)), None))
    ratio = torch.exp(logps - logps.detach())
    policy = -torch.min(ratio * advantages[:, None], torch.clamp(ratio, 0.8, 1.2) * advantages[:, None])
    per_token = policy * torch.clamp(torch.exp(logps.detach() - sampler), max=cap) + \
        beta * (torch.exp(reference - logps) - (reference - logps) - 1)
    expected = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert float(ours) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    # and without weights, the loss is TRL's uncorrected one (as before)
    plain = objective((logits, advantages, reference, None, None), targets, torch.nn.Linear(1, 1),
                      StepShare(float(objective.count(targets)), None))
    uncorrected = trl_loss(logps, logps.detach(), reference, advantages, mask, "grpo", 0.2, 0.2, beta, max_new,
                           mask.sum())
    assert float(plain) == pytest.approx(float(uncorrected), rel=1e-5, abs=1e-6)


def test_the_generating_policy_is_the_one_k_updates_before_and_the_newest_comes_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[1].weight.requires_grad_(False)  # frozen: never copied
    with torch.no_grad():
        model[0].bias.zero_()
    stale = StalePolicy(2)
    seen = []
    for step in range(5):
        stale.record(model, step)
        with stale.generating(model, step) as staleness:
            seen.append((staleness, float(model[0].bias[0])))
        assert float(model[0].bias[0]) == step  # the newest, back
        with torch.no_grad():
            model[0].bias.fill_(step + 1)  # "the update"
    assert seen[0][0] == 0 and seen[1] == (1, 0.0) and seen[2] == (2, 0.0) and seen[3] == (2, 1.0)
    assert seen[4] == (2, 2.0)
    assert len(stale.kept) == 3 and len(stale.kept[0][1]) == 3  # weight and bias, bias (frozen weight left)


def run(overrides, out) -> dict:
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    summary = launch_local(compose_config(["recipe=grpo_lm", "trainer.log_every=1", "trainer.progress_bar=false",
                                           "checkpoint.every=null", *overrides]), str(out))
    return {"summary": summary, "scalars": scalars(out / "tb")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [
    ["mesh=1x1"],
    ["mesh=2x1", "parallel.dp_strategy=fsdp"],
    pytest.param(["mesh=2x1"], marks=pytest.mark.integration),
    pytest.param(["mesh=1x2", "plan=lm_tp_sp"], marks=pytest.mark.integration),
], ids=["1x1", "fsdp_2x1", "ddp_2x1", "tp_sp_1x2"])
def test_at_staleness_0_the_correction_s_ratio_is_1_on_every_mesh(mesh, tmp_path):
    """The decoder's log-probabilities against the learner's full forward, same weights: the
    largest ratio over every completion token of 6 steps; measured over 20 steps at most 1 + 1.5e-6
    (1x1 1.2e-6, fsdp 9.5e-7, ddp 9.5e-7, TP + SP 1.4e-6; the mean is 1 in float32), bound 1e-4."""
    logged = run(["trainer.max_steps=6", "objective.sampling_correction=true", *mesh], tmp_path)["scalars"]
    assert max(abs(v - 1) for v in logged["sampling/ratio_max"]) < 1e-4, logged["sampling/ratio_max"]
    assert max(abs(v - 1) for v in logged["sampling/ratio_mean"]) < 1e-4
    assert logged["sampling/truncated"] == [0.0] * 6


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory) -> dict:
    return run(["trainer.max_steps=40", "mesh=2x1"], tmp_path_factory.mktemp("k0"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k,mesh", [
    (1, ["mesh=2x1"]),
    pytest.param(2, ["mesh=2x1", "parallel.dp_strategy=fsdp"], marks=pytest.mark.integration),
    pytest.param(2, ["mesh=2x2", "plan=lm_tp_sp", "parallel.dp_strategy=fsdp"], marks=pytest.mark.integration),
], ids=["k1_2x1", "k2_fsdp_2x1", "k2_fsdp_tp_sp_2x2"])
def test_stale_rollouts_learn_the_toy_as_synchronous_ones_do(k, mesh, synchronous, tmp_path):
    """The lowercase toy (recipe=grpo_lm) over 40 steps: the mean reward of the last 5 within 0.05
    of K=0's (measured 0.998-1.000 over steps 37-40 for K = 0, 1 and 2); each step's staleness is min(step, K); the ratio
    is 1 at step 1 (nothing to lag yet) and departs from it after (measured 1.30 at step 2)."""
    logged = run(["trainer.max_steps=40", f"objective.max_staleness={k}", *mesh], tmp_path)["scalars"]
    last = lambda rewards: sum(rewards[-5:]) / 5  # noqa: E731
    assert last(logged["reward"]) == pytest.approx(last(synchronous["scalars"]["reward"]), abs=0.05)
    assert logged["staleness"] == [float(min(step, k)) for step in range(40)]
    ratio = logged["sampling/ratio_max"]
    assert abs(ratio[0] - 1) < 1e-4 and max(ratio[1:]) > 1.1, ratio


@pytest.mark.parametrize("overrides,message", [
    (["objective.max_staleness=-1"], r"^config error: objective.max_staleness=-1: must be a whole number >= 0"),
    (["objective.max_staleness=1", "objective.num_iterations=2"],
     r"^config error: objective.num_iterations=2: learns from each rollout 2 times, and "
     r"objective.max_staleness=1 already learns from rollouts of an older policy; use one of the two"),
    (["objective.sampling_cap=0.5"], r"^config error: objective.sampling_cap=0.5: must be >= 1"),
    (["objective.sampling_correction=maybe"],
     r"^config error: objective.sampling_correction='maybe': use true, false or null \(null: on when "
     r"objective.max_staleness > 0\)$"),
    (["objective.max_staleness=1", "objective.top_p=0.9", "mesh=1x2", "plan=lm_tp_sp"],
     r"^config error: objective.sampling_correction=None: weighs each token by the sampling distribution "
     r"\(temperature 1.0, top_p 0.9\), which needs the whole logits on a rank, and tensor parallelism splits them"),
])
def test_bad_staleness_configs_are_refused_before_launch_naming_the_key(overrides, message):
    from framework.validate import validate
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=message):
        validate(compose_config(["recipe=grpo_lm", "mesh=1x1", *overrides]))
