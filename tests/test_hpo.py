"""Hyperparameter search, `-m hydra/sweeper=optuna` (framework/hpo.py, hydra_plugins/framework_sweepers,
the trials' section of framework/report.py): real sweeps of the tiny LM, every trial a real run
of 20 steps, the study read back from its sqlite file. make test installs the hpo extra, so an
install without it fails here rather than skipping."""
import csv
import json
import os
import re
from pathlib import Path

import hydra_plugins.hydra_optuna_sweeper  # noqa: F401 (the sweeper the tests launch)
import optuna
import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from framework.cli import compose_checked, hydra_error_line
from framework.config.errors import ConfigError
from framework.config.trust import check_composed
from framework.hpo import check_before_sweep
from framework.models import Transformer
from tests.conftest import QUIET, TEST_MODELS, TINY_LM, run_cli

# 20 steps of the tiny LM on one rank, validated at steps 10 and 20: a trial takes about 3 s here.
TINY_RUN = [*TINY_LM, *QUIET, "mesh=1x1", "plan=none", "trainer.max_steps=20", "trainer.eval_every=10",
            "trainer.warmup_steps=0", "trainer.lr_decay=constant"]
OPTUNA = ["-m", "hydra/sweeper=optuna"]


class LMCrashingAt48(Transformer):
    """The LM, except that its ranks fail to build it with hidden_dim=48, a size every check
    before launch accepts: a trial whose ranks crash."""

    def __init__(self, **sizes):
        if sizes.get("hidden_dim") == 48 and "RANK" in os.environ:  # (not the launcher's own build)
            raise RuntimeError("boom: hidden_dim=48")
        super().__init__(**sizes)


def study(sweep: Path) -> "optuna.Study":
    return optuna.load_study(study_name="train", storage=f"sqlite:///{sweep / 'optuna.db'}")


def launched_jobs(result) -> list:
    """The job numbers Hydra's launcher logged (`#N : overrides`)."""
    return [int(n) for n in re.findall(r"\t#(\d+) : ", result.stdout + result.stderr)]


def job(sweep: Path, number: int) -> tuple:
    """A job's composed config (.hydra/config.yaml) and its summary.json (None: the run never trained)."""
    config = OmegaConf.load(sweep / str(number) / ".hydra" / "config.yaml")
    summary_file = sweep / str(number) / "summary.json"
    return config, json.loads(summary_file.read_text()) if summary_file.exists() else None


def trials_csv(sweep: Path) -> list:
    with open(sweep / "sweep_trials.csv", newline="") as f:
        return list(csv.DictReader(f))


LR_SEARCH = [*OPTUNA, *TINY_RUN, "hydra.sweeper.sampler.seed=1", "optim.lr=tag(log,interval(1e-4,1e-1))"]


def ranked_trials(sweep: Path, count: int) -> list:
    """The study's trials, each checked against its job (trial N is job N: its lr, and its last
    validation loss as the objective) and the report's ranking of them; returns them best first."""
    trials = study(sweep).trials
    assert [(t.number, t.state) for t in trials] == [(n, optuna.trial.TrialState.COMPLETE) for n in range(count)]
    for trial in trials:
        config, summary = job(sweep, trial.number)
        assert config.optim.lr == trial.params["optim.lr"]
        assert summary["val_losses"][-1] == [20, trial.value]
    trials = sorted(trials, key=lambda t: t.value)
    rows = trials_csv(sweep)  # the report: every trial, best first, at full precision
    assert [(int(row["rank"]), int(row["trial"]), float(row["optim.lr"]), float(row["val_loss"])) for row in rows] \
        == [(rank, t.number, t.params["optim.lr"], t.value) for rank, t in enumerate(trials, start=1)]
    assert OmegaConf.load(sweep / "optimization_results.yaml").best_value == trials[0].value
    report = (sweep / "sweep_report.md").read_text()
    assert f"{count} trials, {count} complete, 0 failed; minimize val_loss; best: trial {trials[0].number}," in report
    assert report.count("| ok |") == count  # the per-job table lists every job dir
    return trials


@pytest.mark.timeout(240)
def test_a_search_over_lr_ranks_its_trials_by_their_last_validation_loss(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli([*LR_SEARCH, "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, result.stderr
    assert launched_jobs(result) == [0, 1, 2, 3]
    trials = ranked_trials(sweep, 4)
    # seed 1's first lrs: 1.4e-2 (last val loss 2.55 here) .. 1.0e-4 (5.67); equal lrs would differ by 0
    assert trials[-1].value - trials[0].value > 1.0, [t.value for t in trials]
    assert trials[0].params["optim.lr"] > 10 * trials[-1].params["optim.lr"]  # 20 steps: the larger lr learns more


@pytest.mark.integration  # (make test: the same search's first 4 trials, ranked)
@pytest.mark.timeout(300)
def test_a_study_stopped_after_4_trials_resumes_to_8_and_runs_only_the_rest(tmp_path):
    sweep = tmp_path / "sweep"
    first = run_cli([*LR_SEARCH, "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}"])
    assert first.returncode == 0, first.stderr
    assert len(study(sweep).trials) == 4
    summaries = {n: (sweep / str(n) / "summary.json").read_bytes() for n in range(4)}

    second = run_cli([*LR_SEARCH, "hydra.sweeper.n_trials=8", f"hydra.sweep.dir={sweep}"])  # the same command, 8 in all
    assert second.returncode == 0, second.stderr
    assert launched_jobs(second) == [4, 5, 6, 7]  # only the rest, numbered after the study's trials
    assert "holds 4 trial(s) of n_trials=8: running 4 more, from job 4" in second.stdout + second.stderr
    assert {n: (sweep / str(n) / "summary.json").read_bytes() for n in range(4)} == summaries  # not run again
    trials = ranked_trials(sweep, 8)
    assert len({t.params["optim.lr"] for t in trials}) == 8  # the resumed run drew new points (seed 1 + 4 trials)
    assert trials[-1].value - trials[0].value > 1.0, [t.value for t in trials]

    again = run_cli([*LR_SEARCH, "hydra.sweeper.n_trials=8", f"hydra.sweep.dir={sweep}"])
    assert again.returncode == 0, again.stderr
    assert launched_jobs(again) == [] and len(study(sweep).trials) == 8  # a finished study runs nothing


@pytest.mark.timeout(240)
def test_refused_and_crashed_trials_fail_in_the_study_and_the_sweep_goes_on(tmp_path):
    """Random draws, seed 0, of hidden_dim x grad_clip: (48, 1.0) crashes on its rank, (48, 0.0)
    and (48, 0.0) again are refused before launch (grad_clip must be > 0), (64, 1.0) trains."""
    sweep = tmp_path / "sweep"
    result = run_cli([*OPTUNA, "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=0", *TINY_RUN,
                      TEST_MODELS, f"model._target_={__name__}.LMCrashingAt48", "model.hidden_dim=choice(64,48)",
                      "trainer.grad_clip=choice(1.0,0.0)", "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, result.stderr  # a trial completed: failed trials are part of a search
    trials = study(sweep).trials
    assert [t.number for t in trials] == [0, 1, 2, 3]
    rows = {int(row["trial"]): row for row in trials_csv(sweep)}
    outcomes = set()
    for trial in trials:
        config, summary = job(sweep, trial.number)
        error = (sweep / str(trial.number) / "error.txt").read_text().strip() if trial.state.name == "FAIL" else ""
        assert rows[trial.number]["state"] == trial.state.name and rows[trial.number]["error"] == error
        if trial.params["trainer.grad_clip"] == 0.0:
            outcomes.add("refused")
            assert trial.state.name == "FAIL" and summary is None
            assert error == "config error: trainer.grad_clip=0.0: must be > 0, or null for no clipping"
        elif trial.params["model.hidden_dim"] == 48:
            outcomes.add("crashed")
            assert trial.state.name == "FAIL" and summary is None
            assert error.startswith("training failed: rank 0 failed: RuntimeError('boom: hidden_dim=48')")
        else:
            outcomes.add("trained")
            assert trial.state.name == "COMPLETE" and trial.value == summary["val_losses"][-1][1]
            assert rows[trial.number]["rank"] == "1" and config.model.hidden_dim == 64
    assert outcomes == {"refused", "crashed", "trained"}
    assert "4 trials, 1 complete, 3 failed" in (sweep / "sweep_report.md").read_text()


@pytest.mark.timeout(120)
def test_a_search_where_every_trial_is_refused_ends_with_its_report_and_exits_1(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli([*OPTUNA, *TINY_RUN, "trainer.grad_clip=0.0", "optim.lr=tag(log,interval(1e-4,1e-1))",
                      "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 1, result.stderr  # (the plugin's own end, asking for the best trial, would raise)
    assert [t.state.name for t in study(sweep).trials] == ["FAIL", "FAIL"]
    assert [row["error"] for row in trials_csv(sweep)] == ["config error: trainer.grad_clip=0.0: must be > 0, or "
                                                           "null for no clipping"] * 2
    assert "2 trials, 0 complete, 2 failed" in result.stdout


def refusal(*search: str) -> str:
    """The one line framework.train's check before Hydra ends with for this search (framework.cli)."""
    with pytest.raises((ConfigError, HydraException)) as refused:
        check_before_sweep([*OPTUNA, *TINY_RUN, *search])
    return str(refused.value) if isinstance(refused.value, ConfigError) else hydra_error_line(refused.value)


@pytest.mark.timeout(120)
def test_a_search_space_the_configs_refuse_is_refused_before_any_trial(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli([*OPTUNA, *TINY_RUN, "trainer.warmup_step=int(interval(0,10))", f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "config error: trainer.warmup_step: no such key; did you mean " \
                                                     "trainer.warmup_steps?"
    assert not sweep.exists()  # nothing ran
    # the same check in this process, for the other refusals: the line the command would print
    assert "Value '0.0' of type 'float' could not be converted to Integer" \
        in refusal("trainer.warmup_steps=interval(0,10)")  # an int key's interval: its bounds are floats
    assert "Value 'many' of type 'str' could not be converted to Integer" \
        in refusal("trainer.warmup_steps=choice(0,many)")  # every choice is composed
    assert refusal("trainer.eval_every=null", "optim.lr=interval(1e-4,1e-1)") == (
        "config error: trainer.eval_every=None: the sweeper optimizes the last validation loss "
        "(trainer.sweep_metric=val_loss) and this run never validates; set trainer.eval_every (a divisor of "
        "trainer.max_steps), or trainer.sweep_metric=final_loss")
    check_before_sweep([*OPTUNA, *TINY_RUN, "optim.lr=tag(log,interval(1e-4,1e-1))",
                        "trainer.warmup_steps=int(interval(0,5))"])  # and a search the configs take passes


LR = "optim.lr=tag(log,interval(1e-4,1e-1))"
STUDY_REFUSALS = [
    (["optim.lr=interval(0.01,0.0001)"], "optim.lr='interval(0.01,0.0001)': give an interval(low, high) of finite "
                                         "numbers with low < high"),
    (["optim.lr=interval(nan,0.1)"], "optim.lr='interval(nan,0.1)': give an interval(low, high) of finite numbers"),
    (["optim.lr=tag(log,interval(0,0.1))"], "optim.lr='tag(log,interval(0,0.1))': a log-scale interval needs low > 0"),
    (["trainer.warmup_steps=range(5,1)"], "trainer.warmup_steps='range(5,1)': give a range(start, stop, step) with "
                                          "start < stop and step > 0"),
    (["trainer.warmup_steps=choice(1,2,1)"], "trainer.warmup_steps='choice(1,2,1)': names 1 twice"),
    ([LR, "hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0: must be an integer >= 1 (the study's trials, "
                                       "counting those of earlier runs)"),
    ([LR, "hydra.sweeper.n_trials=-3"], "hydra.sweeper.n_trials=-3: must be an integer >= 1"),
    ([LR, "hydra.sweeper.n_jobs=0"], "hydra.sweeper.n_jobs=0: must be an integer >= 1 (trials asked for at once)"),
    ([LR, "hydra.sweeper.direction=sideways"], "hydra.sweeper.direction='sideways': use minimize or maximize"),
    ([LR, "hydra.sweeper.direction=[minimize,maximize]"],
     "hydra.sweeper.direction=['minimize', 'maximize']: use minimize or maximize: each job returns one number"),
    ([LR, "hydra.sweeper.max_failure_rate=1.5"], "hydra.sweeper.max_failure_rate=1.5: must be in [0, 1]"),
    ([LR, "hydra.sweeper.max_failure_rate=nan"], "hydra.sweeper.max_failure_rate=nan: must be in [0, 1]"),
    ([LR, "hydra.sweeper.sampler.seed=-1"], "hydra.sweeper.sampler.seed=-1: must be an integer >= 0"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("search,line", STUDY_REFUSALS, ids=[" ".join(s) for s, _ in STUDY_REFUSALS])
def test_a_study_optuna_cannot_run_is_refused_in_one_line_before_it_starts(search, line):
    assert refusal(*search).startswith("config error: " + line), refusal(*search)


@pytest.mark.timeout(120)
def test_reversed_bounds_and_a_study_of_no_trial_are_refused_on_the_command_line(tmp_path):
    """Before: reversed bounds ended in two tracebacks (66 lines), n_trials=0 in an empty report, exit 1."""
    for search, line in (STUDY_REFUSALS[0], STUDY_REFUSALS[5]):
        result = run_cli([*OPTUNA, *TINY_RUN, *search, f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=110)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("config error: " + line)
        assert not (tmp_path / "sweep").exists()  # no study, no job


@pytest.mark.timeout(60)
def test_the_sweeper_may_build_optuna_samplers_and_call_only_a_function_the_command_line_names():
    cfg = compose_checked(["hydra/sweeper=optuna", "hydra/sweeper/sampler=random"])
    assert cfg.hydra.sweeper.sampler._target_ == "optuna.samplers.RandomSampler"
    with pytest.raises(ConfigError, match=r"hydra.sweeper.sampler._target_='builtins.exec': Hydra would instantiate"):
        compose_checked(["hydra/sweeper=optuna", "hydra.sweeper.sampler._target_=builtins.exec"])
    given = ["hydra/sweeper=optuna", "hydra.sweeper.custom_search_space=mypkg.space"]
    cfg = compose_checked(given)  # on the command line: allowed
    with pytest.raises(ConfigError, match=r"custom_search_space='mypkg.space': a config file may not set a function"):
        check_composed(cfg, given[:1])  # as if a recipe had set it
