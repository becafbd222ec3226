"""The decoder (framework.models.decode) against independent references: its draws against
torch.multinomial's with the same generators, its static cache against the model's forward
without one, its compiled step against the eager one, its stop check against looking every
token; and GRPO's rollout figures on real gloo groups: completions/max_length the longest of
every DP replica, a reward run once a TP group."""
import json

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from framework.models.decode import StaticCache, _step, compiled_step, decoding_generators, generate_groups, next_tokens
from framework.models.transformer import Transformer
from framework.training.objectives.grpo import GroupRelativePolicy

PROMPTS = [[3, 7, 1, 9, 4, 4], [5, 2], [8, 1, 6]]


def tiny_lm(vocab: int = 32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2).eval()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_draws_are_torch_multinomial_s_with_the_same_generators(top_p):
    """Each prompt's rows drawn from its own generator, as torch.multinomial draws one sample
    from the same (nucleus-cut, for top_p < 1) probabilities: the same tokens."""
    torch.manual_seed(1)
    logits = torch.randn(3 * 50, 40)
    drawn = next_tokens(logits, 0.7, top_p, [torch.Generator().manual_seed(s) for s in (4, 5, 6)])
    probs = torch.softmax(logits / 0.7, -1)
    expected = []
    for part, seed in zip(probs.split(50), (4, 5, 6)):
        if top_p < 1:
            kept, order = part.sort(-1, descending=True)
            kept[kept.cumsum(-1) - kept >= top_p] = 0
            picked = torch.multinomial(kept, 1, generator=torch.Generator().manual_seed(seed))
            expected.append(order.gather(-1, picked).squeeze(-1))
        else:
            expected.append(torch.multinomial(part, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1))
    assert torch.equal(drawn, torch.cat(expected))


@torch.no_grad()
def test_the_static_cache_s_logits_are_the_forward_s_without_a_cache():
    """Left-padded prompts through the static cache (prompt, then one token a step): each row's
    last logits against the model's plain forward of that row alone (measured: equal here)."""
    model, new = tiny_lm(), [[11], [12], [13]]
    pad = torch.tensor([0, 4, 3])
    position = torch.zeros((), dtype=torch.int64)
    cache = [StaticCache(10, position, pad) for _ in model.layers]
    model.rope.prepare(model.head_dim, 10, torch.device("cpu"))
    model(torch.tensor([[0] * (6 - len(p)) + p for p in PROMPTS]), cache)
    position += 6
    stepped = model(torch.tensor(new), cache)[:, 0]
    for row, (prompt, token) in enumerate(zip(PROMPTS, new)):
        alone = model(torch.tensor([prompt + token]))[0, -1]
        torch.testing.assert_close(stepped[row], alone, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_an_eager_cpu_step_attends_over_the_written_positions_and_a_compiled_one_over_all():
    """The eager step on the CPU reads the keys written so far (position + the new tokens), not
    the whole buffer: the keys attention is handed, and the mask's width, against the position;
    a compiled step's cache (static_address) hands every position, whatever the position. The
    logits of both against the plain forward in test_the_static_cache_s_logits_... above."""
    model, pad = tiny_lm(), torch.tensor([0, 4, 3])
    model.rope.prepare(model.head_dim, 10, torch.device("cpu"))
    handed = {}
    for compiled in (False, True):
        position = torch.zeros((), dtype=torch.int64)
        cache = [StaticCache(10, position, pad, static_address=compiled) for _ in model.layers]
        widths = []
        for tokens in (torch.tensor([[0] * (6 - len(p)) + p for p in PROMPTS]), torch.tensor([[11], [12], [13]])):
            keys, _ = cache[0].extend(torch.zeros(3, tokens.shape[1], 2, 8), torch.zeros(3, tokens.shape[1], 2, 8))
            layout = cache[0].layout(model.rope, model.head_dim, tokens, torch.zeros(3, tokens.shape[1], 32))
            widths.append((keys.shape[1], layout.mask.shape[-1]))
            position += tokens.shape[1]
        handed[compiled] = widths
    assert handed == {False: [(6, 6), (7, 7)], True: [(10, 10), (10, 10)]}


@pytest.mark.parametrize("check_every", [1, 3, 0])
def test_looking_at_the_stop_every_k_tokens_or_never_gives_the_same_completions(check_every):
    """Rows past their stop are padding either way; greedy, every row stops by step 4, so an
    early look ends the loop and a late one decodes padding: the same tokens and lengths. The
    model's forwards: the prompts', then one a token drawn before the look that finds every row
    stopped (the first multiple of k at or after the longest row's length L), the last one
    drawn not fed back: k x ceil(L / k) of them; never looking, max_new_tokens."""
    model = tiny_lm()
    greedy, _ = generate_groups(model, PROMPTS, 2, 12, 0.0, 1.0, [torch.Generator()] * 3, set(), 0)
    stop = set(greedy[:, 3].tolist())  # each row's 4th token
    every, lengths = generate_groups(model, PROMPTS, 2, 12, 0.0, 1.0, [torch.Generator()] * 3, stop, 0,
                                     check_every=1)
    forwards = []
    counting = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    other, other_lengths = generate_groups(model, PROMPTS, 2, 12, 0.0, 1.0, [torch.Generator()] * 3, stop, 0,
                                           check_every=check_every)
    counting.remove()
    assert lengths.max() <= 4 and torch.equal(every, other) and torch.equal(lengths, other_lengths)
    longest = int(lengths.max())
    assert len(forwards) == (check_every * -(-longest // check_every) if check_every else 12)


@pytest.mark.timeout(600)
def test_the_compiled_step_draws_the_eager_tokens_under_the_same_seeds():
    """torch.compile of the one-token step over the static cache (CPU: inductor) against the
    eager step: sampled with top-p, the same tokens and lengths; and a second call of other
    prompts with the same capacity reuses the compiled step."""
    model, step = tiny_lm(), compiled_step(torch.device("cpu"))
    torch._dynamo.reset()  # (its counters and caches: this test's compilations alone)
    for prompts in (PROMPTS, [[1, 2, 3, 4], [9], [6, 6]]):
        runs = [generate_groups(model, prompts, 3, 10, 1.0, 0.9, decoding_generators([5, 6, 7], torch.device("cpu")),
                                {11}, 0, capacity=32, step=compiled) for compiled in (None, step)]
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    # dynamo compiled the step once (an eager step: no entry; a recompile for the second prompts:
    # two). The step's own cache entries, not dynamo's process-wide count of graphs, which another
    # test's compiled function, called again here after the reset, can add to.
    assert len(_debug_get_cache_entry_list(_step.__code__)) == 1


# -- GRPO's rollout figures on real gloo groups --------------------------------------------

LENGTHS = [[3.0, 8.0, 5.0, 1.0], [2.0, 6.0, 7.0, 4.0]]  # each DP rank's completion lengths


def max_length_on_rank(cfg_container: dict, out_dir: str) -> float:
    """(Each of 2 gloo ranks, 2 DP replicas, the objective set up from the run.) completions/max_length
    of this rank's rollout."""
    from tests.test_grpo import set_up_on_rank

    objective = set_up_on_rank(cfg_container, out_dir)
    objective._note_rollout(torch.zeros(4, dtype=torch.float64), {}, torch.tensor(LENGTHS[dist.get_rank()]),
                            torch.zeros(4, 8, dtype=torch.int64))
    dist.destroy_process_group()
    return float(objective._rollout_terms["completions/max_length"])


@pytest.mark.timeout(120)
def test_the_longest_completion_is_every_replica_s_not_an_average(tmp_path):
    """TRL's max_length: 8 on both ranks (rank 1's own is 7; averaged over DP it would be 7.5)."""
    from framework.launch.local import spawn_ranks
    from tests.test_grpo import grpo_config

    reports = spawn_ranks(2, max_length_on_rank, grpo_config("objective.group_size=2"), str(tmp_path))
    assert reports == {0: max(max(lengths) for lengths in LENGTHS), 1: 8.0}


COUNTING_REWARD = '''import json
import os


def counted(prompt, completion, answer):
    with open(os.path.join({out!r}, str(os.getpid())), "a") as f:
        f.write(json.dumps(completion) + "\\n")
    return sum(c.islower() for c in completion) / max(len(completion), 1)
'''


@pytest.mark.timeout(300)
def test_under_tp_the_reward_runs_once_a_replica_and_every_rank_learns_from_its_scores(prepared, tmp_path):
    """recipe=grpo_lm on 1x2 (TP 2, one replica) for 2 steps with a reward that notes each call
    in a file of its process: one process scored, 2 steps x 64 completions; the logged reward
    is the mean of what it returned (the share of lowercase letters, recomputed here)."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config
    from tests.test_grpo import grpo_overrides, scalars

    calls = tmp_path / "calls"
    calls.mkdir()
    reward = tmp_path / "counted.py"
    reward.write_text(COUNTING_REWARD.format(out=str(calls)))
    overrides = [o.replace("function=share", "function=counted") for o in grpo_overrides(prepared["prompts"],
                                                                                         str(reward), 2)]
    launch_local(compose_config([*overrides, "mesh=1x2", "plan=lm_tp_sp"]), str(tmp_path / "run"))
    files = list(calls.iterdir())
    assert len(files) == 1, files
    completions = [json.loads(line) for line in files[0].read_text().split("\n") if line]
    assert len(completions) == 2 * 64
    shares = [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
    logged = scalars(tmp_path / "run" / "tb")["reward"]
    assert logged == pytest.approx([sum(shares[:64]) / 64, sum(shares[64:]) / 64], abs=1e-6)
