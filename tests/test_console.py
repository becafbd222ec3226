"""What a command prints by default holds no third-party noise a user reads as trouble:
torchao's "Failed to load ..._C_mxfp8" lines and torch's pytree deprecation lines (transformers'
quantizers import torchao when lm-eval loads the model), nor c10d's C++ warning as the dry run
destroys each simulated rank's fake process group."""
from tests.conftest import run_cli
from tests.hf_models import make_hf_model

NOISE = ("Failed to load", "_C_mxfp8", "_C_cutlass", "_pytree", "register_constant", "No backend of type")


def test_evaluate_s_console_has_no_torchao_or_pytree_lines(tmp_path):
    model = make_hf_model("llama", str(tmp_path / "llama"))
    result = run_cli([model, "--tasks", "next_letter", "--limit", "2", "--out", str(tmp_path / "eval")],
                     module="framework.evaluate")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if any(word in line for word in NOISE)] == []


def test_generate_s_console_has_no_torchao_or_pytree_lines(tmp_path):
    model = make_hf_model("llama", str(tmp_path / "llama"))
    result = run_cli([model, "--prompt", "ab", "--max-new-tokens", "4"], module="framework.generate")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if any(word in line for word in NOISE)] == []


def test_the_dry_run_s_console_has_no_c10d_warning():
    result = run_cli(["recipe=lm_2d", "model=lm_tiny", "dryrun.ranks=[0,3]"], module="framework.dryrun")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 3 (dp 1, tp 1)" in result.stdout  # (both ranks simulated)
    assert [line for line in result.stderr.splitlines() if any(word in line for word in NOISE)] == []
