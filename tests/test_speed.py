"""Speed tools. trainer.compile=blocks: per-block torch.compile trains what eager trains (1x1;
TP + SP on 1x2 and 2x2; fsdp 2x1; a pp=2 pipeline), its checkpoints keep the model's own names and resume eager, and a model without
blocks is refused before launch. Profiling: `inspect profile` and trainer.profile_steps write
every rank's trace and summary."""
import json
import re

import pytest
import torch

from omegaconf import OmegaConf

from framework.launch.local import spawn_ranks
from tests.conftest import TINY_LM, compose_config, run_cli
from tests.workers import compiled_blocks_and_names

pytestmark = pytest.mark.timeout(400)
STEPS = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=null", "logger.tensorboard=false"]


def losses(out) -> list:
    return json.loads((out / "summary.json").read_text())["losses"]


@pytest.mark.parametrize("mesh,plan,extra", [
    ("1x1", "none", []),
    pytest.param("1x2", "lm_tp_sp", [], marks=pytest.mark.integration),
    # with loss_parallel, activation checkpointing and micro-batches together
    pytest.param("1x2", "lm_tp_sp_loss_parallel", ["model.activation_checkpointing=full", "data.micro_batch_size=2"],
                 marks=pytest.mark.integration),
    pytest.param("2x2", "lm_tp_sp", [], marks=pytest.mark.integration),
    pytest.param("2x1", "none", ["parallel.dp_strategy=fsdp"], marks=pytest.mark.integration),
    pytest.param("pp2x1x1", "none", ["model.n_layers=4"], marks=pytest.mark.integration),  # each stage's blocks compiled
])
def test_compiled_blocks_train_the_eager_model_and_their_checkpoint_resumes_eager(tmp_path, mesh, plan, extra):
    base = [*TINY_LM, *STEPS, f"mesh={mesh}", f"plan={plan}", *extra]
    eager = run_cli([*base, f"hydra.run.dir={tmp_path / 'eager'}"])
    compiled = run_cli([*base, "trainer.compile=blocks", "checkpoint.every=2", f"hydra.run.dir={tmp_path / 'compiled'}"])
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    # the first step says it waits for the compiler (once), the eager run does not
    said = re.findall(r"step 1: data, forward and backward.*: torch.compile is compiling; the first steps wait",
                      compiled.stdout)
    assert len(said) == 1 and "torch.compile" not in eager.stdout, compiled.stdout
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")), torch.tensor(losses(tmp_path / "eager")),
                               rtol=1e-5, atol=1e-6)
    if mesh in ("1x1", "1x2"):  # saved compiled, resumed eager: the same names, the same curve
        resumed = run_cli([*base, f"hydra.run.dir={tmp_path / 'resumed'}",
                           f"checkpoint.resume={tmp_path / 'compiled' / 'checkpoints' / 'step_2'}"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        torch.testing.assert_close(torch.tensor(losses(tmp_path / "resumed")), torch.tensor(losses(tmp_path / "eager")),
                                   rtol=1e-5, atol=1e-6)


def test_the_builder_compiles_each_block_in_place_keeping_the_models_names(tmp_path):
    cfg = OmegaConf.to_container(compose_config([*TINY_LM, "mesh=1x2", "plan=lm_tp_sp", "trainer.compile=blocks"]),
                                 resolve=True)
    eager = dict(cfg, trainer={**cfg["trainer"], "compile": "none"})
    compiled, plain = (spawn_ranks(2, compiled_blocks_and_names, c, str(tmp_path))[0] for c in (cfg, eager))
    assert compiled["compiled"] == [True, True] and plain["compiled"] == [False, False]
    assert compiled["names"] == plain["names"] and not any("_orig_mod" in name for name in compiled["names"])


def test_compiling_a_model_without_blocks_is_refused_before_launch(tmp_path):
    result = run_cli(["trainer.compile=blocks", "trainer.progress_bar=false", f"hydra.run.dir={tmp_path}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("config error: trainer.compile='blocks': SeedMLP declares no repeated blocks to "
                                     "compile (ModelProtocol.compile_units); use trainer.compile=none")


@pytest.mark.integration  # (test_profile_steps_profiles_a_normal_run stays in make test)
def test_inspect_profile_writes_each_ranks_trace_and_finds_collectives_only_where_there_are_some(tmp_path):
    tiny = [arg for arg in TINY_LM if arg != "trainer.progress_bar=false"]
    results = {}
    for mesh, plan in (("1x1", "none"), ("2x1", "none"), ("1x2", "lm_tp_sp")):
        out = tmp_path / mesh
        result = run_cli(["profile", f"--out={out}", *tiny, f"mesh={mesh}", f"plan={plan}"], module="framework.inspect",
                         timeout=200)
        assert result.returncode == 0, result.stderr[-3000:]
        # no profiler warnings, no kineto lines: the console reads like any other command's
        assert "Warning" not in result.stderr and "profiler_st" not in result.stderr, result.stderr[-3000:]
        shares = re.findall(r"^rank (\d+): [\d.]+ ms per step, ([\d.]+)% of it in collectives; trace (\S+)$",
                            result.stdout, re.MULTILINE)
        assert [int(rank) for rank, _, _ in shares] == list(range(int(mesh[0]) * int(mesh[2])))
        for _, _, trace in shares:
            assert json.loads(open(trace).read())["traceEvents"]
        results[mesh] = [float(share) for _, share, _ in shares]
    assert results["1x1"] == [0.0]  # one process: nothing to communicate
    assert all(share > 0 for share in results["2x1"])  # DP's gradient all-reduces, and the waits for them
    assert all(share > 0 for share in results["1x2"])  # TP + SP all-gathers and reduce-scatters in every block


def test_profile_steps_profiles_a_normal_run(tmp_path):
    result = run_cli([*TINY_LM, *STEPS, "mesh=2x1", "plan=none", "trainer.profile_steps=2", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert f"profile of steps 2-3:\nrank {rank}: " in log and "% of it in collectives" in log
