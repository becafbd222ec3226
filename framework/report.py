"""The sweep report: after every `-m` sweep, one row per job in sweep_report.md / .csv (and on
stdout), and the loss curves and throughputs in sweep_report.png, all in the sweep dir.

Hydra calls SweepReport.on_multirun_end once every job has returned (conf/config.yaml registers
it). Rows are read back from the job dirs (.hydra/, summary.json, error.txt), not collected from
the jobs in memory, so the report is the same whatever launcher ran them. A job of a sweep that
fails writes its one error line to error.txt and returns (framework/train.py), so the sweep goes
on; the report lists it and then makes the command exit 1.

With `hydra/sweeper=optuna` the report also ranks the study's trials, best first, with their
parameters, objective and state (sweep_trials.csv beside the others), read from the study's
storage: a resumed study's trials of earlier runs too. Failed trials are part of a search (an
lr the run cannot take), so such a sweep exits 1 only when no trial completed.
"""
import csv
import json
import math
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any, List, Optional, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

ERROR_FILE = "error.txt"
COLUMNS = ["job", "overrides", "mesh", "plan", "final_loss", "best_val_loss", "samples_per_s", "tokens_per_s",
           "median_step_s", "bytes_per_rank", "status", "error"]
HEADERS = ["job", "overrides", "mesh", "plan", "final loss", "best val loss", "samples/s", "tokens/s",
           "median step (s)", "bytes/rank", "status", "error"]
FORMATS = {"final_loss": "{:.6g}", "best_val_loss": "{:.6g}", "samples_per_s": "{:.1f}", "tokens_per_s": "{:.0f}",
           "median_step_s": "{:.4f}", "bytes_per_rank": "{:,}"}


def record_failure(job_dir: str, line: str) -> None:
    """A sweep job's error line, for the report: the job returns instead of ending the sweep.
    The first failure recorded is kept: on SLURM every task records its own, and the ranks
    that only lost their peer mostly fail later than the one that failed first."""
    try:
        with open(Path(job_dir, ERROR_FILE), "x") as f:
            f.write(line + "\n")
    except FileExistsError:
        pass


def clear_failure(job_dir: str) -> None:
    """Before a job runs: no error line left from an earlier sweep into the same dir."""
    Path(job_dir, ERROR_FILE).unlink(missing_ok=True)


def number(value: Any) -> Any:
    """None for a missing value or NaN (a run too short to time), so both show as blank."""
    return None if isinstance(value, float) and math.isnan(value) else value


def saved_config(path: Path) -> dict:
    """A config Hydra saved in .hydra/, as plain data (interpolations such as ${now:...} unresolved)."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def job_row(job_dir: Path) -> dict:
    """One job's row (the COLUMNS, plus its per-step `losses` for the plot), from its dir.
    A job without summary.json and without error.txt is ok: its pipeline stopped before training."""
    hydra_cfg = saved_config(job_dir / ".hydra" / "hydra.yaml")["hydra"]
    job_cfg = saved_config(job_dir / ".hydra" / "config.yaml")
    summary_file, error_file = job_dir / "summary.json", job_dir / ERROR_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    error = error_file.read_text().strip() if error_file.exists() else ""
    step_times = summary.get("step_times_s", [])[1:]  # step 1 compiles and warms caches
    return {
        "job": hydra_cfg["job"]["num"],
        "overrides": hydra_cfg["overrides"]["task"],
        "mesh": "x".join(map(str, job_cfg["mesh"]["shape"])),
        "plan": hydra_cfg["runtime"]["choices"]["plan"],
        "final_loss": summary.get("final_loss"),
        "best_val_loss": min((loss for _, loss in summary.get("val_losses", [])), default=None),
        "samples_per_s": number(summary.get("samples_per_s")),
        "tokens_per_s": number(summary.get("tokens_per_s")),
        "median_step_s": statistics.median(step_times) if step_times else None,
        "bytes_per_rank": (summary.get("memory") or {}).get("max_over_ranks", {}).get("total"),
        "status": "failed" if error else "ok",
        "error": error,
        "losses": summary.get("losses", []),
    }


def sweep_rows(sweep_dir: Path) -> List[dict]:
    """Every job dir directly under the sweep dir (Hydra's .hydra/ marks one), by job number."""
    job_dirs = [path for path in sweep_dir.iterdir() if (path / ".hydra" / "hydra.yaml").is_file()]
    return sorted((job_row(path) for path in job_dirs), key=lambda row: row["job"])


def common_overrides(rows: List[dict]) -> List[str]:
    """The overrides every job of several shares: said once above the table, so each row shows
    what it sweeps."""
    if len(rows) < 2:
        return []
    return [o for o in rows[0]["overrides"] if all(o in row["overrides"] for row in rows[1:])]


def cell(row: dict, column: str, common: List[str]) -> str:
    value = row[column]
    if column == "overrides":
        value = " ".join(o for o in value if o not in common)
    elif value is None:
        value = ""
    elif column in FORMATS and isinstance(value, (int, float)):
        value = FORMATS[column].format(value)
    return str(value).replace("|", "\\|")


def markdown_table(rows: List[dict]) -> str:
    common = common_overrides(rows)
    failed = sum(row["status"] == "failed" for row in rows)
    lines = [f"{len(rows)} jobs, {failed} failed; overrides common to every job: {' '.join(common) or '(none)'}", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(cell(row, column, common) for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(rows: List[dict], path: Path) -> None:
    """Every value at full precision (floats round-trip), all of each job's overrides."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, "overrides": " ".join(row["overrides"])} for row in rows)


LABEL_CHARS = 60  # a job's label in the plot; the table has its whole line of overrides


def plot(rows: List[dict], path: Path) -> None:
    """Left: every job's loss per step on one axis; right: each job's samples/s."""
    # Imported here: Hydra builds the callback for every run, and most runs never plot.
    # Agg through Figure, not pyplot: no global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    common = common_overrides(rows)
    # shortened: a long line of overrides (a path, a target list) squeezed the plot to nothing
    labels = [textwrap.shorten(f"{row['job']}: {cell(row, 'overrides', common) or row['mesh']}", LABEL_CHARS)
              for row in rows]
    fig = Figure(figsize=(13, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, speed_ax = fig.subplots(1, 2)
    for row, label in zip(rows, labels):
        if row["losses"]:
            loss_ax.plot(range(1, len(row["losses"]) + 1), row["losses"], label=label)
    loss_ax.set(xlabel="step", ylabel="loss", title="training loss")
    loss_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if loss_ax.lines:
        loss_ax.legend(fontsize="small")
    speed_ax.bar(range(len(rows)), [row["samples_per_s"] or 0 for row in rows])
    for i, row in enumerate(rows):
        if row["status"] == "failed":
            speed_ax.text(i, 0, "failed", ha="center", va="bottom", color="tab:red")
    speed_ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize="small")
    speed_ax.set(ylabel="samples/s", title="throughput (step 1 excluded)")
    fig.savefig(path, dpi=100)


def write_report(rows: List[dict], sweep_dir: Path) -> str:
    """sweep_report.md / .csv / .png in the sweep dir; returns the table for stdout."""
    table = markdown_table(rows)
    (sweep_dir / "sweep_report.md").write_text(
        f"# Sweep report: {sweep_dir}\n\n{table}\n\n![loss and throughput per job](sweep_report.png)\n")
    write_csv(rows, sweep_dir / "sweep_report.csv")
    plot(rows, sweep_dir / "sweep_report.png")
    return f"sweep report ({sweep_dir / 'sweep_report.md'}, .csv, .png):\n{table}"


def study_of(config: DictConfig) -> Optional[Tuple[str, str]]:
    """The Optuna sweeper's storage and study name; None for another sweeper or a study in memory."""
    sweeper = config.hydra.sweeper
    if "optuna" not in str(sweeper.get("_target_", "")) or not sweeper.get("storage") or not sweeper.get("study_name"):
        return None
    return str(sweeper.storage), str(sweeper.study_name)


def trial_cell(value: Any) -> str:
    """A parameter or objective in the table: floats to 6 significant digits (the CSV has them all)."""
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value).replace("|", "\\|")


def trial_values(trial: dict, names: List[str], errors: dict) -> list:
    """A trial's row: its rank, number, parameters, objective, state, and its job's error line
    (job N ran trial N: hydra_plugins/framework_sweepers)."""
    return [trial["rank"], trial["trial"], *(trial["params"].get(name) for name in names), trial["value"],
            trial["state"], errors.get(trial["trial"], "")]


def write_trials(config: DictConfig, study: Tuple[str, str], rows: List[dict]) -> Tuple[str, List[dict]]:
    """The study's trials, best first: sweep_trials.csv (every value at full precision) and a
    section of sweep_report.md; returns the section for stdout, and the trials."""
    from framework.hpo import study_trials, sweep_metric  # (optuna: only for its sweeps)

    sweep_dir = Path(config.hydra.sweep.dir)
    direction, trials = study_trials(*study)
    metric, errors = sweep_metric(config), {row["job"]: row["error"] for row in rows}
    names = sorted({name for trial in trials for name in trial["params"]})
    header = ["rank", "trial", *names, metric, "state", "error"]
    with open(sweep_dir / "sweep_trials.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *(trial_values(trial, names, errors) for trial in trials)])
    states = [trial["state"] for trial in trials]
    best = "".join(f"; best: trial {t['trial']}, {trial_cell(t['value'])}" for t in trials if t["rank"] == 1)
    lines = [f"Optuna study {study[1]} ({study[0]}): {len(trials)} trials, {states.count('COMPLETE')} complete, "
             f"{states.count('FAIL')} failed; {direction} {metric}{best}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(trial_cell, trial_values(trial, names, errors))) + " |" for trial in trials]
    table = "\n".join(lines)
    with open(sweep_dir / "sweep_report.md", "a") as f:
        f.write(f"\n## Trials\n\n{table}\n")
    return f"trials (sweep_trials.csv):\n{table}", trials


class SweepReport(Callback):
    """Registered in conf/config.yaml (hydra.callbacks), so every -m sweep ends with its report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_rows(sweep_dir)
        failed = any(row["status"] == "failed" for row in rows)
        try:
            print(write_report(rows, sweep_dir))
            study = study_of(config)
            if study:
                section, trials = write_trials(config, study, rows)
                print(section)
                failed = not any(trial["state"] == "COMPLETE" for trial in trials)
        except Exception as error:  # Hydra would turn it into a warning too; a failed job's exit 1 must still come
            print(f"sweep report not written: {type(error).__name__}: {error}", file=sys.stderr)
        if failed:
            # Hydra turns a callback's exceptions into warnings, but lets SystemExit through.
            sys.exit(1)
