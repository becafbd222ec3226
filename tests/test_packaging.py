"""A plain (not editable) install carries its configs: built as a wheel, installed into a
directory of its own and run from elsewhere, the commands compose, validate and train."""
import json
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT, run_cli


@pytest.mark.timeout(240)
def test_a_wheel_installed_elsewhere_finds_its_configs_and_trains(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info/ beside the sources
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "outputs", "multirun", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, timeout=120, cwd=tmp_path)
    wheel, = (tmp_path / "wheel").glob("framework-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import framework.cli as c; print(c.__file__, c.CONFIG_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(site / "framework" / "cli.py"), str(site / "framework" / "conf")]
    assert (site / "framework" / "conf" / "recipe" / "lm_2d.yaml").is_file()  # recipes/ came along
    dry = subprocess.run([sys.executable, "-m", "framework.dryrun", "recipe=lm_2d"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "config: valid for 4 ranks" in dry.stdout, dry.stderr
    job = tmp_path / "job"
    trained = subprocess.run([sys.executable, "-m", "framework.train", "mesh=2x1", "trainer.max_steps=2",
                              "trainer.progress_bar=false", f"hydra.run.dir={job}"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert trained.returncode == 0, trained.stderr
    assert (job / "summary.json").is_file()


# Run before anything else in each process (PYTHONPATH's sitecustomize): the package's metadata
# lookup fails as it does for a tree importable but not installed (PYTHONPATH=., a copied tree).
NOT_INSTALLED = '''import importlib.metadata as metadata
_version = metadata.version
def version(name):
    if name == "framework":
        raise metadata.PackageNotFoundError(name)
    return _version(name)
metadata.version = version
'''


@pytest.mark.timeout(240)
def test_a_tree_not_installed_saves_its_checkpoints_with_the_version_from_pyproject(tmp_path):
    """Its first save once died on PackageNotFoundError, after the training it was to keep."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(NOT_INSTALLED)
    job = tmp_path / "job"
    result = run_cli(["mesh=1x1", "trainer.max_steps=2", "checkpoint.every=1", "trainer.progress_bar=false",
                      f"hydra.run.dir={job}"], env={"PYTHONPATH": str(hooks)})
    assert result.returncode == 0, result.stderr
    saved = json.loads((job / "checkpoints" / "step_2" / "framework.json").read_text())
    with open(ROOT / "pyproject.toml", "rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    assert saved["versions"]["framework"] == f"{expected} (source tree, not installed)"
