"""`reward=...` (conf/reward/): what scores objective=grpo's completions.

A reward is called on a batch, `reward(prompts, completions, answers) -> [float, ...]`, one
score per completion, and its `name` labels its TensorBoard curve. Each sample is scored on its
own (GRPO compares the scores of one prompt's completions, so only differences within a group
matter, not the scale):
- exact_match: 1.0 when the completion's text after the last `marker` (the whole completion
  with marker=null), stripped, equals the answer, stripped; 0.0 otherwise, and for a completion
  without the marker (it did not answer in the asked form);
- regex: 1.0 when `re.search(pattern, completion)` finds the pattern, else 0.0 (a format reward;
  flags go inline: `(?s)`, `(?m)`, `(?i)`);
- char_share: the share of the completion's characters that `pattern` matches alone (a
  character class such as `[a-z]`), 0.0 for an empty completion: a graded score, where a toy
  task's all-or-nothing regex leaves every group of a random model at 0 and so teaches nothing;
- length: max(0, 1 - |len(completion) - target_length| / target_length), in characters (a
  tokenizer's counts would tie a config to one tokenizer): 1.0 at the target, 0.0 at twice it
  or at none;
- math_verify: 1.0 when Hugging Face's math-verify finds the completion's last mathematical
  expression (a \\boxed{} one first) equal to the answer (1/2, 0.5 and \\frac{1}{2} agree);
  an answer it cannot read scores every completion 0.0, so that prompt's group teaches nothing
  (TRL's accuracy_reward skips it);
- file: a function of your own, `function(prompt, completion, answer) -> number`, from a Python
  file given on the command line only (framework.config.trust: recipes and group files from
  others must not choose code to run);
- combined: the weighted sum of `parts`, each a built-in's keys (or kind: file, the command
  line's reward.file) with a `weight` (TRL's reward_funcs with reward_weights); each part's mean
  gets its own curve, rewards/<name> (`name`, default its kind or function).
exact_match and math_verify need each sample's answer (None: RewardError). A score that is not
a finite number, or a function that raises, stops the run with one line naming the function,
its file and the sample's index in the batch (RewardError): a reward quietly 0 would train on.
"""
import importlib.util
import inspect
import math
import os
import re
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.config.schema import RewardConfig
from framework.training.objectives.base import objective_kind

KINDS = ("none", "exact_match", "regex", "char_share", "length", "math_verify", "file", "combined")
PART_KEYS = ("kind", "weight", "name", "marker", "pattern", "target_length")  # what a combined part may set
INSTALL = "pip install '.[rl]' (the math-verify package)"
USER_MODULE = "framework_reward_file"  # the name a reward.file is imported under

Score = Callable[[str, str, Optional[str]], Any]


class RewardError(RuntimeError):
    """A sample the reward could not score: one line naming the reward (a user's function and its
    file), the sample's index in the batch and what it raised or returned."""


class Reward:
    """Scores a batch, one float per completion; `name` labels its curve (exact_match, or the
    user's function's name)."""

    def __init__(self, name: str, score: Score, where: str):
        self.name, self.score, self.where = name, score, where

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 answers: Sequence[Optional[str]]) -> List[float]:
        if not len(prompts) == len(completions) == len(answers):
            raise RewardError(f"reward error: {self.where}: {len(prompts)} prompts, {len(completions)} completions "
                              f"and {len(answers)} answers; give one of each per sample")
        return [self._scored(index, *sample) for index, sample in enumerate(zip(prompts, completions, answers))]

    def _scored(self, index: int, prompt: str, completion: str, answer: Optional[str]) -> float:
        at = f"reward error: {self.where}, sample {index} of the batch"
        try:
            value = self.score(prompt, completion, answer)
        except RewardError as error:  # a built-in's own words
            raise RewardError(f"{at}: {error}") from None
        except Exception as error:
            said = _one_line(error)
            raise RewardError(f"{at}: raised {type(error).__name__}{': ' + said if said else ''}") from error
        number = _number(value)
        if number is None or not math.isfinite(number):
            raise RewardError(f"{at}: returned {_one_line(repr(value))} ({type(value).__name__}); return a finite "
                              f"number (a float, an int or a bool)")
        return number

    def curves(self) -> Dict[str, List[float]]:
        """The last batch's scores of each part with a curve of its own, by name (combined's
        parts; before any batch, no scores)."""
        return {}

    def __repr__(self) -> str:
        return f"Reward({self.where})"


class WeightedSum(Reward):
    """reward=combined: each part's score times its weight, summed."""

    def __init__(self, parts: List[Tuple[float, Reward]]):
        super().__init__("combined", None, "reward=combined")
        self.parts = parts
        self.last: Dict[str, List[float]] = {reward.name: [] for _, reward in parts}

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 answers: Sequence[Optional[str]]) -> List[float]:
        self.last = {reward.name: reward(prompts, completions, answers) for _, reward in self.parts}
        weights = [weight for weight, _ in self.parts]
        return [sum(w * score for w, score in zip(weights, scores)) for scores in zip(*self.last.values())]

    def curves(self) -> Dict[str, List[float]]:
        return self.last


def _number(value: object) -> Optional[float]:
    """A score as a float: anything float() takes as a number (a bool as 0 or 1, numpy's scalars, a
    one-element tensor), never a string float() would parse."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _one_line(text: object, limit: int = 200) -> str:
    words = " ".join(str(text).split())
    return words if len(words) <= limit else words[: limit - 3] + "..."


def _needs(answer: Optional[str]) -> str:
    if answer is None:
        raise RewardError("has no answer to compare with; this reward needs data whose samples carry one")
    return answer


def exact_match(marker: Optional[str]) -> Score:
    def score(prompt: str, completion: str, answer: Optional[str]) -> float:
        expected = _needs(answer).strip()
        if marker is None:
            return float(completion.strip() == expected)
        before, found, after = completion.rpartition(marker)
        return float(bool(found) and after.strip() == expected)
    return score


def regex(pattern: str) -> Score:
    compiled = re.compile(pattern)
    return lambda prompt, completion, answer: float(compiled.search(completion) is not None)


def char_share(pattern: str) -> Score:
    compiled = re.compile(pattern)
    return lambda prompt, completion, answer: sum(compiled.fullmatch(c) is not None for c in completion) / \
        max(len(completion), 1)


def length(target: int) -> Score:
    return lambda prompt, completion, answer: max(0.0, 1.0 - abs(len(completion) - target) / target)


def math_verified() -> Score:
    from math_verify import parse, verify

    def score(prompt: str, completion: str, answer: Optional[str]) -> float:
        answer = _needs(answer)
        # math-verify's time limits are SIGALRM alarms, which only the main thread may set
        main = threading.current_thread() is threading.main_thread()
        parsing, checking = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
        gold = parse(answer, **parsing) or parse(f"${answer}$", **parsing)  # a bare x^2+1 reads as math too
        return float(bool(gold) and verify(gold, parse(completion, **parsing), **checking))
    return score


def load_definition(path: str, name: str, section: str, name_key: str, kind: Callable[[Any], bool],
                    what: str, listed: Callable[[Any], bool]) -> Any:
    """The `what` (function, class: `kind` takes it) called `name` in the Python file at `path`
    (a wrong name lists the file's `listed` ones),
    the file imported (its top level runs: only a file given on the command line gets here); a
    missing file or name is a ConfigError naming `section`.file or `section`.`name_key`."""
    if not os.path.isfile(path):
        raise ConfigError(f"{section}.file", path, f"no such file (from {os.getcwd()}); give the Python file that "
                                                   f"defines {name or 'your ' + what}")
    spec = importlib.util.spec_from_file_location(USER_MODULE, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{section}.file", path, "is not a Python file Python can import; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[USER_MODULE] = module  # (dataclasses and pickle look a class's module up there)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[USER_MODULE]
        raise ConfigError(f"{section}.file", path, f"importing it raised {type(error).__name__}: "
                                                   f"{_one_line(error)}") from None
    found = getattr(module, name, None)
    if not kind(found):
        defined = sorted(key for key, value in vars(module).items()
                         if listed(value) and value.__module__ == USER_MODULE and not key.startswith("_"))
        said = f"defines no {what} {name}" if found is None else f"defines {name} as a {type(found).__name__}"
        raise ConfigError(f"{section}.{name_key}", name, f"{path} {said}; it defines: "
                                                         f"{', '.join(defined) or 'no ' + what + 's'}")
    return found


def load_function(path: str, name: str) -> Callable:
    """The scoring function `name` of the Python file at `path` (load_definition's), called as
    function(prompt, completion, answer)."""
    found = load_definition(path, name, "reward", "function", callable, "function", inspect.isfunction)
    try:
        inspect.signature(found).bind("prompt", "completion", "answer")
    except TypeError:
        raise ConfigError("reward.function", name, f"is called as {name}(prompt, completion, answer), and {path}'s "
                                                   f"takes {name}{inspect.signature(found)}") from None
    except ValueError:  # a callable without a signature Python can read (a builtin): called as it is
        pass
    return found


def _user_function(reward: Any) -> Reward:
    if reward.file is None:
        raise ConfigError("reward.file", None, "give the Python file on the command line: reward=file "
                                               "reward.file=my_rewards.py reward.function=score")
    if not reward.function:
        raise ConfigError("reward.function", reward.function, "name the function in reward.file that scores a "
                                                              "sample, on the command line: reward.function=score")
    path = os.path.expanduser(reward.file)
    function = load_function(path, reward.function)
    return Reward(reward.function, function, f"{reward.function}() in {path}")


def _pattern(reward: Any) -> Score:
    if reward.pattern is None:
        raise ConfigError("reward.pattern", None, "give the regular expression a completion must contain")
    try:
        return regex(reward.pattern)
    except re.error as error:
        raise ConfigError("reward.pattern", reward.pattern, f"is not a regular expression ({error}); Python's re "
                                                            f"syntax, e.g. '<answer>.*?</answer>'") from None


def _character_class(reward: Any) -> Score:
    _pattern(reward)  # (refused as regex's is: missing, or not a regular expression)
    compiled = re.compile(reward.pattern)
    if not any(compiled.fullmatch(chr(code)) for code in range(0x3000)):  # (Latin to CJK punctuation)
        raise ConfigError("reward.pattern", reward.pattern, "matches no single character, so every completion would "
                                                            "score 0; char_share scores each character alone: give a "
                                                            "character class, e.g. '[a-z]'")
    return char_share(reward.pattern)


def _target_length(reward: Any) -> Score:
    if reward.target_length is None or reward.target_length < 1:
        raise ConfigError("reward.target_length", reward.target_length, "must be >= 1 (characters)")
    return length(reward.target_length)


def _marker(reward: Any) -> Score:
    if reward.marker == "":
        raise ConfigError("reward.marker", "", "an empty marker marks nothing; use null to compare the whole "
                                               "completion")
    return exact_match(reward.marker)


def _math_verify(reward: Any) -> Score:
    if importlib.util.find_spec("math_verify") is None:
        raise ConfigError("reward.kind", "math_verify", f"needs math-verify, not installed here; {INSTALL}")
    return math_verified()


BUILT_IN = {"exact_match": _marker, "regex": _pattern, "char_share": _character_class, "length": _target_length,
            "math_verify": _math_verify}
NO_REWARD = "objective=grpo scores its completions with a reward; choose one: reward=exact_match, regex, char_share, " \
            "length, math_verify, or file (your own function)"


def _combined(reward: Any) -> WeightedSum:
    """combined's parts, each made from its own keys alone as its reward=<kind> would be (kind:
    file from the command line's reward.file and reward.function; no other top-level key reaches
    a part), under a name no other part has."""
    if not reward.parts:
        raise ConfigError("reward.parts", [], "name the rewards to combine, e.g. [{kind: exact_match, weight: 1.0}, "
                                              "{kind: regex, pattern: '<answer>', weight: 0.5}]")
    parts, names, file_part = [], {}, None
    for i, part in enumerate(reward.parts):
        at = f"reward.parts[{i}]"
        unknown = sorted(set(part) - set(PART_KEYS))
        if unknown:
            fix = ("a part's function comes from the command line's reward.file; give the part kind: file"
                   if unknown[0] in ("file", "function") else f"a part sets {', '.join(PART_KEYS)}")
            raise ConfigError(f"{at}.{unknown[0]}", part[unknown[0]], fix)
        kind = part.get("kind")
        if kind not in (*BUILT_IN, "file"):
            raise ConfigError(f"{at}.kind", kind, f"use one of {', '.join((*BUILT_IN, 'file'))}")
        weight = part.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{at}.weight", weight, "must be a finite number (its score is multiplied by it)")
        if kind == "file" and file_part is not None:
            raise ConfigError(f"{at}.kind", kind, f"part {file_part} is kind: file too, and both would score with the "
                                                 f"one function the command line names (reward.function); keep one "
                                                 f"such part, its weight the two summed")
        file_part = i if kind == "file" else file_part
        if kind == "file" and (reward.file is None or not reward.function):
            raise ConfigError("reward.file" if reward.file is None else "reward.function",
                              reward.file if reward.file is None else reward.function,
                              f"{at} is kind: file, which scores with the command line's function: give "
                              f"reward.file=my_rewards.py reward.function=score")
        settings = {key: value for key, value in part.items() if key not in ("weight", "name")}
        try:
            made = make_reward(OmegaConf.merge(OmegaConf.structured(RewardConfig), {**settings, "file": reward.file,
                                                                                    "function": reward.function}))
        except ConfigError as error:  # named as the part's key (a file part's are the command line's own)
            own = error.key.startswith("reward.") and error.key not in ("reward.file", "reward.function")
            raise ConfigError(f"{at}.{error.key[len('reward.'):]}" if own else error.key, error.value,
                              error.fix) from None
        name = str(part.get("name") or made.name)
        if name in names:
            raise ConfigError(f"{at}.name", part.get("name"), f"{name} names part {names[name]} too; give each part "
                                                              f"its own name (its curve is rewards/<name>)")
        names[name] = i
        made.name = name
        parts.append((float(weight), made))
    return WeightedSum(parts)


def make_reward(reward: Any) -> Reward:
    """The `reward` config section (RewardConfig) as a Reward; a config it cannot make is a
    ConfigError naming the key (check_reward raises the same before launch)."""
    if reward.kind == "none":
        raise ConfigError("reward.kind", "none", NO_REWARD)
    if reward.kind == "file":
        return _user_function(reward)
    if reward.kind == "combined":
        return _combined(reward)
    if reward.kind not in BUILT_IN:
        raise ConfigError("reward.kind", reward.kind, f"use one of {', '.join(KINDS)}")
    return Reward(reward.kind, BUILT_IN[reward.kind](reward), f"reward={reward.kind}")


def check_reward(c: Checked) -> None:
    """Before launch: objective=grpo has a reward it can make (a user's file exists and defines
    the function, a pattern compiles, math-verify is installed); no other objective is given a
    reward it would ignore."""
    reward = c.cfg.get("reward")
    kind = reward.kind if reward is not None else "none"
    if objective_kind(c.cfg) != "grpo":  # (the objective that scores completions, objectives.grpo)
        if kind != "none":
            raise ConfigError("reward.kind", kind, "only objective=grpo scores completions; drop the reward "
                                                   "(reward=none) or use objective=grpo")
        return
    if kind == "none" and c.cfg.get("environment") is not None and c.cfg.environment.kind != "none":
        return  # (an environment may score its episodes itself: check_environment says which need a reward)
    if reward is None:
        raise ConfigError("reward.kind", "none", NO_REWARD)
    make_reward(reward)
