"""objective=grpo (framework.training.objectives.grpo) against GRPO written here: the advantages and TRL's
loss for each loss_type computed by hand from the same log-probabilities (TRL 1.16's
GRPOTrainer._compute_loss, written out), the gradient against the policy gradient by hand,
generation in the loop against decoding without a cache; and whole runs: a reward that rises on
a toy task, the same curve on 1x1 and 2x1, a resume that continues it, and the refusals."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import framework
from framework.data.batch import IGNORE
from framework.generate import generate
from framework.models.decode import generate_groups, next_tokens
from framework.models.transformer import Transformer
from framework.training.objectives.grpo import GroupRelativePolicy
from framework.training.objectives.rollout import group_advantages
from framework.training.objectives.base import StepShare


def nanstd(t: torch.Tensor) -> torch.Tensor:
    """TRL's nanstd (Bessel-corrected)."""
    mean = t.mean()
    return ((t - mean) ** 2).sum().div(t.numel() - 1).sqrt()


def test_advantages_are_the_group_centred_rewards_over_the_chosen_std():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    by_hand_group, by_hand_none = [], []
    for group in rewards.view(2, 4):
        for r in group:
            by_hand_none.append(float(r - group.mean()))
            by_hand_group.append(float((r - group.mean()) / (nanstd(group) + 1e-4)))
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(by_hand_group, rel=1e-12)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(by_hand_none, rel=1e-12)
    batch_std = nanstd(rewards)
    expected = [a / float(batch_std + 1e-4) for a in by_hand_none]
    assert group_advantages(rewards, 4, "batch", batch_std).tolist() == pytest.approx(expected, rel=1e-12)


BATCH_REWARDS = [[1.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0, 1.0],   # rank 0's two groups of 4
                 [3.0, 3.5, 4.0, 3.5, 3.25, 3.0, 3.5, 4.0]]  # rank 1's: another mean and spread


def grpo_config(*overrides: str) -> dict:
    """recipe=grpo_lm (the shipped prompts, 2x1) on the CPU, resolved for the ranks."""
    from omegaconf import OmegaConf

    from tests.conftest import QUIET, compose_config

    return OmegaConf.to_container(compose_config(["recipe=grpo_lm", *QUIET, "mesh.device_type=cpu", *overrides]),
                                  resolve=True)


def set_up_on_rank(cfg_container: dict, out_dir: str) -> GroupRelativePolicy:
    """(In each rank.) The run's objective as the Trainer sets it up: its DP replicas and group
    are the run's."""
    from omegaconf import OmegaConf

    from framework.training.builder import build_and_run

    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="objective")  # (its own stage sets it up)
    return run.objective


def batch_std_on_rank(cfg_container: dict, out_dir: str) -> dict:
    """(Run in each of 2 gloo ranks, 2 DP replicas.) scale_rewards=batch's std of this rank's
    rewards over the DP group (its moments all-reduced), and the advantages it gives."""
    objective = set_up_on_rank(cfg_container, out_dir)
    rewards = torch.tensor(BATCH_REWARDS[dist.get_rank()], dtype=torch.float64)
    std = objective._batch_std(rewards)
    advantages = group_advantages(rewards, 4, "batch", std)
    dist.destroy_process_group()
    return {"std": float(std), "advantages": advantages.tolist()}


@pytest.mark.timeout(120)
def test_batch_scaled_advantages_divide_by_the_std_of_every_replica_s_rewards(tmp_path):
    """On 2 DP ranks each rank's std is the std of all 16 rewards (Bessel-corrected, TRL's nanstd
    over the gathered batch), not its own 8's; each advantage its group-centred reward over it."""
    from framework.launch.local import spawn_ranks

    cfg = grpo_config("objective.group_size=4", "objective.scale_rewards=batch")
    reports = spawn_ranks(2, batch_std_on_rank, cfg, str(tmp_path))
    every = torch.tensor(BATCH_REWARDS, dtype=torch.float64).flatten()
    by_hand = float(nanstd(every))
    for rank in (0, 1):
        own = float(nanstd(torch.tensor(BATCH_REWARDS[rank], dtype=torch.float64)))
        assert abs(own - by_hand) > 0.8  # (0.65 and 0.39 against 1.50: the all-reduce is seen)
        assert reports[rank]["std"] == pytest.approx(by_hand, rel=1e-5, abs=1e-6)  # moments vs two passes
        expected = [(r - sum(group) / 4) / (by_hand + 1e-4)
                    for group in torch.tensor(BATCH_REWARDS[rank]).view(2, 4).tolist() for r in group]
        assert reports[rank]["advantages"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def trl_loss(logps, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_len, items):
    """TRL 1.16 GRPOTrainer._compute_loss (token-level importance sampling, no accumulation)."""
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    if beta != 0.0:
        per_token = per_token + beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    return (per_token * mask).sum() / items  # dapo: num_items_in_batch, one process


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("selected", [False, True], ids=["all-logits", "logits-at-completions"])
def test_the_loss_is_trl_s_for_each_loss_type_and_its_gradient_the_policy_gradient(loss_type, beta, selected):
    """One update per rollout: the old policy is the new one detached, the ratio 1. `selected`:
    the policy's logits at the completions' tokens alone (OutputHead's select, in row order)."""
    torch.manual_seed(0)
    rows, seq, vocab, max_new = 6, 10, 11, 5
    logits = torch.randn(rows, seq, vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.full((rows, seq), IGNORE)
    for r in range(rows):  # completions of 1 .. 5 tokens after prompts of 2 .. 4
        start, length = 1 + r % 3, 1 + r % max_new
        targets[r, start:start + length] = torch.randint(vocab, (length,))
    advantages = torch.randn(rows, dtype=torch.float64)
    reference = torch.where(targets != IGNORE, -2.0 + 0.3 * torch.randn(rows, seq, dtype=torch.float64), 0.0)
    objective = GroupRelativePolicy(group_size=2, max_new_tokens=max_new, loss_type=loss_type, beta=beta)
    units = float(objective.count(targets))
    given = logits[targets != IGNORE] if selected else logits
    ours = objective((given, advantages, reference, None, None), targets, torch.nn.Linear(1, 1), StepShare(units, None))

    mask = (targets != IGNORE).double()
    logps = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                             reduction="none").view(rows, seq)
    expected = trl_loss(logps, logps.detach(), reference, advantages, mask, loss_type, 0.2, 0.2, beta, max_new,
                        mask.sum())
    assert float(ours) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    grad, = torch.autograd.grad(ours, logits)
    # the ratio is 1 with one update per rollout: the gradient is the policy gradient of -A log pi
    # plus beta times the k3 KL's, each token weighted by its loss_type's normalizer
    kl = torch.exp(reference - logps) - (reference - logps) - 1
    per_token = (-advantages[:, None] * logps + beta * kl) * mask
    weight = {"grpo": 1 / (mask.sum(-1, keepdim=True).clamp(min=1) * rows), "dapo": 1 / mask.sum(),
              "dr_grpo": torch.tensor(1 / (rows * max_new))}[loss_type]
    expected_grad, = torch.autograd.grad((per_token * weight).sum(), logits)
    # the objective takes log-probabilities in fp32 (as DPO's): 6e-9 from the fp64 reference here
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_with_several_updates_per_rollout_the_clipped_ratio_to_the_old_policy_is_trl_s(loss_type):
    """num_iterations > 1: the ratio to the policy that generated, clipped to [1 - 0.2, 1 + 0.28]
    (DAPO's clip-higher), and TRL's clip_ratio/region_mean: the completion tokens whose ratio
    left the range on the side that stops their gradient."""
    torch.manual_seed(1)
    rows, seq, vocab, max_new = 8, 9, 7, 4
    logits = torch.randn(rows, seq, vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.full((rows, seq), IGNORE)
    for r in range(rows):
        targets[r, 2:3 + r % max_new] = torch.randint(vocab, (1 + r % max_new,))
    advantages = torch.randn(rows, dtype=torch.float64)
    mask = (targets != IGNORE).double()
    logps = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                             reduction="none").view(rows, seq)
    old = (logps.detach() + 0.4 * torch.randn(rows, seq, dtype=torch.float64)) * mask  # a policy 0.4 nats away
    objective = GroupRelativePolicy(group_size=2, max_new_tokens=max_new, loss_type=loss_type, epsilon=0.2,
                                    epsilon_high=0.28, num_iterations=2)
    step = StepShare(float(objective.count(targets)), 1.0)
    set_up_in_one_process(objective)
    objective._note_rollout(torch.zeros(rows, dtype=torch.float64), {}, mask.sum(-1), targets)  # (its tokens)
    ours = objective((logits, advantages, None, old, None), targets, torch.nn.Linear(1, 1), step)
    expected = trl_loss(logps, old, None, advantages, mask, loss_type, 0.2, 0.28, 0.0, max_new, mask.sum())
    assert float(ours) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    ratio, a = torch.exp(logps - old), advantages[:, None]
    region = (((ratio < 0.8) & (a < 0)) | ((ratio > 1.28) & (a > 0))).double()
    assert float(step.terms["clip_ratio"]) == pytest.approx(float((region * mask).sum() / mask.sum()), abs=1e-6)
    assert 0 < float(step.terms["clip_ratio"]) < 1


def set_up_in_one_process(objective: GroupRelativePolicy) -> None:
    """objective.setup_rollout of a one-process grpo_lm run (one replica, no process group)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from framework.parallel.device import resolve_device
    from framework.training.objectives.context import ObjectiveContext
    from framework.training.objectives.head import OutputHead

    cfg = OmegaConf.create(grpo_config("mesh=1x1"))
    dataset = instantiate(cfg.data.dataset, split="train")
    model = tiny_lm()
    objective.setup_rollout(ObjectiveContext(cfg=cfg, device=resolve_device("cpu", 1), module=model, model=model,
                                             head=OutputHead(), dataset=dataset))


def tiny_lm(vocab: int = 32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2).eval()


@torch.no_grad()
def decoded_without_cache(model, prompt, steps, stop):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        if tokens[-1] in stop:
            break
    return tokens[len(prompt):]


def test_group_generation_decodes_as_the_model_does_without_a_cache_and_pads_after_the_stop():
    model, prompt = tiny_lm(), [3, 7, 1, 9]
    expected = decoded_without_cache(model, prompt, 12, stop=set())
    stop = {expected[5]}  # a token greedy decoding reaches: every row stops there
    tokens, lengths = generate_groups(model, [prompt], 3, 12, 0.0, 1.0, [torch.Generator()], stop, pad_id=0)
    first_stop = next(i for i, t in enumerate(expected) if t in stop)
    assert lengths.tolist() == [first_stop + 1] * 3
    for row in tokens:
        assert row[:first_stop + 1].tolist() == expected[:first_stop + 1]
        assert row[first_stop + 1:].eq(0).all()
    assert generate(model, prompt, 12, stop=stop) == expected[:first_stop + 1]


def test_decoding_in_blocks_for_sequence_parallelism_gives_the_same_tokens():
    """block=3: each forward padded to a multiple of 3, the padding's keys and values dropped
    (prompts of different lengths too: left padding and block filler together)."""
    model, prompts = tiny_lm(), [[3, 7, 1, 9], [5, 2]]
    plain = generate_groups(model, prompts, 2, 10, 0.0, 1.0, [torch.Generator()] * 2, set(), pad_id=0)
    blocked = generate_groups(model, prompts, 2, 10, 0.0, 1.0, [torch.Generator()] * 2, set(), pad_id=0, block=3)
    assert torch.equal(plain[0], blocked[0]) and torch.equal(plain[1], blocked[1])


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_prompts_of_different_lengths_decoded_together_as_each_alone(top_p):
    """Left-padded side by side, each prompt's rows are what decoding it alone gives: its logits
    (the padding rotated past and masked) and its draws (its own generator), greedy and sampled;
    and with last_only, the same."""
    model = tiny_lm()
    prompts, stop = [[3, 7, 1, 9, 4, 4], [5, 2], [8, 1, 6]], {11}
    seeds = [5, 6, 7]
    for temperature in (0.0, 1.0):
        together, lengths = generate_groups(model, prompts, 3, 10, temperature, top_p,
                                            [torch.Generator().manual_seed(s) for s in seeds], stop, pad_id=0)
        for p, (prompt, seed) in enumerate(zip(prompts, seeds)):
            alone, alone_lengths = generate_groups(model, [prompt], 3, 10, temperature, top_p,
                                                   [torch.Generator().manual_seed(seed)], stop, pad_id=0)
            assert torch.equal(together[3 * p:3 * p + 3], alone) and torch.equal(lengths[3 * p:3 * p + 3], alone_lengths)
        # the prompts' forward projecting each row's last position alone draws the same tokens
        last_only, _ = generate_groups(model, prompts, 3, 10, temperature, top_p,
                                       [torch.Generator().manual_seed(s) for s in seeds], stop, pad_id=0, last_only=True)
        assert torch.equal(last_only, together)
        if temperature == 0:
            for p, prompt in enumerate(prompts):
                expected = decoded_without_cache(model, prompt, 10, stop)
                assert together[3 * p, :len(expected)].tolist() == expected


def test_left_padded_logits_match_the_unpadded_within_rounding():
    """The padded rows' last logits through the decoder's static cache against each prompt's
    plain forward, no cache (measured here: 2.4e-7 at most)."""
    from framework.models.decode import StaticCache, prepare

    model = tiny_lm()
    short, long = [5, 2], [3, 7, 1, 9, 4, 4]
    with torch.no_grad():
        prepare(model, 8, torch.device("cpu"))
        position, pad = torch.zeros((), dtype=torch.int64), torch.tensor([4, 0])
        both = model(torch.tensor([[0] * 4 + short, long]), [StaticCache(8, position, pad) for _ in model.layers])
    torch.testing.assert_close(both[0, -1], model(torch.tensor([short]))[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1, -1], model(torch.tensor([long]))[0, -1], rtol=1e-5, atol=1e-5)


def test_sampled_groups_are_reproducible_from_the_generator_and_differ_within_a_group():
    model, prompt = tiny_lm(), [3, 7, 1, 9]
    draw = lambda: generate_groups(model, [prompt], 4, 10, 1.0, 0.9, [torch.Generator().manual_seed(5)], set(), 0)[0]  # noqa: E731
    first, again = draw(), draw()
    assert torch.equal(first, again)
    assert len({tuple(row.tolist()) for row in first}) > 1


def nucleus_by_hand(logits: list, temperature: float, top_p: float) -> dict:
    """token -> its probability to be drawn: softmax(logits / T) in float64, the tokens taken most
    likely first until their sum reaches top_p (the one that crosses it included), renormalized."""
    weights = [math.exp(logit / temperature) for logit in logits]
    probs = [w / sum(weights) for w in weights]
    kept, total = [], 0.0
    for token in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if total >= top_p:
            break
        kept.append(token)
        total += probs[token]
    return {token: probs[token] / total for token in kept}


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.8), (1.3, 0.9), (1.0, 1.0)])
def test_sampled_frequencies_follow_the_nucleus_computed_by_hand(temperature, top_p):
    """20,000 seeded draws from each of two rows (the same logits in another order, each its own
    generator): every token's frequency within 5 standard errors of its probability by hand
    (measured at most 1.6), and no token outside the nucleus ever drawn. At (0.7, 0.8) the sorted
    probabilities sum 0.444, 0.695, 0.836: the crossing token is in, the fourth is out."""
    logits = [0.3, 2.0, -1.0, 1.2, 0.0, 1.6, -2.0, 0.9]
    permuted = [logits[i] for i in (5, 2, 7, 0, 6, 1, 4, 3)]
    draws = 20_000
    rows = torch.tensor([logits] * draws + [permuted] * draws)
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    drawn = next_tokens(rows, temperature, top_p, generators)
    for row, sampled in zip((logits, permuted), drawn.split(draws)):
        expected = nucleus_by_hand(row, temperature, top_p)
        counts = torch.bincount(sampled, minlength=len(row)).tolist()
        assert {token for token, count in enumerate(counts) if count} == set(expected)
        for token, p in expected.items():
            assert abs(counts[token] / draws - p) < 5 * math.sqrt(p * (1 - p) / draws), (token, counts, expected)


# -- whole runs ---------------------------------------------------------------------------

LOWERCASE_SHARE = '''def share(prompt, completion, answer):
    return sum(c.islower() for c in completion) / max(len(completion), 1)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "lowercase.py"
    path.write_text(LOWERCASE_SHARE)
    return str(path)


def grpo_overrides(prompts: str, reward_file: str, steps: int) -> list:
    """recipe=grpo_lm (lm_tiny, 8 prompts x 8 completions of 8 tokens a step) rewarded by the share
    of lowercase letters in a completion, which a random model starts near 0.1 at."""
    return ["recipe=grpo_lm", f"data.path={prompts}", "reward=file", f"reward.file={reward_file}",
            "reward.function=share", f"trainer.max_steps={steps}", "trainer.log_every=1",
            "trainer.progress_bar=false", "checkpoint.every=null"]


def scalars(tb_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def one_process(prepared, reward_file, tmp_path_factory) -> dict:
    """20 steps on 1x1, with a checkpoint at step 10."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    out = tmp_path_factory.mktemp("grpo_1x1")
    cfg = compose_config([*grpo_overrides(prepared["prompts"], reward_file, 20), "mesh=1x1", "checkpoint.every=10"])
    return {"summary": launch_local(cfg, str(out)), "scalars": scalars(out / "tb"), "out": out}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [
    ["mesh=2x1", "parallel.dp_strategy=fsdp"],
    pytest.param(["mesh=1x2", "plan=lm_tp_sp"], marks=pytest.mark.integration),
    pytest.param(["mesh=2x2", "plan=lm_tp_sp", "parallel.dp_strategy=fsdp"], marks=pytest.mark.integration),
], ids=["fsdp_2x1", "tp_sp_1x2", "fsdp_tp_sp_2x2"])
def test_the_reward_rises_and_every_mesh_follows_one_process(mesh, one_process, prepared, reward_file, tmp_path):
    """The same prompts draw the same completions on every mesh (their sampling is seeded by the
    step and the prompt's index), so the reward, the loss and the gradient norm follow one process."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    ours = one_process["scalars"]
    # measured 0.076 -> 0.405, rising steadily, since each parameter's own draw (0.084 -> 0.68 with the model's
    # one sequence of draws; 0.10 -> 0.97 with N(0, 1) embeddings and default Linear init)
    assert ours["reward"][0] < 0.2 and ours["reward"][-1] > 0.3, " ".join(f"{r:.3f}" for r in ours["reward"])
    assert ours["completions/mean_length"][0] > 7  # 8 tokens, a stop drawn now and then
    summary = launch_local(compose_config([*grpo_overrides(prepared["prompts"], reward_file, 20), *mesh]),
                           str(tmp_path))
    theirs = scalars(tmp_path / "tb")
    # measured: rewards within 6e-8, grad norms 1.3e-7 relative, losses 1.3e-8; each bound 10x and more
    assert theirs["reward"] == pytest.approx(ours["reward"], abs=1e-6)
    assert summary["grad_norms"] == pytest.approx(one_process["summary"]["grad_norms"], rel=1e-5, abs=1e-6)
    assert summary["losses"] == pytest.approx(one_process["summary"]["losses"], abs=1e-6)
    assert len(summary["rollout_s"]) == 20 and 0 < sum(summary["rollout_s"]) < sum(summary["step_times_s"])


@pytest.mark.timeout(300)
def test_the_toy_recipe_runs_as_shipped_from_a_directory_without_prompts(tmp_path):
    """`python -m framework.train recipe=grpo_lm`, as docs/grpo.md writes it (two steps, not 60),
    launched where no prompts lie: the package's own prompts, scored by the share of [a-z]."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "framework.train", "recipe=grpo_lm", "trainer.max_steps=2",
                             "trainer.log_every=1", "trainer.progress_bar=false", "hydra.run.dir=run"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["mesh_shape"] == [2, 1]
    prompts = {json.loads(line)["prompt"] for line in open(os.path.join(os.path.dirname(framework.__file__),
                                                                         "prompts", "lowercase.jsonl"))}
    first = logged_texts(tmp_path / "run" / "tb")[1]
    assert any(prompt in first for prompt in prompts), first  # the shipped prompts were read
    rewards = scalars(tmp_path / "run" / "tb")["reward"]
    assert len(rewards) == 2 and all(0 < r < 0.5 for r in rewards), rewards  # a graded share, near 26/256
    # the reward, what a GRPO user watches (the loss hovers at 0), on the final line as TensorBoard has it
    assert f"final loss {summary['final_loss']:.6f}, reward {rewards[-1]:.4f} after 2 steps" in result.stdout, \
        result.stdout


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_the_same_curve(one_process, prepared, reward_file, tmp_path):
    """Steps 11-20 from step 10's checkpoint: the same completions (their seeds need no state), the
    same data position, the same optimizer: bitwise the uninterrupted run's."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    step_10 = one_process["out"] / "checkpoints" / "step_10"
    resumed = launch_local(compose_config([*grpo_overrides(prepared["prompts"], reward_file, 20), "mesh=1x1",
                                           f"checkpoint.resume={step_10}"]), str(tmp_path))
    assert resumed["resumed_from"]["step"] == 10
    assert resumed["grad_norms"] == one_process["summary"]["grad_norms"]
    assert scalars(tmp_path / "tb")["reward"] == one_process["scalars"]["reward"][10:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reference", [["objective.reference=frozen_copy"],
                                       ["objective.reference=adapters_off", "adapter=lora"]],
                         ids=["frozen_copy", "adapters_off"])
def test_the_kl_to_the_reference_starts_at_zero_and_the_reference_stays_where_it_was(reference, one_process,
                                                                                       prepared, reward_file,
                                                                                       tmp_path):
    """beta > 0: at step 1 the policy is its reference (a copy; LoRA's B starts at zero), so the k3
    KL is 0 and the loss the beta=0 run's; then the policy moves and the reference does not."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    summary = launch_local(compose_config([*grpo_overrides(prepared["prompts"], reward_file, 4), "mesh=1x1",
                                           "objective.beta=0.04", *reference]), str(tmp_path))
    kl = scalars(tmp_path / "tb")["kl"]
    # measured (adapters_off, since the declared init): 0.0, 7.2e-7, 2.3e-6, 4.5e-6: zero within rounding,
    # then above that bound and growing as the adapters move away from the base
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and all(k > 1e-7 for k in kl[1:]) and kl[1:] == sorted(kl[1:]), kl
    if "adapter=lora" not in reference:  # the same model and completions as the beta=0 run at step 1
        assert summary["losses"][0] == pytest.approx(one_process["summary"]["losses"][0], rel=1e-5, abs=1e-6)


@pytest.mark.timeout(300)
def test_a_combined_reward_is_the_weighted_sum_of_its_parts_curves(prepared, reward_file, tmp_path):
    """reward=combined: each part's mean has its curve (rewards/<name>), and the reward is their
    weighted sum, every step."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    launch_local(compose_config([*grpo_overrides(prepared["prompts"], reward_file, 3), "mesh=1x1", "reward=combined",
                                 "reward.parts=[{kind: file, weight: 1.0}, {kind: length, target_length: 4, "
                                 "weight: 0.5}]"]), str(tmp_path))
    logged = scalars(tmp_path / "tb")
    share, length = logged["rewards/share"], logged["rewards/length"]
    assert len(share) == 3 and any(0 < value < 1 for value in share + length)
    assert logged["reward"] == pytest.approx([s + 0.5 * n for s, n in zip(share, length)], abs=1e-6)


def logged_completions(tb_dir) -> list:
    """The (prompt, completion) pairs of the last logged sample text."""
    import ast
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("completions/text_summary")[-1].tensor_proto.string_val[0].decode()
    return [tuple(map(ast.literal_eval, re.fullmatch(r"(.*) -> (.*) \(reward \S+\)", line).groups()))
            for line in map(str.strip, text.splitlines()) if line]  # (the logger indents it as a block)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [
    ["mesh=2x1", "parallel.dp_strategy=fsdp"],
    pytest.param(["mesh=1x2", "plan=lm_tp_sp"], marks=pytest.mark.integration),
    pytest.param(["mesh=1x1"], marks=pytest.mark.integration),
], ids=["fsdp_2x1", "tp_sp_1x2", "1x1"])
def test_greedy_generation_in_the_loop_is_framework_generate_s(mesh, prepared, reward_file, tmp_path):
    """temperature 0 and lr 0: the completions step 1 logged are what `python -m framework.generate`
    continues each prompt with (one process, no parallelism) from the step's checkpoint."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config, run_cli

    launch_local(compose_config([*grpo_overrides(prepared["prompts"], reward_file, 1), *mesh,
                                 "objective.temperature=0", "optim.lr=0", "checkpoint.every=1"]), str(tmp_path))
    samples = logged_completions(tmp_path / "tb")
    assert len(samples) == 8 and len(set(samples)) == 1  # greedy: the group's completions are one
    prompt, completion = samples[0]
    result = run_cli([str(tmp_path / "checkpoints" / "step_1"), "--prompt", prompt, "--max-new-tokens", "8"],
                     module="framework.generate")
    assert result.returncode == 0, result.stderr
    assert result.stdout == prompt + completion + "\n"


@pytest.mark.parametrize("overrides,message", [
    (["objective.group_size=1"], r"objective.group_size=1: must be >= 2: advantages compare completions of one prompt"),
    (["objective.loss_type=bnpo"], r"objective.loss_type='bnpo': use one of grpo, dapo, dr_grpo"),
    (["objective.scale_rewards=rank"], r"objective.scale_rewards='rank': use one of group, batch, none"),
    (["objective.beta=-0.1"], r"objective.beta=-0.1: must be >= 0"),
    (["objective.epsilon_high=0.1"], r"objective.epsilon_high=0.1: must be >= objective.epsilon \(or null\)"),
    (["objective.num_iterations=0"], r"objective.num_iterations=0: must be >= 1"),
    (["objective.num_iterations=2", "checkpoint.every=3"], r"checkpoint.every=3: a checkpoint inside a rollout's "
                                                           r"objective.num_iterations=2 steps would resume without "
                                                           r"that rollout; make it a multiple of 2"),
    (["objective.beta=0.1"], r"objective.reference='adapters_off': is the base model with the adapters off, and this "
                             r"run has none \(adapter=none\); use adapter=lora, or objective.reference=frozen_copy "
                             r"for full training, or objective.beta=0$"),
    (["objective.reference=nope"], r"objective.reference='nope': use one of adapters_off, frozen_copy$"),  # (beta 0)
    (["reward=char_share", "reward.pattern=ab"], r"reward.pattern='ab': matches no single character"),
    (["objective.max_new_tokens=30"], r"data.dataset.seq_len=32: the longest prompt in .* has 5 tokens, and with "
                                      r"objective.max_new_tokens=30 a completion needs 35; raise seq_len or lower "
                                      r"max_new_tokens"),
    (["objective=lm"], r"objective='framework.training.objectives.lm.NextTokenCrossEntropy': prompts \(data=prompts\) "
                       r"train under objective=grpo"),
    (["data=instructions", "objective=grpo"], r"objective='grpo': needs prompts, and data.dataset is "
                                              r"framework.data.InstructionDataset; prepare them with framework.prepare"),
    (["mesh=1x2x1cp"], r"objective='grpo': not yet with context or pipeline parallelism"),
    (["mesh=pp2x1x1"], r"objective='grpo': not yet with context or pipeline parallelism"),
    (["trainer.eval_every=5"], r"objective='grpo': not yet with trainer.eval_every"),
    (["trainer.compile=blocks"], r"objective='grpo': not yet with trainer.compile"),
    (["reward=none"], r"reward.kind='none'"),
])
def test_bad_grpo_configs_are_refused_before_launch_naming_the_key(overrides, message, prepared, reward_file):
    from framework.config.errors import ConfigError
    from framework.validate import validate
    from tests.conftest import compose_config

    data = [f"data.path={prepared['instruction']}"] if "data=instructions" in overrides else []
    cfg = compose_config([*grpo_overrides(prepared["prompts"], reward_file, 5), "mesh=1x1", *overrides, *data])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_a_bad_grpo_command_line_exits_2_with_one_line_and_starts_nothing(prepared, reward_file, tmp_path):
    from tests.conftest import run_cli

    result = run_cli([*grpo_overrides(prepared["prompts"], reward_file, 5), "mesh=1x1", "objective.group_size=1",
                      f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: objective.group_size=1: must be >= 2: advantages compare completions of one prompt"]
    assert not (tmp_path / "run" / "logs").exists()


def logged_texts(tb_dir) -> dict:
    """step -> the completions text logged at it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("completions/text_summary")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [["mesh=1x1"], pytest.param(["mesh=2x1", "parallel.dp_strategy=fsdp"],
                                                            marks=pytest.mark.integration)], ids=["1x1", "fsdp_2x1"])
def test_several_updates_per_rollout_learn_from_one_rollout_against_the_policy_that_made_it(mesh, prepared,
                                                                                           reward_file, tmp_path):
    """num_iterations=3: steps 1-3 learn from step 1's completions, step 4 generates again; the
    first update of a rollout has ratio 1 (nothing clipped), later ones move away from it."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    summary = launch_local(compose_config([*grpo_overrides(prepared["prompts"], reward_file, 6), *mesh,
                                           "objective.num_iterations=3", "optim.lr=0.05"]), str(tmp_path))
    texts, values = logged_texts(tmp_path / "tb"), scalars(tmp_path / "tb")
    assert texts[1] == texts[2] == texts[3] != texts[4] == texts[5] == texts[6]
    assert values["clip_ratio"][0] == 0 and values["clip_ratio"][3] == 0  # (steps 1 and 4: r = 1)
    assert max(values["clip_ratio"][1:3]) > 0, values["clip_ratio"]  # lr 0.05 moves the policy out of [0.8, 1.2]
    assert values["reward"][:3] == [values["reward"][0]] * 3
    assert len(set(summary["grad_norms"][:3])) == 3  # the same rollout, a moving policy
