"""W&B (offline) and MLflow beside TensorBoard: the same loss series read back from each one's
own files (W&B's run file through its protobuf schema, MLflow's store through its client), the
config as parameters, summary.json's figures; a multirun grouped; MLflow against a real server
started here; a logger that cannot start refused in one line before launch."""
import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2

from tests.conftest import ROOT, run_cli
from tests.test_cli import read_events

pytestmark = pytest.mark.timeout(300)
TRACKED = ["recipe=lm_2d", "model=lm_tiny", "mesh=1x1", "plan=none", "data.dataset.max_bytes=65536",
           "data.dataset.seq_len=32", "data.global_batch_size=8", "trainer.max_steps=20", "trainer.log_every=2",
           "trainer.eval_every=null", "trainer.progress_bar=false"]


def wandb_records(path: str):
    """The records of a W&B run file: its header, then 32 KiB blocks of chunks (a 7-byte header:
    CRC, length, kind 1 full / 2 first / 3 middle / 4 last), each record one protobuf Record."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += room
            continue
        pending += data[position + 7: position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(job_dir: Path) -> dict:
    """The offline run's group, config, history rows and summary."""
    (path,) = glob.glob(str(job_dir / "wandb" / "offline-run-*" / "*.wandb"))
    found = {"history": [], "config": {}, "summary": {}, "group": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["group"] = record.run.run_group
            found["config"].update({_key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            found["config"].update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            found["history"].append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            found["summary"].update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    return found


def mlflow_runs(uri: str) -> list:
    client = MlflowClient(uri)
    return [(client, experiment.name, run) for experiment in client.search_experiments()
            for run in client.search_runs([experiment.experiment_id])]


def series(client: MlflowClient, run, key: str) -> list:
    return [(metric.step, metric.value) for metric in sorted(client.get_metric_history(run.info.run_id, key),
                                                             key=lambda m: m.step)]


def test_every_logger_gets_the_same_loss_series_the_config_and_the_summary(tmp_path):
    job = tmp_path / "outputs" / "job"
    result = run_cli([*TRACKED, "logger=[tensorboard,wandb,mlflow]", f"hydra.run.dir={job}"])
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((job / "summary.json").read_text())
    expected = [(step, summary["losses"][step - 1]) for step in range(2, 21, 2)]
    tensorboard = [(event.step, event.value) for event in read_events(job / "tb").Scalars("loss")]
    wandb = wandb_run(job)
    (client, experiment, run), = mlflow_runs(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    assert [(row["_step"], row["loss"]) for row in wandb["history"] if "loss" in row] == expected
    assert series(client, run, "loss") == expected  # doubles, as summary.json holds them
    assert tensorboard == [(step, float(torch.tensor(loss, dtype=torch.float32))) for step, loss in expected]
    for key in ("grad_norm", "lr"):
        assert [(row["_step"], row[key]) for row in wandb["history"] if key in row] == series(client, run, key)
    # the composed config as parameters, flattened; summary.json's figures at the end
    assert wandb["config"]["trainer.max_steps"] == 20 and wandb["config"]["model.dim"] == 32
    assert run.data.params["trainer.max_steps"] == "20" and run.data.params["mesh.shape"] == "[1, 1]"
    assert wandb["summary"]["summary/final_loss"] == summary["final_loss"]
    assert series(client, run, "summary/final_loss") == [(0, summary["final_loss"])]
    assert experiment == "lm_2d" and run.info.run_name == "outputs/job"  # the recipe; the job dir
    assert os.path.isdir(tmp_path / "outputs" / "mlartifacts") and not os.path.exists(ROOT / "mlruns")
    # tokens/s over the tokens a step forwards: 8 windows of 32, by hand; no GPU here, so no device_memory
    assert summary["tokens_per_step"] == 8 * 32 and summary["tokens_per_s"] == summary["samples_per_s"] * 32
    assert summary["device_memory"] is None
    # MLflow's database set-up lines (INFO) stay off the console
    assert "Creating initial MLflow database tables" not in result.stderr and "alembic" not in result.stderr


@pytest.mark.integration  # (make test: one run's series in every logger)
def test_a_multirun_groups_its_jobs_under_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", *TRACKED, "trainer.max_steps=4", "logger=[wandb,mlflow]", "trainer.seed=0,1",
                      f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, result.stderr[-2000:]
    name = "/".join(str(sweep).split(os.sep)[-2:])
    assert [wandb_run(sweep / job)["group"] for job in ("0", "1")] == [name, name]
    runs = mlflow_runs(f"sqlite:///{tmp_path / 'sweep' / 'mlflow.db'}")
    assert sorted((experiment, run.info.run_name) for _, experiment, run in runs) == [(name, "0"), (name, "1")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a loopback port, a sqlite backend; stopped (its whole group) after."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
               "--default-artifact-root", (tmp_path / "artifacts").as_uri(), "--workers", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.mark.integration  # (make test: the sqlite store, read back the same way)
@pytest.mark.timeout(400)
def test_mlflow_logs_to_a_real_tracking_server(tmp_path, mlflow_server):
    job = tmp_path / "job"
    result = run_cli([*TRACKED, "trainer.max_steps=6", "logger=[mlflow]", f"logger.mlflow.tracking_uri={mlflow_server}",
                      "logger.mlflow.experiment=served", "checkpoint.every=6", "logger.mlflow.log_checkpoints=true",
                      f"hydra.run.dir={job}"])
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((job / "summary.json").read_text())
    (client, experiment, run), = [found for found in mlflow_runs(mlflow_server) if found[1] == "served"]
    assert series(client, run, "loss") == [(step, summary["losses"][step - 1]) for step in (2, 4, 6)]
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "checkpoint", "text"} <= artifacts
    saved = {artifact.path for artifact in client.list_artifacts(run.info.run_id, "checkpoint")}
    assert "checkpoint/framework.json" in saved


def test_a_logger_that_cannot_start_is_refused_in_one_line_before_launch(tmp_path):
    port = free_port()  # nothing listens there
    cases = [
        (["logger=[mlflow]", f"logger.mlflow.tracking_uri=http://127.0.0.1:{port}"],
         f"config error: logger.mlflow.tracking_uri='http://127.0.0.1:{port}': no MLflow server answers there"),
        (["logger=[wandb]", "logger.wandb.mode=cloud"],
         "config error: logger.wandb.mode='cloud': use one of offline, online, disabled"),
    ]
    for overrides, message in cases:
        result = run_cli([*TRACKED, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
        assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr[-1500:]
        assert not (tmp_path / "run" / "logs").exists()


def test_a_step_s_text_is_kept_at_its_step_the_config_once_and_queued_metrics_all_stored(tmp_path):
    """GRPO's completions at steps 2 and 4 stay two texts in W&B (a panel at each step) and MLflow
    (an artifact a step), where one name per tag overwrote the last; the config once; 50 steps of
    MLflow's asynchronous metrics all stored when the logger closes."""
    from omegaconf import OmegaConf

    from framework.training.logger import MlflowLogger, WandbLogger

    out = tmp_path / "outputs" / "job"
    out.mkdir(parents=True)
    wandb_options = OmegaConf.create({"mode": "offline", "project": "p", "name": None, "group": None, "tags": []})
    mlflow_options = OmegaConf.create({"tracking_uri": None, "experiment": "texts", "log_checkpoints": False})
    loggers = [WandbLogger(wandb_options, {"a": 1}, str(out), {}), MlflowLogger(mlflow_options, {"a": 1}, str(out), {})]
    for logger in loggers:
        logger.log_text("config", "a: 1")
        for step in range(1, 51):
            logger.log_scalars(step, {"loss": 1.0 / step})
            if step in (2, 4):
                logger.log_text("completions", f"'ab' -> 'cd{step}'", step)
        logger.close()
    run = wandb_run(out)
    panels = [(row["_step"], row["text/completions/path"]) for row in run["history"] if "text/completions/path" in row]
    files = glob.glob(str(out / "wandb" / "offline-run-*" / "files"))[0]
    assert [(step, "cd%d" % step in Path(files, path).read_text()) for step, path in panels] == [(2, True), (4, True)]
    assert run["summary"]["text/config"] == "a: 1"
    (client, _, mlrun), = mlflow_runs(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    texts = sorted(a.path for a in client.list_artifacts(mlrun.info.run_id, "text/completions"))
    assert texts == ["text/completions/step_0000002.txt", "text/completions/step_0000004.txt"]
    stored = [Path(client.download_artifacts(mlrun.info.run_id, path, str(tmp_path))).read_text() for path in texts]
    assert stored == ["'ab' -> 'cd2'", "'ab' -> 'cd4'"]
    assert {a.path for a in client.list_artifacts(mlrun.info.run_id, "text")} == {"text/config.txt", "text/completions"}
    assert series(client, mlrun, "loss") == [(step, 1.0 / step) for step in range(1, 51)]
