"""Shared helpers: compose the real configs with Hydra's compose API, run the CLI.

How tests compare numbers (the rule for every new test):
- Bitwise (`==`, torch.equal) only where the same ranks run the same ops in the same order: DP
  replicas of one group after N steps, a resume on the same mesh against the run that never
  stopped, TensorBoard's values against summary.json's.
- fp32 results of differently-distributed computations (a sharded model against one process,
  another mesh or plan, micro-batches against the whole batch, an all-reduce against a sum by
  hand) agree only to float32 rounding, and which element rounds differently depends on the
  CPU's kernels: rtol 1e-5 / atol 1e-6 (max_relative_error < 1e-5), or looser with the reason
  in a comment (losses over many steps of a model whose loss amplifies: 1e-4; bf16: 2e-2).
  Never tighter: 1e-6 / 1e-7 passed on one CPU and failed by one ulp on another.
- Where the sides are computed differently, the bound is at least 10x the error measured here,
  with the measurement in a comment: `TOLERANCE_LOG=errors.jsonl make test` records every
  comparison's error (tests/errors.py).
- No wall-clock assertions: timings belong in bench/. A hang is caught by the test's timeout.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import pytest

from omegaconf import DictConfig

import framework.cli
from framework.launch.zygote import zygote_socket
from tests.errors import recording_assert_close

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # the venv's

# Overrides the tests share.
QUIET = ["trainer.progress_bar=false", "logger.tensorboard=false"]
TEST_MODELS = "allowed_targets=[framework,torch.nn,torch.optim,tests]"  # models in tests/workers.py
# The tiny LM on a 64 KB slice of the byte corpus, 8 sequences of 32 bytes per step.
TINY_LM = ["recipe=lm_2d", "model=lm_tiny", "data.dataset.max_bytes=65536", "data.dataset.seq_len=32",
           "data.global_batch_size=8", "trainer.progress_bar=false"]


def pytest_configure(config):
    # data=hf's document index and the datasets library's own cache: inside the session's temporary
    # directory, never the user's home (each pytest process, and the runs it starts, share one)
    config.scratch = tempfile.mkdtemp(prefix="framework-tests-")
    os.environ.setdefault("FRAMEWORK_CACHE_DIR", os.path.join(config.scratch, "framework"))
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(config.scratch, "datasets"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's two workers share the cores: one thread each
        import torch
        torch.set_num_threads(1)
    if os.environ.get("TOLERANCE_LOG"):
        import torch.testing
        torch.testing.assert_close = recording_assert_close(torch.testing.assert_close)


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "scratch", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Dict[str, str]:
    """Byte-level token data as framework.prepare writes it: "packed" (about 80 KB of text) and
    "instruction" (400 prompt / response records), "preference" (400 prompt / chosen / rejected
    records), "prompts" (400 prompt / answer records), "unpaired" (400 prompt / completion / label
    records)."""
    from framework.prepare import main as prepare

    root = tmp_path_factory.mktemp("prepared")
    (root / "text.txt").write_text("".join(f"line {i}: the mesh trains one model\n" for i in range(2000)))
    (root / "chat.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}?", "response": "a" * (i % 7 + 1)}) + "\n"
                                             for i in range(400)))
    assert prepare([str(root / "text.txt"), "--out", str(root / "packed")]) == 0
    assert prepare([str(root / "chat.jsonl"), "--out", str(root / "instruction"), "--prompt-field", "prompt",
                    "--response-field", "response"]) == 0
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}?", "chosen": "a" * (i % 5 + 1),
                                                          "rejected": "b" * (i % 3 + 1)}) + "\n" for i in range(400)))
    assert prepare([str(root / "pairs.jsonl"), "--out", str(root / "preference"), "--prompt-field", "prompt",
                    "--chosen-field", "chosen", "--rejected-field", "rejected"]) == 0
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}?", "answer": str(i % 7)}) + "\n"
                                                for i in range(400)))
    assert prepare([str(root / "prompts.jsonl"), "--out", str(root / "prompts"), "--prompt-field", "prompt",
                    "--answer-field", "answer"]) == 0
    (root / "unpaired.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}?", "completion": "a" * (i % 5 + 1),
                                                             "label": i % 3 != 0}) + "\n" for i in range(400)))
    assert prepare([str(root / "unpaired.jsonl"), "--out", str(root / "unpaired"), "--prompt-field", "prompt",
                    "--response-field", "completion", "--label-field", "label"]) == 0
    return {"packed": str(root / "packed"), "instruction": str(root / "instruction"),
            "preference": str(root / "preference"), "prompts": str(root / "prompts"),
            "unpaired": str(root / "unpaired")}


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory, prepared) -> Dict[str, str]:
    """A tiny random Hugging Face model directory per supported architecture (tests/hf_models.py),
    and "tokens": the packed text prepared with their (byte-level) tokenizer.json; "vlm": a
    vision-language model (Gemma 3's), "colours": image-and-text records for it, and "vqa": the
    same records as a save_to_disk dataset with an image column."""
    from framework.prepare import main as prepare
    from tests.hf_models import ARCHITECTURES, colour_pairs, colour_records, hf_records, make_hf_model, make_vlm

    root = tmp_path_factory.mktemp("hf")
    dirs = {kind: make_hf_model(kind, str(root / kind)) for kind in ARCHITECTURES}
    text = os.path.join(os.path.dirname(prepared["packed"]), "text.txt")
    assert prepare([text, "--tokenizer", dirs["llama"], "--out", str(root / "tokens")]) == 0
    colours = colour_records(str(root / "colours"), 256)
    vqa = hf_records([json.loads(line) for line in open(colours)], Path(root) / "colours", Path(root) / "vqa",
                     as_list=False)
    return {**dirs, "tokens": str(root / "tokens"), "vlm": make_vlm(str(root / "vlm")), "colours": colours,
            "vqa": vqa, "colour_pairs": colour_pairs(str(root / "colour_pairs"))}


def compose_config(overrides: List[str] = ()) -> DictConfig:
    """As every command composes (recipes' and group files' trust checks included)."""
    return framework.cli.compose_config(list(overrides))


def cli_command(module: str, args: List[str], env: Dict[str, str]) -> List[str]:
    """`python -m MODULE ARGS` started in milliseconds: a fork of one interpreter that imported
    the commands, whose ranks are forks of one that imported the ranks' code
    (FRAMEWORK_ZYGOTE_SOCKET), each started once per test session (framework.launch.zygote). A
    fork is the command as a user runs it (its stdio, arguments, cwd, environment, exit status
    and signals; its atexit handlers run), less the ~5 CPU-seconds an interpreter spends
    importing torch and Hydra."""
    env["FRAMEWORK_ZYGOTE_SOCKET"] = zygote_socket()
    return [sys.executable, "-m", "framework.launch.zygote", zygote_socket("framework.train"), module, *args]


def run_cli(args: List[str], timeout: float = 240, env: dict | None = None, module: str = "framework.train",
            prefix: List[str] = ()) -> subprocess.CompletedProcess:
    """Run `python -m framework.train ARGS` (or under a prefix such as torchrun) from the repo root.
    Without `env` the command is a fork of the session's interpreters (cli_command), which
    imported under the environment of the first such run; a run whose environment an import
    reads (a marker found in /proc, PYTHONPATH, OMP_NUM_THREADS, ...) passes it as `env`, and gets
    a fresh interpreter. On timeout the whole process group goes, ranks included, so a hang
    leaves nothing running."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env = {key: value for key, value in full_env.items() if value is not None}  # env={KEY: None} unsets KEY
    if prefix:
        cmd = [*prefix, "-m", module, *args]
    elif env:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = cli_command(module, list(args), full_env)
    with subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def processes_with_marker(marker: str) -> list:
    """Live processes whose environment holds `marker` (a test sets it on the CLI it starts)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found
