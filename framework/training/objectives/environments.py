"""`environment=...` (conf/environment/): what answers objective=grpo's completions between turns.

Without one (environment=none) a completion is one continuation of its prompt. With one, the
decoder stops at the environment's `marker` (one token) as it stops at the end of text; the
environment answers (a tool's output, a game's move, the next user turn), its answer's tokens are
appended to the completion as inputs the loss leaves out, and decoding goes on, up to
`max_turns` turns of the model's (framework.training.objectives.turns). The completion's budget,
objective.max_new_tokens, counts the answers' tokens too.

An environment is a class, one instance an episode (a completion):
    class MyGame:
        marker = "."                      # optional: environment.marker sets it (each instance's is the run's)
        def __init__(self, prompt, answer): ...      # the prompt's text, its answer (or None)
        def respond(self, completion):    # the completion so far, ending at the marker
            return "text to append"       # or None: the episode ends here
        def reward(self, completion):     # optional: the episode's score, in place of reward=...
            return 1.0
Two ship: `calculator` (a tool) and `guess_digit` (a game); a class of your own comes from a
Python file named on the command line only (environment=file environment.file=F
environment.name=CLASS; framework.config.trust), as a reward's function does.

An episode that raises (making it, answering or scoring), answers anything but text or None, or
takes longer than `timeout_s` to answer fails: its completion ends there and scores 0, and the
share of such completions is logged (environment/failures). The run goes on.
"""
import ast
import inspect
import operator
import os
import re
import threading
from typing import Any, Callable, List, Optional, Sequence

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.data.batch import IGNORE
from framework.training.objectives.base import objective_kind
from framework.training.objectives.rewards import load_definition

KINDS = ("none", "calculator", "guess_digit", "file")
NUMBER = re.compile(r"-?\d+")
EXPRESSION = re.compile(r"\d+(?:\s*[-+*]\s*\d+)+")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluated(node: ast.AST) -> int:
    """An expression of integers, +, - and * (EXPRESSION's), evaluated without eval."""
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluated(node.left), _evaluated(node.right))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


class Calculator:
    """environment=calculator, a tool: at the marker it answers the value of the last arithmetic
    expression (integers with +, - and *) written so far, the completion's own before the
    prompt's, or "?" where there is none. Its reward: 1.0 when the completion's last number
    (the tool's answers among them) is the sample's answer. A model that cannot add learns to
    ask: write the marker, then stop or write no other number."""
    marker = "="

    def __init__(self, prompt: str, answer: Optional[str]):
        self.prompt, self.answer = prompt, answer

    def respond(self, completion: str) -> Optional[str]:
        found = EXPRESSION.findall(completion) or EXPRESSION.findall(self.prompt)
        return str(_evaluated(ast.parse(found[-1], mode="eval").body)) if found else "?"

    def reward(self, completion: str) -> float:
        numbers = NUMBER.findall(completion)
        return float(bool(numbers) and self.answer is not None and numbers[-1] == self.answer.strip())


class GuessDigit:
    """environment=guess_digit, a game: the sample's answer is a hidden digit. Each turn the model
    names a digit (its turn's first) and ends the turn with the marker; the game answers "+" (the
    digit is higher), "-" (lower) or "?" (no digit named), or ends the episode when it is right.
    A turn the marker does not end (the budget ran out) names nothing. Its reward: 1 - |guess -
    digit| / 9 for the last digit named (1.0 when found), 0.0 without one. Guessing blind, the
    best is 0.72 (always 4 or 5); above it the model reads the game's answers."""
    marker = "."

    def __init__(self, prompt: str, answer: Optional[str]):
        if answer is None or len(answer.strip()) != 1 or not answer.strip().isdigit():
            raise ValueError(f"guess_digit hides the sample's answer, a digit 0-9; this sample's is {answer!r}")
        self.digit, self.guess, self.read = int(answer.strip()), None, 0

    def _named(self, completion: str) -> Optional[int]:
        """The digit the turn after the game's last answer names, if the marker ends it."""
        turn = completion[self.read:]
        digits = [c for c in turn if c.isdigit()]
        return int(digits[0]) if digits and turn.endswith(self.marker) else None

    def respond(self, completion: str) -> Optional[str]:
        named = self._named(completion)
        self.guess = named if named is not None else self.guess
        if named == self.digit:
            return None
        reply = "?" if named is None else "+" if named < self.digit else "-"
        self.read = len(completion) + len(reply)
        return reply

    def reward(self, completion: str) -> float:
        named = self._named(completion) if len(completion) > self.read else None  # (a last turn not answered)
        guess = named if named is not None else self.guess
        return 0.0 if guess is None else 1.0 - abs(guess - self.digit) / 9


BUILT_IN = {"calculator": Calculator, "guess_digit": GuessDigit}


class EpisodeFailed(Exception):
    """What ended an episode early: one line, logged with the completion's index."""


class Episodes:
    """One environment instance a completion, each called with a time limit; an instance that
    raises, answers anything but text or None, or runs out of time is marked failed and never
    called again (its thread, if it hangs, is left to itself as a daemon)."""

    def __init__(self, environment: "Environment", prompts: Sequence[str], answers: Sequence[Optional[str]]):
        self.environment = environment
        self.failed: List[Optional[str]] = [None] * len(prompts)
        self.instances = self._called(lambda i: self._made(prompts[i], answers[i]), range(len(prompts)))

    def _made(self, prompt: str, answer: Optional[str]) -> Any:
        instance = self.environment.cls(prompt, answer)
        instance.marker = self.environment.marker  # (the run's, which environment.marker may set)
        return instance

    def _called(self, call: Callable[[int], Any], rows: Sequence[int]) -> List[Any]:
        """call(row) for each row not failed, one after another in one daemon thread (not a
        thread each: 64 of them a turn starve for cores beside the ranks' own threads), each
        within timeout_s of the one before. Past it, that row fails, and so do the rows after it
        in this call, unanswered; the thread is left to itself."""
        live = [(k, row) for k, row in enumerate(rows) if self.failed[row] is None]
        results: List[Any] = [None] * len(rows)
        progress, cancelled, turn = [0], threading.Event(), threading.Condition()

        def run() -> None:
            for k, row in live:
                if cancelled.is_set():
                    return
                try:
                    results[k] = call(row)
                except Exception as error:  # noqa: BLE001 (the episode fails, the run does not)
                    self.failed[row] = f"raised {type(error).__name__}: {' '.join(str(error).split())[:200]}"
                with turn:
                    progress[0] += 1
                    turn.notify()
        threading.Thread(target=run, daemon=True).start()
        with turn:
            while progress[0] < len(live):
                before = progress[0]
                if not turn.wait_for(lambda: progress[0] > before, timeout=self.environment.timeout_s):
                    cancelled.set()
                    break
            late = live[progress[0]:]
        limit = f"environment.timeout_s={self.environment.timeout_s}"
        for position, (k, row) in enumerate(late):
            self.failed[row] = f"took longer than {limit}" if position == 0 else \
                f"not answered: an episode before it in the turn took longer than {limit}"
            results[k] = None
        return results

    def respond(self, rows: Sequence[int], completions: Sequence[str]) -> List[Optional[str]]:
        """Each row's answer to its completion so far (None: its episode ends, or failed)."""
        text = dict(zip(rows, completions))
        answers = self._called(lambda row: self.instances[row].respond(text[row]), rows)
        for row, answer in zip(rows, answers):
            if self.failed[row] is None and answer is not None and not isinstance(answer, str):
                self.failed[row] = f"respond() returned a {type(answer).__name__}; return text or None"
        return [answer if self.failed[row] is None else None for row, answer in zip(rows, answers)]

    def rewards(self, completions: Sequence[str]) -> List[float]:
        """The environment's scores (its `reward`), 0.0 for a failed episode."""
        rows = range(len(completions))
        scores = self._called(lambda row: float(self.instances[row].reward(completions[row])), rows)
        return [score if self.failed[row] is None else 0.0 for row, score in zip(rows, scores)]


class Environment:
    """The `environment` config section made: the class, its marker and limits."""

    def __init__(self, cls: type, marker: str, max_turns: int, timeout_s: float, where: str):
        self.cls, self.marker, self.max_turns, self.timeout_s, self.where = cls, marker, max_turns, timeout_s, where
        self.scores = callable(getattr(cls, "reward", None))  # its own reward, in place of reward=...

    def episodes(self, prompts: Sequence[str], answers: Sequence[Optional[str]]) -> Episodes:
        return Episodes(self, prompts, answers)


def make_environment(environment: Any) -> Optional[Environment]:
    """The `environment` config section (EnvironmentConfig) as an Environment (None for none); a
    config it cannot make is a ConfigError naming the key."""
    if environment is None or environment.kind == "none":
        return None
    if environment.kind == "file":
        cls = _user_class(environment)
        where = f"{environment.name} in {environment.file}"
    elif environment.kind in BUILT_IN:
        cls, where = BUILT_IN[environment.kind], f"environment={environment.kind}"
    else:
        raise ConfigError("environment.kind", environment.kind, f"use one of {', '.join(KINDS)}")
    marker = environment.marker if environment.marker is not None else getattr(cls, "marker", None)
    if not isinstance(marker, str) or not marker:
        raise ConfigError("environment.marker", environment.marker, f"{where} sets no marker; give the text that ends "
                                                                    f"a model's turn, e.g. 'environment.marker=\"</call>\"'")
    if environment.max_turns < 1:
        raise ConfigError("environment.max_turns", environment.max_turns, "must be >= 1 (the model's turns; the "
                                                                          "environment answers between two)")
    if not environment.timeout_s > 0:
        raise ConfigError("environment.timeout_s", environment.timeout_s, "must be > 0 (seconds an answer may take)")
    return Environment(cls, marker, environment.max_turns, float(environment.timeout_s), where)


def _user_class(environment: Any) -> type:
    if environment.file is None:
        raise ConfigError("environment.file", None, "give the Python file on the command line: environment=file "
                                                    "environment.file=my_env.py environment.name=MyEnv")
    if not environment.name:
        raise ConfigError("environment.name", environment.name, "name the class in environment.file, on the command "
                                                                "line: environment.name=MyEnv")
    cls = load_definition(os.path.expanduser(environment.file), environment.name, "environment", "name",
                          inspect.isclass, "class", inspect.isclass)
    if not callable(getattr(cls, "respond", None)):
        raise ConfigError("environment.name", environment.name, f"{environment.file}'s {environment.name} has no "
                                                                f"respond(self, completion) method; define one")
    try:
        inspect.signature(cls).bind("prompt", "answer")
    except TypeError:
        raise ConfigError("environment.name", environment.name, f"is made as {environment.name}(prompt, answer), and "
                                                                f"{environment.file}'s takes "
                                                                f"{environment.name}{inspect.signature(cls)}") from None
    return cls


def check_environment(c: Checked) -> None:
    """Before launch: an environment goes with objective=grpo, its file and class exist, its keys
    make sense, and its marker is one token of the data's tokenizer (the decoder stops at one id)."""
    cfg = c.cfg
    section = cfg.get("environment")
    if section is None or section.kind == "none":
        return
    if objective_kind(cfg) != "grpo":
        raise ConfigError("environment.kind", section.kind, "only objective=grpo decodes completions in turns; drop "
                                                            "the environment (environment=none) or use objective=grpo")
    environment = make_environment(section)
    reward = cfg.reward.kind if cfg.get("reward") is not None else "none"
    if environment.scores and reward != "none":
        raise ConfigError("reward.kind", reward, f"{environment.where} scores its own episodes (its reward()); drop "
                                                 f"the reward (reward=none)")
    if not environment.scores and reward == "none":
        raise ConfigError("reward.kind", "none", f"{environment.where} has no reward() of its own; choose one: "
                                                 f"reward=exact_match, regex, ..., or file (your own function)")
    from framework.data.tokenizer import load_tokenizer
    from hydra.utils import instantiate

    dataset = instantiate(cfg.data.dataset, split="train")
    tokenizer = load_tokenizer(cfg.data.get("tokenizer") or dataset.documents.tokenizer["path"])
    ids = tokenizer.encode_batch([environment.marker])[0]
    if len(ids) != 1:
        raise ConfigError("environment.marker", environment.marker,
                          f"is {len(ids)} tokens of the data's tokenizer ({ids}); the decoder stops at one token: "
                          f"give a marker that is one (a special token such as </tool_call>, or one character)")
    if ids[0] == tokenizer.eos_id:
        raise ConfigError("environment.marker", environment.marker, "is the tokenizer's end of text, which ends an "
                                                                    "episode; give another")
    sample = dataset[0]  # (an environment that cannot start on the data would fail every episode and train on 0)
    prompt, answer = (tokenizer.decode(row[row != IGNORE].tolist()) for row in (sample["inputs"], sample["targets"]))
    try:
        environment.cls(prompt, answer or None)
    except Exception as error:  # noqa: BLE001 (refused here, in one line)
        raise ConfigError("environment.kind", section.kind, f"{environment.where} cannot start an episode on the "
                                                            f"data's first prompt ({type(error).__name__}: "
                                                            f"{' '.join(str(error).split())[:200]}); give it data it "
                                                            f"plays on") from None
