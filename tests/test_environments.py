"""objective=grpo with an environment (framework.training.objectives.environments, .turns): the two
shipped environments against their rules worked by hand, the turn loop against a hand-played
transcript, the environment's tokens out of the loss (the gradient at them 0, by hand on one
sequence), a failing environment costing only its completions, the recipes learning from
chance, a sharded mesh following one process, and the refusals."""
import json
import os
import time

import pytest
import torch

import framework

from framework.config.errors import ConfigError
from framework.data.batch import IGNORE, Batch
from framework.training.objectives.environments import Calculator, Environment, GuessDigit
from framework.training.objectives.turns import take_turns


def test_the_calculator_answers_the_last_expression_written_and_rewards_the_last_number():
    tool = Calculator("What is 34+36?", "70")
    assert tool.respond("=") == "70"  # none of its own: the prompt's
    assert tool.respond("I will add 3 * 4 - 5=") == "7"  # its own, last, evaluated left to right as Python does
    assert tool.respond("12+3=x 2*3*4=") == "24"
    assert Calculator("no sum here", "1").respond("=") == "?"
    assert tool.reward("=70") == 1.0 and tool.reward("=70=") == 1.0
    assert tool.reward("=70 and 5") == 0.0 and tool.reward("nothing") == 0.0 and tool.reward("=7") == 0.0


def test_guess_digit_plays_by_its_rules():
    game = GuessDigit("Guess my digit:", "6")
    assert game.respond("3.") == "+"           # turn 1 names 3: higher
    assert game.respond("3.+x.") == "?"        # turn 2 names nothing
    assert game.respond("3.+x.?98.") == "-"    # turn 3 names 9 (its first digit): lower
    assert game.reward("3.+x.?98.-7") == pytest.approx(1 - 3 / 9)  # an unended last turn names nothing: 9 stands
    assert game.reward("3.+x.?98.-7.") == pytest.approx(1 - 1 / 9)  # ended: 7
    found = GuessDigit("Guess my digit:", "6")
    assert found.respond("6.") is None and found.reward("6.") == 1.0
    assert GuessDigit("Guess my digit:", "6").reward("6") == 0.0  # no turn ended: nothing named
    with pytest.raises(ValueError, match="a digit 0-9; this sample's is '12'"):
        GuessDigit("Guess my digit:", "12")


def test_turns_append_the_answers_unwritten_and_keep_to_the_budget_and_the_turns():
    """Three completions played by hand, marker 9: one stops at the end of text (0) at once, one
    asks twice, one is cut by the budget inside an answer."""
    prompts = [[1], [1], [2]]
    first = [[5, 0], [5, 9], [6, 6, 6, 9]]
    replies = {1: [[7, 7], [8]], 2: [[4, 4, 4, 4]]}
    turns_seen = []

    def answer(rows, completions):
        return [replies[r].pop(0) for r in rows]

    def decode(rows, histories, turn, room):
        turns_seen.append((rows, [len(h) for h in histories], turn, room))
        return [[3, 9] for _ in rows], [[-0.5, -0.25] for _ in rows]

    drawn = (first, [[-1.0] * len(row) for row in first])
    played = take_turns(drawn, prompts, budget=7, max_turns=3, marker=9, answer=answer, decode=decode)
    assert played.tokens == [[5, 0], [5, 9, 7, 7, 3, 9, 8], [6, 6, 6, 9, 4, 4, 4]]
    assert played.written == [[True, True], [True, True, False, False, True, True, False],
                              [True, True, True, True, False, False, False]]
    assert played.logps == [[-1.0, -1.0], [-1.0, -1.0, 0.0, 0.0, -0.5, -0.25, 0.0], [-1.0] * 4 + [0.0] * 3]
    assert played.turns == [1, 2, 1]
    # turn 2 decodes row 1 alone (row 2's answer filled its budget), from its prompt and all it holds
    assert turns_seen == [([1], [5], 2, 3)]


def _episodes(cls, timeout: float = 5.0, rows: int = 2):
    return Environment(cls, "=", 3, timeout, "test").episodes(["p"] * rows, ["1"] * rows)


class Sleeper:
    def __init__(self, prompt, answer):
        pass

    def respond(self, completion):
        if completion == "slow":
            time.sleep(60)
        if completion == "raise":
            raise KeyError("no such tool")
        return 3 if completion == "number" else "ok"

    def reward(self, completion):
        return 1.0


def test_an_episode_that_raises_or_answers_wrong_fails_alone_and_one_that_hangs_within_the_time_limit():
    """A turn's answers one after another: one that raises and one that answers an int fail
    alone; one that hangs fails after timeout_s, and the one after it, unanswered, with it."""
    episodes = _episodes(Sleeper, timeout=0.5, rows=5)
    start = time.monotonic()
    assert episodes.respond([0, 1, 2, 3, 4], ["raise", "number", "fine", "slow", "fine"]) == [None, None, "ok", None,
                                                                                              None]
    assert time.monotonic() - start < 5  # (the hung answer is left to its daemon thread)
    assert episodes.failed == ["raised KeyError: 'no such tool'", "respond() returned a int; return text or None",
                               None, "took longer than environment.timeout_s=0.5",
                               "not answered: an episode before it in the turn took longer than "
                               "environment.timeout_s=0.5"]
    assert episodes.rewards(["a", "b", "c", "d", "e"]) == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert episodes.respond([0, 2], ["fine", "fine"]) == [None, "ok"]  # a failed episode is not called again


def calculator_objective(*overrides: str):
    """recipe=grpo_calculator's objective, set up in one process on a tiny random model."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from framework.models.transformer import Transformer
    from framework.parallel.device import resolve_device
    from framework.training.objectives.context import ObjectiveContext
    from framework.training.objectives.grpo import GroupRelativePolicy
    from tests.conftest import QUIET, compose_config

    cfg = compose_config(["recipe=grpo_calculator", *QUIET, "mesh=1x1", "mesh.device_type=cpu", *overrides])
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    dataset = instantiate(cfg.data.dataset, split="train")
    torch.manual_seed(0)
    model = Transformer(vocab_size=cfg.model.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    objective = GroupRelativePolicy(**{k: v for k, v in cfg.objective.items() if k != "_target_"})
    objective.setup(ObjectiveContext(cfg=cfg, device=resolve_device("cpu", 1), module=model, model=model,
                                     head=objective.head, dataset=dataset))
    return objective, model, dataset


def test_the_tool_s_tokens_are_inputs_never_targets_and_carry_no_gradient():
    """One rollout on a model made to write the marker at every position (greedy): each completion
    is "=" (turn 1), the sum the tool appends, "=" (turn 2, the last). By hand, on the first
    sequence: the targets are the two "="s alone (the sum's tokens are inputs, their targets
    -100), and the loss's gradient at the sum's positions is exactly 0, at the "="s not."""
    from framework.training.objectives.grpo import GroupRelativePolicy  # noqa: F401 (what calculator_objective makes)

    objective, model, dataset = calculator_objective("objective.temperature=0")
    marker = ord("=")
    with torch.no_grad():  # the residual stream's dim 0 dominates, and only "=" reads it
        model.tok_embeddings.weight[:, 0] = 100.0
        model.output.weight.zero_()
        model.output.weight[marker, 0] = 1.0
    sample = dataset[0]
    batch = Batch(sample["inputs"][None], sample["targets"][None], index=torch.tensor([0]))
    rolled = objective.generated(model, batch, step=0)
    record = json.loads(open(os.path.join(os.path.dirname(dataset.path), "arithmetic.jsonl")).readline())
    prompt, total = list(record["prompt"].encode()), list(record["answer"].encode())
    sequence = prompt + [marker] + total + [marker]
    inputs, targets = rolled.inputs[0, 0], rolled.targets[0, 0]  # (the first prompt's first completion)
    assert inputs[:len(sequence) - 1].tolist() == sequence[:-1]
    by_hand = [IGNORE] * len(inputs)
    by_hand[len(prompt) - 1] = marker                    # turn 1: "=" after the prompt
    by_hand[len(prompt) + len(total)] = marker           # turn 2: "=" after the tool's sum
    assert targets.tolist() == by_hand
    assert objective._rollout_terms["environment/turns"] == 2.0
    assert objective._rollout_terms["reward"] == 1.0     # the last number is the tool's: the sum
    logits = model(rolled.inputs.flatten(0, 1)).detach().requires_grad_()
    advantages = torch.ones(rolled.targets.shape[:2]).flatten()
    objective.loss_sum((logits, advantages, None, None, None), rolled.targets).backward()
    per_position = logits.grad[0].abs().sum(-1)
    tool = range(len(prompt), len(prompt) + len(total))  # where the inputs are "=" and the sum's first digits
    assert all(per_position[p] == 0 for p in tool), per_position
    assert per_position[len(prompt) - 1] > 0 and per_position[len(prompt) + len(total)] > 0
    assert int((per_position > 0).sum()) == 2


def scalars(tb_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def recipe(name: str, steps: int, *overrides: str) -> list:
    return [f"recipe={name}", f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.progress_bar=false",
            "checkpoint.every=null", *overrides]


@pytest.fixture(scope="module")
def calculator_1x1(tmp_path_factory) -> dict:
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    out = tmp_path_factory.mktemp("calculator_1x1")
    summary = launch_local(compose_config(recipe("grpo_calculator", 20, "mesh=1x1")), str(out))
    return {"summary": summary, "scalars": scalars(out / "tb")}


def test_the_calculator_recipe_learns_to_ask_the_tool(calculator_1x1):
    """From chance (a random model writes "=" now and then) to asking on nearly every completion."""
    reward, turns = calculator_1x1["scalars"]["reward"], calculator_1x1["scalars"]["environment/turns"]
    # measured on 1x1: reward 0.016 at step 1, at most 0.047 to step 11, 0.92-0.984 over steps 17-20 (the last 4);
    # turns 1.02 at step 1, 1.92-2.0 over steps 17-20
    assert max(reward[:5]) < 0.1 and min(reward[-4:]) > 0.9, " ".join(f"{r:.3f}" for r in reward)
    assert turns[0] < 1.1 and min(turns[-4:]) > 1.9
    assert calculator_1x1["scalars"]["environment/failures"] == [0.0] * 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [
    ["mesh=2x1", "parallel.dp_strategy=fsdp"],
    pytest.param(["mesh=1x2", "plan=lm_tp_sp"], marks=pytest.mark.integration),
], ids=["fsdp_2x1", "tp_sp_1x2"])
def test_every_mesh_plays_the_episodes_one_process_plays(mesh, calculator_1x1, tmp_path):
    """The same prompts draw the same turns on every mesh (each turn's sampling is seeded by the
    step, the prompt, its place in the group and the turn): under FSDP2 every replica decodes the
    turns any replica needs, under TP the group's rank 0 runs the tool for all."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    summary = launch_local(compose_config(recipe("grpo_calculator", 20, *mesh)), str(tmp_path))
    ours, theirs = calculator_1x1["scalars"], scalars(tmp_path / "tb")
    assert theirs["reward"] == pytest.approx(ours["reward"], abs=1e-6)
    assert theirs["environment/turns"] == ours["environment/turns"]
    assert theirs["completions/mean_length"] == ours["completions/mean_length"]
    # (measured as in test_grpo's meshes: losses within 1.3e-8, grad norms 1.3e-7 relative; bounds 10x and more)
    assert summary["grad_norms"] == pytest.approx(calculator_1x1["summary"]["grad_norms"], rel=1e-5, abs=1e-6)
    assert summary["losses"] == pytest.approx(calculator_1x1["summary"]["losses"], abs=1e-6)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_guess_digit_recipe_learns_to_read_the_game_s_answers(tmp_path):
    """From chance to above what guessing blind can score on the shipped digits (0.70, always 3):
    the model takes several turns, and only the game's answers tell it more than the blind guess."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    launch_local(compose_config(recipe("grpo_guess_digit", 100, "mesh=1x1", "launcher.threads_per_rank=1")),
                 str(tmp_path))
    reward, turns = scalars(tmp_path / "tb")["reward"], scalars(tmp_path / "tb")["environment/turns"]
    last = sum(reward[-20:]) / 20  # measured on 1x1: 0.018 over steps 1-5, 0.807 over 81-100; turns 3.35 there
    assert sum(reward[:5]) / 5 < 0.2 and last > 0.75, (reward[:5], last)
    assert sum(turns[-20:]) / 20 > 2


FLAKY_TOOL = """
class Flaky:
    marker = "="

    def __init__(self, prompt, answer):
        if int(prompt[:2]) % 2:
            raise RuntimeError("no tool for odd numbers")

    def respond(self, completion):
        return "1"

    def reward(self, completion):
        return 1.0
"""


@pytest.mark.timeout(300)
def test_an_environment_that_raises_costs_only_its_completions(tmp_path):
    """A tool that cannot start for prompts whose first number is odd: those completions score 0
    and are counted, every other one scores 1 (so each step's reward is 1 less the failed share,
    exactly), and the run ends normally."""
    from framework.launch.local import launch_local
    from tests.conftest import compose_config

    tool = tmp_path / "flaky.py"
    tool.write_text(FLAKY_TOOL)
    summary = launch_local(compose_config(recipe("grpo_calculator", 6, "mesh=1x1", "environment=file",
                                                 f"environment.file={tool}", "environment.name=Flaky")),
                           str(tmp_path / "run"))
    assert summary["steps"] == 6
    logged = scalars(tmp_path / "run" / "tb")
    prompts = [json.loads(line)["prompt"] for line in open(os.path.join(os.path.dirname(framework.__file__),
                                                                       "prompts", "arithmetic.jsonl"))]
    odd = sum(int(p[:2]) % 2 for p in prompts) / len(prompts)
    assert 0 < min(logged["environment/failures"]) and max(logged["environment/failures"]) < 1
    assert sum(logged["environment/failures"]) / 6 == pytest.approx(odd, abs=0.25)  # (6 batches of 8 of the 64)
    assert logged["reward"] == pytest.approx([1 - f for f in logged["environment/failures"]], abs=1e-9)


@pytest.mark.parametrize("overrides,message", [
    (["environment.max_turns=0"], r"^config error: environment.max_turns=0: must be >= 1"),
    (["environment.timeout_s=0"], r"^config error: environment.timeout_s=0.0: must be > 0"),
    (["environment.marker=::"], r"^config error: environment.marker='::': is 2 tokens of the data's tokenizer "
                                r"\(\[58, 58\]\); the decoder stops at one token"),
    (["reward=exact_match"], r"^config error: reward.kind='exact_match': environment=calculator scores its own "
                             r"episodes \(its reward\(\)\); drop the reward \(reward=none\)$"),
    (["environment=file"], r"^config error: environment.file=None: give the Python file on the command line"),
    (["environment=file", "environment.file=nowhere.py", "environment.name=Tool"],
     r"^config error: environment.file='nowhere.py': no such file"),
    (["environment=file", "environment.file={tool}", "environment.name=Tol"],
     r"^config error: environment.name='Tol': .*tool.py defines no class Tol; it defines: NoRespond, Tool$"),
    (["environment=file", "environment.file={tool}", "environment.name=NoRespond"],
     r"^config error: environment.name='NoRespond': .*NoRespond has no respond\(self, completion\) method"),
    (["environment=file", "environment.file={tool}", "environment.name=Tool"],
     r"^config error: environment.marker=None: Tool in .*tool.py sets no marker; give the text that ends a model's "
     r"turn"),
    (["environment=file", "environment.file={tool}", "environment.name=Tool", "environment.marker=@"],
     r"^config error: reward.kind='none': Tool in .*tool.py has no reward\(\) of its own; choose one"),
    (["environment=guess_digit"],
     r"^config error: environment.kind='guess_digit': environment=guess_digit cannot start an episode on the data's "
     r"first prompt \(ValueError: guess_digit hides the sample's answer, a digit 0-9; this sample's is '70'\)"),
    (["objective=lm", "data=byte_corpus"],
     r"^config error: environment.kind='calculator': only objective=grpo decodes completions in turns"),
])
def test_bad_environment_configs_are_refused_before_launch_naming_the_key(overrides, message, tmp_path):
    from framework.validate import validate
    from tests.conftest import compose_config

    tool = tmp_path / "tool.py"
    tool.write_text("class Tool:\n    def __init__(self, prompt, answer):\n        pass\n\n"
                    "    def respond(self, completion):\n        return 'ok'\n\n\nclass NoRespond:\n    pass\n")
    overrides = [o.replace("{tool}", str(tool)) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(recipe("grpo_calculator", 2, "mesh=1x1", *overrides)))


def test_environment_file_may_be_set_on_the_command_line_only(tmp_path):
    """A recipe or group file from someone else may not name the code to run; the command line may."""
    from framework.cli import check_before_hydra

    path = tmp_path / "tool.py"
    path.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    conf = tmp_path / "conf"
    for group, body in (("environment", f"kind: file\nfile: {path}\nname: Tool\n"),
                        ("recipe", f"# @package _global_\nenvironment:\n  kind: file\n  file: {path}\n  name: Tool\n")):
        (conf / group).mkdir(parents=True)
        (conf / group / "evil.yaml").write_text(body)
    refused = rf"^config error: environment.file='{path}': a config file may not set a Python file whose class " \
              rf"answers completions between turns \(it runs as code\); give it on the command line$"
    for overrides in (["recipe=evil"], ["environment=evil"], ["environment=file", "recipe=evil"]):
        with pytest.raises(ConfigError, match=refused):
            check_before_hydra(["--config-dir", str(conf), *overrides])
    check_before_hydra(["environment=file", f"environment.file={path}", "environment.name=Tool"])
    assert not (tmp_path / "imported").exists()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_turns_and_stale_rollouts_on_transformers_classes_follow_the_native_path(hf_dirs, prepared, tmp_path):
    """The tiny Llama with the calculator and max_staleness=1: decoding through transformers' own
    cache (model.backend=transformers) draws the turns the native path draws, with the same
    rewards, and learns the same steps."""
    from framework.launch.local import launch_local
    from tests.test_grpo import LOWERCASE_SHARE
    from tests.test_transformers_models import grpo_run

    (tmp_path / "reward.py").write_text(LOWERCASE_SHARE)
    runs = {}
    for backend in ("native", "transformers"):
        cfg = grpo_run(hf_dirs["llama"], prepared["prompts"], str(tmp_path / "reward.py"), f"model.backend={backend}",
                       "environment=calculator", "reward=none", "objective.max_staleness=1",
                       "objective.group_size=8", "objective.max_new_tokens=16")
        runs[backend] = (launch_local(cfg, str(tmp_path / backend)), scalars(tmp_path / backend / "tb"))
    (native, ours), (theirs_summary, theirs) = runs["native"], runs["transformers"]
    assert theirs["environment/turns"] == ours["environment/turns"] and max(ours["environment/turns"]) > 1
    assert theirs["reward"] == pytest.approx(ours["reward"], abs=1e-6)
    assert theirs["staleness"] == ours["staleness"] == [0.0, 1.0, 1.0]
    assert theirs["sampling/ratio_max"] == pytest.approx(ours["sampling/ratio_max"], rel=1e-4)
    assert theirs_summary["losses"] == pytest.approx(native["losses"], abs=1e-6)
