"""Ctrl-C and SIGTERM end a run cleanly (framework.training.interrupt): every rank stops after the
same step, saves a checkpoint there, and the command says where; resuming from it continues as if
the run had never stopped. Real process groups, signalled as a terminal or torchrun's user would."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import QUIET, ROOT, TEST_MODELS, TORCHRUN, processes_with_marker, run_cli

SEED = ["mesh=2x1", "optim=adamw", "optim.lr=0.01", *QUIET, TEST_MODELS]
STOPPED = re.compile(r"interrupted by (SIGINT|SIGTERM): every rank stopped after step (\d+); "
                     r"checkpoint (\S+) saved; the same command resumes from it")


def _start(args: list, marker: str, prefix: list = ()) -> subprocess.Popen:
    """The CLI in a session of its own, as a terminal runs a foreground command."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", marker: "1"}
    return subprocess.Popen([*(prefix or [sys.executable]), "-m", "framework.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _signal_when(path: Path, process: subprocess.Popen, send, timeout_s: float = 120) -> tuple:
    """Once `path` exists, `send()`; then the command's (returncode, stdout, stderr)."""
    try:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.05)
        send()
        stdout, stderr = process.communicate(timeout=timeout_s)
        return process.returncode, stdout, stderr
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _nothing_left(marker: str) -> bool:
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not processes_with_marker(marker)


@pytest.mark.integration  # (the SIGTERM cases stay in make test)
@pytest.mark.timeout(240)
def test_ctrl_c_saves_where_every_rank_stopped_and_the_resume_trains_as_if_never_stopped(tmp_path):
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    out = tmp_path / "job"
    training = [*SEED, "checkpoint.every=1000", "model._target_=tests.workers.MarkTraining",
                f"+model.out={tmp_path}", "+model.at=5"]
    process = _start([*training, "trainer.max_steps=100000", f"hydra.run.dir={out}"], marker)
    code, stdout, stderr = _signal_when(tmp_path / "training", process, lambda: os.killpg(process.pid, signal.SIGINT))
    assert code == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stdout + stderr
    match = STOPPED.fullmatch(stderr.strip().splitlines()[-1])
    assert match, stderr
    step, checkpoint = int(match[2]), match[3]
    assert step >= 5 and checkpoint == str(out / "checkpoints" / f"step_{step}") and os.path.isdir(checkpoint)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == {"signal": "SIGINT", "step": step, "checkpoint": checkpoint}
    assert summary["steps"] == step and len(summary["losses"]) == step
    assert _nothing_left(marker)

    # The same command (to a nearer end) resumes there; the same mesh: bitwise against a run that never stopped.
    resumed = run_cli([*training, f"trainer.max_steps={step + 3}", f"hydra.run.dir={out}"])
    assert resumed.returncode == 0, resumed.stderr
    straight = run_cli([*training, f"trainer.max_steps={step + 3}", f"hydra.run.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == step and summary["stopped"] is None
    assert summary["losses"] == json.loads((tmp_path / "straight" / "summary.json").read_text())["losses"]


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_sigterm_to_torchrun_stops_its_ranks_together_with_a_checkpoint(tmp_path):
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    out = tmp_path / "job"
    process = _start([*SEED, "checkpoint.every=1000", "model._target_=tests.workers.MarkTraining",
                      f"+model.out={tmp_path}", "trainer.max_steps=100000", f"hydra.run.dir={out}"], marker,
                     prefix=[TORCHRUN, "--standalone", "--nproc-per-node", "2"])
    _signal_when(tmp_path / "training", process, lambda: process.send_signal(signal.SIGTERM))
    summary = json.loads((out / "summary.json").read_text())
    step = summary["stopped"]["step"]
    assert summary["stopped"] == {"signal": "SIGTERM", "step": step, "checkpoint": str(out / "checkpoints" / f"step_{step}")}
    assert os.listdir(out / "checkpoints") == [f"step_{step}"] and len(summary["losses"]) == step
    assert _nothing_left(marker)


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_command_still_imports_is_one_line_not_a_traceback(tmp_path):
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    process = _start([*SEED, f"hydra.run.dir={tmp_path / 'job'}"], marker)
    deadline = time.monotonic() + 30
    while len(processes_with_marker(marker)) < 2:  # its zygote started: the command imports Hydra and torch now
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert (process.returncode, stderr) == (128 + signal.SIGINT, "interrupted by SIGINT\n")
    assert not (tmp_path / "job").exists()
    assert _nothing_left(marker)


@pytest.mark.timeout(120)
def test_ctrl_c_before_training_says_nothing_was_saved_and_leaves_nothing_running(tmp_path):
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    process = _start([*SEED, "model._target_=tests.workers.SlowToBuild", f"+model.out={tmp_path}",
                      f"hydra.run.dir={tmp_path / 'job'}"], marker)
    code, stdout, stderr = _signal_when(tmp_path / "building", process, lambda: os.killpg(process.pid, signal.SIGINT))
    assert code == 128 + signal.SIGINT, stderr
    assert stderr.strip() == ("interrupted by SIGINT: the ranks stopped without saving (before training "
                              "started, or at once on a second signal)")
    assert "Traceback" not in stdout
    assert _nothing_left(marker)


def test_one_signal_delivered_twice_is_one_and_a_second_one_later_stops_at_once():
    """One process, no process group: the agreement is the rank's own flag."""
    from framework.training.interrupt import REPEAT_AFTER_S, Interrupt

    before = signal.getsignal(signal.SIGINT)
    with Interrupt(rank=1) as stop:
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # its other copy (Slurm signals every process; the zygote relays)
        assert stop.agreed() == "SIGINT"
        stop.received_at -= REPEAT_AFTER_S  # a second later
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ctrl_c_in_a_sweep_ends_the_sweep_not_just_its_job(tmp_path):
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    sweep = tmp_path / "sweep"
    process = _start(["-m", "mesh=2x1,1x2", *SEED[1:], "checkpoint.every=100000", "trainer.max_steps=100000",
                      "model._target_=tests.workers.MarkTraining", f"+model.out={tmp_path}",
                      f"hydra.sweep.dir={sweep}"], marker)
    code, _, stderr = _signal_when(tmp_path / "training", process, lambda: os.killpg(process.pid, signal.SIGINT))
    assert code == 128 + signal.SIGINT, stderr
    assert STOPPED.fullmatch(stderr.strip().splitlines()[-1])[1] == "SIGINT"
    assert str(sweep / "0" / "checkpoints") in stderr
    assert not (sweep / "1").exists()
    assert _nothing_left(marker)


@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_alone_stops_every_rank_at_the_same_step(tmp_path):
    """Only rank 1 hears it: the others stop because the ranks compare notes, not because they
    were signalled too; the launcher then reports it as a stop, not a finished run."""
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    out = tmp_path / "job"
    process = _start([*SEED, "checkpoint.every=100000", "model._target_=tests.workers.MarkTraining",
                      f"+model.out={tmp_path}", "trainer.max_steps=100000", f"hydra.run.dir={out}"], marker)

    def signal_rank_1() -> None:
        # The process the agent started as rank 1 (a fork of the zygote keeps the zygote's
        # /proc environ; this one relays the signal to it, as it does the agent's).
        rank_1, = [pid for pid in processes_with_marker(marker)
                   if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()]
        os.kill(int(rank_1), signal.SIGTERM)

    code, _, stderr = _signal_when(tmp_path / "training", process, signal_rank_1)
    assert code == 128 + signal.SIGTERM, stderr
    match = STOPPED.fullmatch(stderr.strip().splitlines()[-1])
    assert match and match[1] == "SIGTERM", stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["signal"] == "SIGTERM" and len(summary["losses"]) == int(match[2])
    assert os.listdir(out / "checkpoints") == [f"step_{match[2]}"]
    assert _nothing_left(marker)
