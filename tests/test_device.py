"""mesh.device_type=auto, the default: cuda with nccl where each rank of a host has a GPU, else
cpu with gloo, resolved once by the process that validates and said in the rank-layout header."""
import pytest
import torch
from omegaconf import OmegaConf

from framework.launch.handoff import rank_config
from framework.parallel.device import Device, resolve_device, settle_device
from framework.validate import validate
from tests.conftest import QUIET, compose_config, run_cli


@pytest.mark.parametrize("requested,gpus,ranks,expected", [
    ("auto", 0, 1, ("cpu", "gloo", "auto: no GPU")),
    ("auto", 0, 4, ("cpu", "gloo", "auto: no GPU")),
    ("auto", 8, 8, ("cuda", "nccl", "auto: 8 GPUs for 8 local ranks")),
    ("auto", 1, 1, ("cuda", "nccl", "auto: 1 GPU for 1 local rank")),
    ("auto", 8, 4, ("cuda", "nccl", "auto: 8 GPUs for 4 local ranks")),
    ("auto", 4, 8, ("cpu", "gloo", "auto: 4 GPUs for 8 local ranks")),  # a rank without a GPU: all on cpu
    ("cpu", 8, 8, ("cpu", "gloo", "mesh.device_type=cpu")),
    ("cuda", 0, 2, ("cuda", "nccl", "mesh.device_type=cuda")),  # (validation refuses it: see below)
])
def test_the_resolver_picks_cuda_only_with_a_gpu_for_every_local_rank(requested, gpus, ranks, expected):
    assert resolve_device(requested, ranks, gpus) == Device(*expected)


def test_auto_is_the_default_and_validation_makes_it_concrete_for_the_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = compose_config(["mesh=2x2", *QUIET])
    assert cfg.mesh.device_type == "auto"
    validate(cfg, deep=False)
    assert (cfg.mesh.device_type, cfg.device.why) == ("cpu", "auto: no GPU")
    handed = rank_config(cfg)
    assert handed["mesh"]["device_type"] == "cpu"
    assert handed["device"] == {"type": "cpu", "backend": "gloo", "why": "auto: no GPU"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a settled config is not resolved again
    assert settle_device(OmegaConf.create(handed)) == Device("cpu", "gloo", "auto: no GPU")


def test_a_host_with_a_gpu_for_each_rank_resolves_to_cuda(monkeypatch):
    """The launcher's choice with 4 GPUs seen (validation's device checks faked to pass too)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = compose_config(["mesh=2x2", *QUIET])
    validate(cfg, deep=False)
    assert (cfg.mesh.device_type, cfg.device.why) == ("cuda", "auto: 4 GPUs for 4 local ranks")
    cfg = compose_config(["mesh=2x2", "mesh.ranks_per_host=2", *QUIET])  # two hosts of 2 ranks
    validate(cfg, deep=False)
    assert cfg.device.why == "auto: 4 GPUs for 2 local ranks"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.timeout(120)
def test_the_rank_layout_header_says_the_device_and_why(tmp_path):
    result = run_cli(["mesh=2x1", "trainer.max_steps=1", "trainer.progress_bar=false", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith("device: cpu (auto: no GPU)"))
    assert lines[header + 1].startswith("DeviceMesh [dp=2, tp=1]")
    forced = run_cli(["mesh=1x1", "mesh.device_type=cpu", "trainer.max_steps=1", "trainer.progress_bar=false",
                      f"hydra.run.dir={tmp_path / 'forced'}"])
    assert "device: cpu (mesh.device_type=cpu)" in forced.stdout, forced.stderr


class OneRankMesh:
    """A DeviceMesh of one rank, as stage_mesh reads it (each dim's size and this rank's place)."""

    def __getitem__(self, dim):
        return self

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0


@pytest.mark.parametrize("env,gpus,device,reason", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 2, "cuda", "auto: 2 GPUs for 2 local ranks"),  # 2 hosts of 2
    ({"WORLD_SIZE": "4"}, 2, "cpu", "auto: 2 GPUs for 4 local ranks"),  # one host of 4: a rank without a GPU
    ({}, 1, "cuda", "auto: 1 GPU for 1 local rank"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 0, "cpu", "auto: no GPU"),
])
def test_the_builder_resolves_auto_for_this_host_s_ranks_and_the_header_says_it(env, gpus, device, reason,
                                                                                monkeypatch, caplog, tmp_path):
    """A config no launcher resolved (torchrun's ranks): the builder picks the device from this
    host's ranks (LOCAL_WORLD_SIZE, else WORLD_SIZE), and the rank-layout header says it."""
    from framework.training import builder

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setitem(builder.STAGE_FUNCTIONS, "distributed", lambda run: setattr(run, "rank", 0))
    meshes = []
    monkeypatch.setattr(builder, "build_mesh", lambda *mesh: meshes.append(mesh) or OneRankMesh())
    cfg = compose_config(["mesh=1x1", *QUIET])
    with caplog.at_level("INFO", logger="framework"):
        builder.build_and_run(cfg, str(tmp_path), through="mesh")
    assert (cfg.mesh.device_type, cfg.device.why) == (device, reason)
    assert meshes == [(device, [1, 1], ["dp", "tp"])]
    assert caplog.messages[0].splitlines()[0] == f"device: {device} ({reason})"
