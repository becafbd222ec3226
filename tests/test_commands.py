"""Every command answers bad input in one line with exit 2 and `--help` with its usage and 0:
framework.train (through Hydra), verify, inspect, dryrun, export and generate."""
import json
import subprocess
import sys

import pytest
import torch

from framework import dryrun, export, generate, inspect, verify
from tests.conftest import ROOT, run_cli
from tests.test_checkpoint import _fake_checkpoint

# the recipes/ dir, listed as the refusal lists it
RECIPES = ", ".join(sorted(path.stem for path in (ROOT / "recipes").glob("*.yaml")))
MAINS = {"verify": verify.main, "inspect": lambda argv: inspect.main(["comm", *argv]), "dryrun": dryrun.main}


@pytest.mark.parametrize("command", sorted(MAINS))
@pytest.mark.parametrize("argv,line", [
    (["verify.step=5"], "config error: verify.step: no such key; did you mean verify.steps?"),
    (["trainer.max_step=2"], "config error: trainer.max_step: no such key; did you mean trainer.max_steps?"),
    (["+parallel.dp_stratgy=fsdp"],
     "config error: parallel.dp_stratgy='fsdp': no such key; did you mean parallel.dp_strategy?"),
    (["recipe=lm_fdsp_tp"], f"config error: recipe=lm_fdsp_tp: no such recipe config; the recipe configs are: {RECIPES}"),
    (["mesh.shape=[2,x]"], "config error: Error merging override mesh.shape=[2,x]; Value 'x' of type 'str' could not "
                           "be converted to Integer"),
    (["mesh.shape=[2,2"], "config error: no viable alternative at input '[2,2'; See https://hydra.cc/docs/"),
])
def test_a_config_typo_is_one_line_and_exit_2(command, argv, line, capsys):
    assert MAINS[command](argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith(line) and err.count("\n") == 1, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("main", [verify.main, inspect.main, dryrun.main, export.main, generate.main])
def test_help_prints_the_usage_and_exits_0(main, capsys):
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m framework.")


@pytest.mark.parametrize("command", [export, generate])
def test_help_of_export_and_generate_describes_them_whole(command, capsys):
    assert command.main(["--help"]) == 0
    assert command.__doc__.strip() in capsys.readouterr().out


@pytest.mark.parametrize("fmt,out,line", [
    ("pt", "a_dir", "OUT='{out}': names a directory; name the file to write (OUT.pt), or add --format hf to write a "
                    "Hugging Face directory"),
    ("pt", "empty_dir", "OUT='{out}': names a directory; name the file to write (OUT.pt), or add --format hf to "
                        "write a Hugging Face directory"),
    ("pt", "model.pt", "OUT='{out}': exists; name a new file (export overwrites nothing)"),
    ("pt", "missing/model.pt", "OUT='{out}': its directory {tmp}/missing does not exist; create it first"),
    ("hf", "a_dir", "OUT_DIR='{out}': exists and is not an empty directory; name a new directory"),
    ("hf", "missing/hf", "OUT_DIR='{out}': its directory {tmp}/missing does not exist; create it first"),
])
def test_export_refuses_an_output_it_would_overwrite_or_cannot_write_in_one_line(fmt, out, line, tmp_path, capsys):
    checkpoint = _fake_checkpoint(tmp_path / "checkpoints", "step_5")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_dir" / "kept").write_text("kept")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "model.pt").write_text("kept")
    before = sorted(tmp_path.rglob("*"))
    assert export.main([str(checkpoint), str(tmp_path / out), "--format", fmt]) == 2
    assert capsys.readouterr().err == f"config error: {line.format(out=tmp_path / out, tmp=tmp_path)}\n"
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "model.pt").read_text() == "kept"


@pytest.mark.parametrize("command", [export, generate])
def test_a_model_path_from_a_checkpoint_that_is_gone_is_said_to_come_from_the_checkpoint(command, tmp_path, capsys):
    checkpoint = _fake_checkpoint(tmp_path / "checkpoints", "step_5")
    moved = tmp_path / "llama_tiny"
    (checkpoint / "framework.json").write_text(json.dumps(
        {"config": {"model": {"_target_": "framework.models.hf.HFTransformer", "path": str(moved)}}}))
    argv = [str(tmp_path / "out.pt")] if command is export else ["--prompt", "hi"]
    assert command.main([str(checkpoint), *argv]) == 2
    assert capsys.readouterr().err == (
        f"{command.__name__.split('.')[-1]} failed: checkpoint {checkpoint}: model.path='{moved}', read from its saved "
        f"config: no such directory; point it at a Hugging Face model directory (config.json, *.safetensors, "
        f"tokenizer.json)\n")


@pytest.mark.parametrize("argv,line", [
    (["--max-new-tokens", "0"], "--max-new-tokens=0: must be >= 1"),
    (["--temperature", "-1"], "--temperature=-1.0: must be >= 0 (0: greedy)"),
    (["--top-p", "1.5"], "--top-p=1.5: must be in (0, 1]"),
    (["--max-new-tokens", "-3"], "--max-new-tokens=-3: must be >= 1"),
    (["--temperature", "nan"], "--temperature=nan: must be >= 0 (0: greedy)"),
    (["--top-p", "0"], "--top-p=0.0: must be in (0, 1]"),
    (["--top-p", "nan"], "--top-p=nan: must be in (0, 1]"),
    (["--device", "tpu"], "--device='tpu': use one of auto, cpu, cuda"),
    pytest.param(["--device", "cuda"], "--device='cuda': torch sees no GPU here; use --device cpu (or auto: the GPU "
                                       "where there is one)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
    ([], "SOURCE='{source}': no such directory; give a Hugging Face model directory (config.json, *.safetensors, "
         "tokenizer.json), a step_N checkpoint or a checkpoints dir (its newest)"),
])
def test_generate_names_the_one_option_or_the_source_it_refuses(argv, line, tmp_path, capsys):
    source = tmp_path / "none"
    assert generate.main([str(source), "--prompt", "hi", *argv]) == 2
    assert capsys.readouterr().err == f"config error: {line.format(source=source)}\n"


def test_export_of_a_run_dir_points_at_its_checkpoints(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "checkpoints", "step_5")
    assert export.main([str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err == (
        f"export failed: checkpoint {tmp_path}: holds no complete checkpoint (no step_N dir with framework.json); a "
        f"run's dir: give its checkpoints dir, {tmp_path / 'checkpoints'}\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,line", [
    (["trainer.max_step=2"], "config error: trainer.max_step: no such key; did you mean trainer.max_steps?"),
    (["recipe=lm2d"], f"config error: recipe=lm2d: no such recipe config; the recipe configs are: {RECIPES}"),
])
def test_train_exits_2_on_what_hydra_cannot_compose(argv, line, tmp_path):
    result = run_cli([*argv, f"hydra.run.dir={tmp_path / 'job'}"], timeout=100)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == line
    assert not (tmp_path / "job").exists()


@pytest.mark.timeout(60)
def test_the_launcher_validates_without_loading_dtensor():
    # Importing DTensor, FSDP2, pipelining or DCP and the ranks' machinery costs seconds; the
    # launcher only composes, validates (every capability's checks: PP, EP, CP, compile, GRPO)
    # and starts ranks (and reads their stall reports).
    recipes = [["recipe=lm_2d", "trainer.compile=blocks"], ["recipe=lm_3d"], ["recipe=lm_moe"], ["recipe=grpo_lm"],
               ["recipe=lm_2d", "mesh.shape=[1,2,1]", "mesh.dim_names=[dp,cp,tp]", "parallel.cp_dim=cp"]]
    probe = ("import sys, framework.train; from framework.cli import compose_config; "
             f"from framework.validate import validate; [validate(compose_config(r)) for r in {recipes}]; "
             "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.tensor', 'torch.distributed.fsdp', "
             "'torch.distributed.pipelining', 'torch.distributed.checkpoint', 'framework.parallel.data_parallel'))))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_generate_s_device_is_refused_on_the_command_line_before_the_source_is_read(tmp_path):
    """`python -m framework.generate`: one line and exit 2 (the source does not even exist)."""
    result = run_cli([str(tmp_path / "none"), "--prompt", "hi", "--device", "gpu"], module="framework.generate")
    assert result.returncode == 2
    assert result.stderr == "config error: --device='gpu': use one of auto, cpu, cuda\n"
