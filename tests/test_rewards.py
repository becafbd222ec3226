"""The reward group (framework/training/objectives/rewards.py): each built-in against scores worked out by
hand, a user's function loaded from its file and called per sample, every refusal in one line
naming the key or the sample, and reward.file given on the command line only."""
import importlib.util
import sys

import pytest

from framework.cli import check_before_hydra
from framework.validate import checked_config
from framework.config.errors import ConfigError
from framework.training.objectives.rewards import RewardError, check_reward, make_reward
from tests.conftest import CONF, compose_config

GRPO = "objective._target_=framework.training.objectives.grpo.GroupRelativePolicy"


def reward(*overrides):
    return make_reward(compose_config(list(overrides)).reward)


def scores(made, completions, answers=None, prompts=None):
    return made(prompts or ["p"] * len(completions), completions, answers or [None] * len(completions))


def test_exact_match_compares_the_text_after_the_last_marker():
    made = reward("reward=exact_match")  # marker: "####"
    assert made.name == "exact_match"
    completions = ["6 x 7 = 42 #### 42", "#### 41", "42", "#### 4 #### 42 \n", "####42", "42 ####"]
    assert scores(made, completions, ["42"] * 6) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    whole = reward("reward=exact_match", "reward.marker=null")
    assert scores(whole, [" 42\n", "#### 42", "4 2"], [" 42", "42", "42"]) == [1.0, 0.0, 0.0]
    said = reward("reward=exact_match", "reward.marker=The answer is")
    assert scores(said, ["So. The answer is  Paris.", "Paris"], ["Paris.", "Paris"]) == [1.0, 0.0]


def test_regex_scores_one_where_the_pattern_is_found_anywhere():
    made = reward("reward=regex", 'reward.pattern="<answer>\\d+</answer>"')
    assert made.name == "regex"
    assert scores(made, ["so <answer>12</answer>.", "<answer>x</answer>", "<answer>1</answer", ""]) == \
        [1.0, 0.0, 0.0, 0.0]
    shipped = reward("reward=regex")  # DeepSeek-R1's <think>...</think><answer>...</answer>, newlines included
    assert scores(shipped, ["<think>a\nb</think>\n<answer>4</answer>", "<answer>4</answer><think>a</think>"]) == \
        [1.0, 0.0]


def test_length_falls_linearly_from_the_target_to_zero():
    made = reward("reward=length", "reward.target_length=10")
    assert made.name == "length"
    # 1 - |len - 10| / 10, not below 0: 0 -> 0, 5 -> 0.5, 10 -> 1, 13 -> 0.7, 20 -> 0, 25 -> 0
    got = scores(made, ["", "x" * 5, "x" * 10, "x" * 13, "x" * 20, "x" * 25])
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.7, 0.0, 0.0], abs=1e-12)


def test_char_share_is_the_share_of_characters_the_class_matches():
    made = reward("reward=char_share")  # [a-z]
    assert made.name == "char_share"
    # counted by hand: 4 of 4, 2 of 4, 0 of 3, none of none, 3 of 6 ("é" and "Z" are not [a-z])
    got = scores(made, ["abcd", "aB1c", "XYZ", "", "aébZ c"])
    assert got == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.5], abs=1e-12)
    digits = reward("reward=char_share", 'reward.pattern="[0-9]"')
    assert scores(digits, ["a1b2", "12"]) == pytest.approx([0.5, 1.0], abs=1e-12)


def test_math_verify_compares_the_final_answer_as_mathematics():
    made = reward("reward=math_verify")
    assert made.name == "math_verify"
    completions = ["half of 1 is \\boxed{0.5}", "so it is $\\frac{1}{2}$", "I get 7", "the answer is 42",
                   "it is \\boxed{1+x^2}", "anything"]
    answers = ["1/2", "0.5", "1/2", "42", "x^2+1", ""]  # a bare x^2+1 reads as math; "" as nothing: 0.0
    assert scores(made, completions, answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_a_reward_that_needs_answers_names_the_sample_without_one():
    with pytest.raises(RewardError, match=r"^reward error: reward=exact_match, sample 1 of the batch: has no answer to "
                                          r"compare with; this reward needs data whose samples carry one$"):
        scores(reward("reward=exact_match"), ["#### 1", "#### 2"], ["1", None])


USER_FILE = """
import math
import numpy
calls = []

def helper(text):
    return len(text)

def score(prompt, completion, answer):
    calls.append(prompt)
    if completion == "boom":
        return 1 / 0
    if completion == "yes":
        return "yes"
    if completion == "nan":
        return math.nan
    if completion == "bool":
        return answer == "a"
    if completion == "numpy":
        return numpy.isclose(1.0, 1.0)  # numpy's bool
    return helper(completion) + (answer == "a")

def _private(a, b, c):
    return 0

TWO = 2
def two_args(prompt, completion):
    return 0
"""


def user_file(tmp_path, body=USER_FILE):
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return path


def test_a_users_function_is_loaded_from_its_file_and_called_per_sample(tmp_path):
    path = user_file(tmp_path)
    made = reward("reward=file", f"reward.file={path}", "reward.function=score")
    assert made.name == "score"
    got = made(["p0", "p1", "p2", "p3", "p4"], ["abc", "", "bool", "bool", "numpy"], ["a", None, "a", "b", None])
    assert got == [4.0, 0.0, 1.0, 0.0, 1.0] and all(type(value) is float for value in got)
    assert made.score.__module__ == "framework_reward_file"
    assert sys.modules["framework_reward_file"].calls == ["p0", "p1", "p2", "p3", "p4"]  # once per sample, in order


def test_a_function_that_raises_or_returns_no_number_is_named_with_the_sample(tmp_path):
    path = user_file(tmp_path)
    made = reward("reward=file", f"reward.file={path}", "reward.function=score")
    where = rf"^reward error: score\(\) in {path}, sample 2 of the batch: "
    for completion, what in [("boom", r"raised ZeroDivisionError: division by zero$"),
                             ("yes", r"returned 'yes' \(str\); return a finite number \(a float, an int or a bool\)$"),
                             ("nan", r"returned nan \(float\); return a finite number")]:
        with pytest.raises(RewardError, match=where + what) as refused:
            scores(made, ["x", "y", completion], ["a", "a", "a"])
        assert "\n" not in str(refused.value)
    with pytest.raises(RewardError, match=r"score\(\) in .*: 2 prompts, 1 completions and 1 answers"):
        made(["p", "q"], ["x"], [None])


def test_a_missing_file_or_function_is_refused_naming_the_key(tmp_path):
    path = user_file(tmp_path)
    with pytest.raises(ConfigError, match=rf"^config error: reward.file='{tmp_path}/nope.py': no such file \(from "):
        reward("reward=file", f"reward.file={tmp_path}/nope.py", "reward.function=score")
    with pytest.raises(ConfigError, match=rf"^config error: reward.function='scor': {path} defines no function scor; "
                                          rf"it defines: helper, score, two_args$"):
        reward("reward=file", f"reward.file={path}", "reward.function=scor")
    with pytest.raises(ConfigError, match=r"^config error: reward.function='TWO': .* defines TWO as a int; it defines"):
        reward("reward=file", f"reward.file={path}", "reward.function=TWO")
    with pytest.raises(ConfigError, match=r"^config error: reward.function='two_args': is called as "
                                          r"two_args\(prompt, completion, answer\), and .*'s takes "
                                          r"two_args\(prompt, completion\)$"):
        reward("reward=file", f"reward.file={path}", "reward.function=two_args")
    with pytest.raises(ConfigError, match=r"^config error: reward.file=None: give the Python file on the command line: "
                                          r"reward=file reward.file=my_rewards.py reward.function=score$"):
        reward("reward=file")
    with pytest.raises(ConfigError, match=r"^config error: reward.function=None: name the function"):
        reward("reward=file", f"reward.file={path}")
    broken = user_file(tmp_path, "def score(prompt, completion, answer)\n    return 1\n")
    with pytest.raises(ConfigError, match=rf"^config error: reward.file='{broken}': importing it raised SyntaxError: "):
        reward("reward=file", f"reward.file={broken}", "reward.function=score")


def test_combined_sums_its_parts_scores_times_their_weights_and_keeps_each_for_its_curve(tmp_path):
    path = user_file(tmp_path, "def score(prompt, completion, answer):\n    return len(completion) % 3\n")
    made = reward("reward=combined", f"reward.file={path}", "reward.function=score",
                  "reward.parts=[{kind: exact_match, marker: '=', weight: 2.0}, {kind: length, target_length: 4, "
                  "weight: -0.5, name: brevity}, {kind: file, weight: 0.25}]")
    assert list(made.curves()) == ["exact_match", "brevity", "score"]
    completions = ["x = 7", "= 8", "abcd"]
    got = made(["p"] * 3, completions, ["7", "7", "7"])
    match = [1.0, 0.0, 0.0]  # the text after the last "=" is the answer
    brevity = [max(0.0, 1 - abs(len(c) - 4) / 4) for c in completions]
    own = [len(c) % 3 for c in completions]
    assert got == pytest.approx([2.0 * m - 0.5 * b + 0.25 * o for m, b, o in zip(match, brevity, own)], abs=1e-12)
    assert made.curves() == {"exact_match": match, "brevity": pytest.approx(brevity), "score": own}
    shipped = reward("reward=combined")  # exact_match on "####" (weight 1) + DeepSeek-R1's format (0.5)
    assert shipped(["p"] * 2, ["<think>a</think><answer>x</answer>#### 3", "#### 3"], ["3", "3"]) == [1.5, 1.0]


def test_a_combined_part_takes_its_own_keys_not_the_top_level_ones():
    """reward.marker set beside reward=combined reaches no part: an exact_match part without a
    marker compares the whole completion."""
    made = reward("reward=combined", "reward.marker=ZZ", "reward.parts=[{kind: exact_match}]")
    assert made(["p", "p"], ["ZZ 3", "3"], ["3", "3"]) == [0.0, 1.0]


@pytest.mark.parametrize("parts, line", [
    ("[]", r"reward.parts=\[\]: name the rewards to combine"),
    ("[{kind: regex}]", r"reward.parts\[0\].pattern=None: give the regular expression"),
    ("[{kind: length, target_length: 5}, {kind: bleu}]", r"reward.parts\[1\].kind='bleu': use one of exact_match, "
                                                         r"regex, char_share, length, math_verify, file$"),
    ("[{kind: regex, pattern: a}, {kind: regex, pattern: b}]", r"reward.parts\[1\].name=None: regex names part 0 "
                                                               r"too; give each part its own name"),
    ("[{kind: length, target_length: 5, weight: heavy}]", r"reward.parts\[0\].weight='heavy': must be a finite "
                                                          r"number"),
    ("[{kind: file, file: evil.py}]", r"reward.parts\[0\].file='evil.py': a part's function comes from the command "
                                      r"line's reward.file; give the part kind: file$"),
    ("[{kind: file}]", r"reward.file=None: reward.parts\[0\] is kind: file, which scores with the command line's "
                       r"function: give reward.file=my_rewards.py reward.function=score$"),
], ids=["no_parts", "no_pattern", "unknown_kind", "same_name", "bad_weight", "file_in_a_part", "no_file"])
def test_a_bad_combined_reward_is_refused_naming_the_part_s_key(parts, line):
    with pytest.raises(ConfigError, match="^config error: " + line):
        checked(GRPO, "reward=combined", f"reward.parts={parts}")


def test_two_file_parts_are_refused_the_command_line_names_one_function(tmp_path):
    with pytest.raises(ConfigError, match=r"^config error: reward.parts\[1\].kind='file': part 0 is kind: file too, and "
                                          r"both would score with the one function the command line names"):
        reward("reward=combined", f"reward.file={user_file(tmp_path)}", "reward.function=score",
               "reward.parts=[{kind: file, name: a}, {kind: file, name: b}]")


def checked(*overrides):
    check_reward(checked_config(compose_config(list(overrides))))


def test_check_reward_refuses_before_launch_what_grpo_could_not_score_with(tmp_path, monkeypatch):
    for overrides, line in [
        ([], r"reward.kind='none': objective=grpo scores its completions with a reward; choose one: "
             r"reward=exact_match, regex, char_share, length, math_verify, or file \(your own function\)$"),
        (["reward.kind=bleu"], r"reward.kind='bleu': use one of none, exact_match, regex, char_share, length, "
                                    r"math_verify, file, combined$"),
        (["reward=regex", "reward.pattern='(<answer>'"], r"reward.pattern='\(<answer>': is not a regular expression "
                                                       r"\(missing \), unterminated subpattern at position 0\)"),
        (["reward=regex", "reward.pattern=null"], r"reward.pattern=None: give the regular expression"),
        (["reward=length", "reward.target_length=0"], r"reward.target_length=0: must be >= 1 \(characters\)$"),
        (["reward=exact_match", "reward.marker=''"], r"reward.marker='': an empty marker marks nothing"),
        (["reward=file", f"reward.file={tmp_path}/nope.py", "reward.function=score"], r"reward.file=.*: no such file"),
    ]:
        with pytest.raises(ConfigError, match="^config error: " + line):
            checked(GRPO, *overrides)
    for shipped in ("exact_match", "regex", "length"):
        checked(GRPO, f"reward={shipped}")
    checked(GRPO, "reward=file", f"reward.file={user_file(tmp_path)}", "reward.function=score")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "math_verify" else find_spec(name, *args))
    with pytest.raises(ConfigError, match=r"^config error: reward.kind='math_verify': needs math-verify, not installed "
                                          r"here; pip install '.\[rl\]'"):
        checked(GRPO, "reward=math_verify")


def test_another_objective_takes_no_reward_and_never_imports_a_file(tmp_path):
    marker = tmp_path / "imported"
    path = user_file(tmp_path, f"open({str(marker)!r}, 'w').close()\ndef score(p, c, a):\n    return 0\n")
    checked()  # objective=mse, reward=none: nothing to check
    with pytest.raises(ConfigError, match=r"^config error: reward.kind='file': only objective=grpo scores "
                                          r"completions; drop the reward \(reward=none\) or use objective=grpo$"):
        checked("reward=file", f"reward.file={path}", "reward.function=score")
    assert not marker.exists()
    checked(GRPO, "reward=file", f"reward.file={path}", "reward.function=score")
    assert marker.exists()


def test_every_reward_file_composes_and_file_leaves_the_code_to_the_command_line():
    options = sorted(p.stem for p in (CONF / "reward").glob("*.yaml"))
    assert options == ["char_share", "combined", "exact_match", "file", "length", "math_verify", "none", "regex"]
    for option in options:
        cfg = compose_config([f"reward={option}"])
        assert cfg.reward.kind == option
    assert compose_config(["reward=file"]).reward.file is None


def config_dir(tmp_path, group_file: str, recipe: str):
    """Someone else's configs (--config-dir): conf/reward/evil.yaml and conf/recipe/evil.yaml."""
    for group, body in (("reward", group_file), ("recipe", "# @package _global_\n" + recipe)):
        (tmp_path / "conf" / group).mkdir(parents=True)
        (tmp_path / "conf" / group / "evil.yaml").write_text(body)
    return str(tmp_path / "conf")


def test_reward_file_may_be_set_on_the_command_line_only(tmp_path):
    path = user_file(tmp_path, f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    conf = config_dir(tmp_path, f"kind: file\nfile: {path}\nfunction: score\n",
                      f"reward:\n  kind: file\n  file: {path}\n  function: score\n")
    refused = rf"^config error: reward.file='{path}': a config file may not set a Python file whose function " \
              rf"scores completions \(it runs as code\); give it on the command line$"
    for overrides in (["recipe=evil"], ["reward=evil"], ["reward=file", "recipe=evil"]):
        for mode in ([], ["-m"]):
            with pytest.raises(ConfigError, match=refused):
                check_before_hydra([*mode, "--config-dir", conf, *overrides])
    check_before_hydra(["reward=file", f"reward.file={path}", "reward.function=score"])
    check_before_hydra(["--config-dir", conf, "reward=evil", f"reward.file={path}"])  # the command line's own
    assert compose_config(["reward=file", f"reward.file={path}"]).reward.file == str(path)
    assert not (tmp_path / "imported").exists()
