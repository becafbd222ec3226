"""framework.evaluate: lm-eval's Hugging Face backend on the task the framework ships
(framework/eval_tasks/next_letter), against a count by hand with transformers; a tiny Llama
trained on the task's answers scores above its untrained start; a checkpoint and its export
score exactly alike; bad input refused in one line before any model is read."""
import json
import os
import random
import string
import sys
from fnmatch import fnmatch

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from framework.evaluate import TASKS_DIR, main as evaluate
from framework.export import main as export
from framework.launch.local import launch_local
from framework.prepare import main as prepare
from tests.conftest import QUIET, ROOT, TINY_LM, compose_config
from tests.hf_models import make_hf_model, reference

import lm_eval  # noqa: F401  (the eval extra: a broken install fails here, never skips)

STEPS = 300
TASK = os.path.join(TASKS_DIR, "next_letter.jsonl")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> str:
    """A tiny random Llama with a byte-level tokenizer (tests/hf_models.py)."""
    return make_hf_model("llama", str(tmp_path_factory.mktemp("hf_model") / "model"))


@pytest.fixture(scope="module")
def trained(hf_model, tmp_path_factory) -> dict:
    """The tiny Llama ("model") and the checkpoint of 300 AdamW steps on one process over
    lines such as "after c comes d" (each question of next_letter with its answer), in "run". One
    thread: a model this small gains nothing from two, and loses much on a busy machine (measured
    here under load: 555 samples/s with one, 39 with two)."""
    root, model = tmp_path_factory.mktemp("evaluate"), hf_model
    letters = string.ascii_lowercase
    lines = [f"after {letters[i]} comes {letters[i + 1]}" for i in range(25)] * 40
    random.Random(0).shuffle(lines)
    (root / "answers.txt").write_text("\n".join(lines) + "\n")
    assert prepare([str(root / "answers.txt"), "--txt-lines", "--tokenizer", model, "--out", str(root / "tokens")]) == 0
    cfg = compose_config(["model=hf", f"model.path={model}", "data=tokens", f"data.path={root / 'tokens'}",
                          f"data.tokenizer={model}", "data.dataset.seq_len=32", "data.global_batch_size=8", "mesh=1x1",
                          "plan=none", "optim=adamw", "optim.lr=0.01", f"trainer.max_steps={STEPS}",
                          "trainer.log_every=50", f"checkpoint.every={STEPS}", "launcher.threads_per_rank=1", *QUIET])
    launch_local(cfg, str(root / "run"))
    return {"model": model, "run": str(root / "run"), "checkpoints": str(root / "run" / "checkpoints")}


def scored(argv: list, capsys) -> dict:
    """eval.json of `python -m framework.evaluate ARGV` run here, its table checked on stdout."""
    assert evaluate(argv) == 0
    printed = capsys.readouterr().out
    out = argv[argv.index("--out") + 1]
    with open(os.path.join(out, "eval.json")) as f:
        results = json.load(f)
    assert "|next_letter|1|none|0|acc|↑|" in printed.replace(" ", ""), printed  # lm-eval's table
    return results


def accuracy_by_hand(hf_dir: str) -> float:
    """next_letter as lm-eval's multiple_choice defines it, counted with transformers: the
    choice whose bytes after "QUESTION " have the highest summed log-probability."""
    model = reference(hf_dir)
    right = 0
    with open(TASK) as f:
        docs = [json.loads(line) for line in f]
    for doc in docs:
        context = list(doc["question"].encode())
        scores = []
        for choice in doc["choices"]:
            ids = context + list(f" {choice}".encode())  # the byte-level tokenizer: each byte's id is its value
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            scores.append(sum(logp[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    return right / len(docs)


@pytest.mark.timeout(240)
def test_a_checkpoint_and_its_export_score_alike_as_counted_by_hand_and_logged_to_the_run(trained, tmp_path,
                                                                                          capsys):
    step = os.path.join(trained["checkpoints"], f"step_{STEPS}")
    ours = scored([trained["checkpoints"], "--tasks", "next_letter", "--out", str(tmp_path / "ckpt"),
                   "--run-dir", trained["run"]], capsys)
    assert export([step, str(tmp_path / "hf"), "--format", "hf"]) == 0
    exported = scored([str(tmp_path / "hf"), "--tasks", "next_letter", "--out", str(tmp_path / "hf_eval")], capsys)
    assert ours["results"] == exported["results"]  # the same weights: the same scores, exactly
    assert ours["source"] == {"path": trained["checkpoints"], "checkpoint": step, "step": STEPS}
    acc = ours["results"]["next_letter"]["acc,none"]
    assert acc == accuracy_by_hand(str(tmp_path / "hf"))
    events = EventAccumulator(os.path.join(trained["run"], "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/next_letter/acc")] == [(STEPS, pytest.approx(acc))]


@pytest.mark.timeout(240)
def test_training_on_the_tasks_answers_raises_its_score_above_the_untrained_start(trained, tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)  # an HF directory's eval.json goes to the current directory
    before = scored([trained["model"], "--tasks", "next_letter", "--out", "."], capsys)
    assert evaluate([trained["checkpoints"], "--tasks", "next_letter", "--limit", "25"]) == 0  # eval.json beside it
    with open(os.path.join(trained["checkpoints"], f"step_{STEPS}", "eval.json")) as f:
        after = json.load(f)
    before, after = before["results"]["next_letter"]["acc,none"], after["results"]["next_letter"]["acc,none"]
    # measured: 0.28 untrained (chance: 0.25), 0.8 after 300 steps
    assert before <= 0.4 and after >= 0.6, (before, after)


@pytest.fixture(scope="module")
def own_lm_checkpoint(tmp_path_factory) -> str:
    """A checkpoint of the framework's own tiny LM (one step), which has no Hugging Face format."""
    out = tmp_path_factory.mktemp("own_lm")
    launch_local(compose_config([*TINY_LM, "mesh=1x1", "plan=none", "trainer.max_steps=1", "checkpoint.every=1",
                                 "launcher.threads_per_rank=1", "logger.tensorboard=false"]), str(out))
    return str(out / "checkpoints")


REFUSALS = [  # (arguments after SOURCE, SOURCE, what the line says)
    (["--tasks", "next_letter"], "missing", "config error: SOURCE='{source}': no such directory; give a Hugging Face"),
    (["--tasks", "next_letter"], "empty", "no config.json there (a Hugging Face model directory has one), and"),
    (["--tasks", "next_letter"], "own_lm", "which has no Hugging Face format"),
    (["--tasks", "next_letter,"], "model", "config error: --tasks='next_letter,': give task names separated by commas"),
    (["--tasks", "next_leter"], "model", "config error: --tasks='next_leter': no such task; the local ones are "
                                         "next_letter (lm-eval's own: lm-eval ls tasks)"),
    (["--tasks", "next_letter,next_letter"], "model", "config error: --tasks='next_letter,next_letter': names "
                                                      "next_letter twice; name each task once"),
    (["--tasks", "next_letter", "--limit", "0"], "model", "config error: --limit=0: must be >= 1"),
    (["--tasks", "next_letter", "--batch-size", "0"], "model", "config error: --batch-size=0: must be >= 1"),
    (["--tasks", "next_letter", "--out", "{file}"], "model", "is a file; name a directory"),
    (["--tasks", "next_letter", "--run-dir", "{tmp}"], "model", "--run-dir='{tmp}': logs at a checkpoint's step; "
                                                                "give a checkpoint as SOURCE"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arguments,source,line", REFUSALS, ids=[line[:40] for _, _, line in REFUSALS])
def test_bad_input_is_refused_in_one_line_naming_it_before_any_model_is_read(arguments, source, line, hf_model,
                                                                             request, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    paths = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty"), "model": hf_model}
    source = request.getfixturevalue("own_lm_checkpoint") if source == "own_lm" else paths[source]
    fill = {"source": source, "file": str(tmp_path / "file"), "tmp": str(tmp_path)}
    assert evaluate([source, *[a.format(**fill) for a in arguments]]) == 2
    err = capsys.readouterr().err
    # each a config error, said as train says one (not "evaluate failed: config error: ...")
    assert line.format(**fill) in err and err.startswith("config error: ") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "eval.json")


@pytest.mark.timeout(60)
def test_without_lm_eval_the_line_says_which_extra_to_install(hf_model, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # how Python's import sees a package that is not there
    assert evaluate([hf_model, "--tasks", "next_letter"]) == 2
    assert "not installed here; pip install '.[eval]'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_shipped_tasks_files_are_package_data():
    """A plain `pip install .` carries each task's YAML and data (pyproject's package-data globs)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    patterns = globs.get("*", []) + globs.get("framework.eval_tasks", [])
    for name in os.listdir(TASKS_DIR):
        assert any(fnmatch(name, pattern) for pattern in patterns), f"{name} is not package data: {patterns}"
