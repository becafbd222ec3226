"""Rank 0's loggers: TensorBoard, Weights & Biases, MLflow, any of them (`logger=[tensorboard,
wandb,mlflow]`), each given the same scalars at the same steps, the same text, the composed
config (flattened) and summary.json's figures at the end.

- TensorBoard: events under <job dir>/tb; hparams (mesh shape, plan, ...) with the final metrics
  so sweeps compare in the HPARAMS tab.
- W&B (the `tracking` extra): offline by default, files under <job dir>/wandb that `wandb sync`
  uploads later; the group is the sweep's name in a multirun.
- MLflow (the `tracking` extra): a tracking URI (by default a sqlite file beside the job dir, one
  for a whole sweep) or a server's; the experiment is the sweep's or the recipe's name; the final
  checkpoint and Hugging Face export as artifacts with `logger.mlflow.log_checkpoints`.
"""
import html
import importlib.util
import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from framework.config.errors import ConfigError


def flattened(config: Mapping, prefix: str = "") -> Dict[str, Any]:
    """{"trainer.max_steps": 20, ...}: a nested config as the flat parameters trackers show."""
    flat: Dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class TensorBoardLogger:
    def __init__(self, log_dir: str, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log_text(self, tag: str, text: str, step: Optional[int] = None) -> None:
        # Markdown: indent four spaces so YAML and tables keep their layout.
        self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step or 0)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def log_hparams(self, hparam_values: Dict[str, Any], final_metrics: Dict[str, float], step: int) -> None:
        """Write the hparams summary into this run's own event file (not a sub-run), then the
        metrics as scalars under the same tags, which is what the HPARAMS tab reads."""
        from torch.utils.tensorboard.summary import hparams

        clean = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in hparam_values.items()}
        for summary in hparams(clean, final_metrics):
            self.writer.file_writer.add_summary(summary)
        self.log_scalars(step, final_metrics)

    def log_summary(self, summary: dict, out_dir: str) -> None:
        """(TensorBoard's part of the summary is the hparams and final metrics above.)"""

    def close(self) -> None:
        self.writer.close()


def _numbers(summary: dict) -> Dict[str, float]:
    """summary.json's figures that are one number each (lists and sections stay in the file)."""
    return {key: float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


class WandbLogger:
    def __init__(self, options: DictConfig, cfg: dict, out_dir: str, job: dict):
        import wandb

        self.run = wandb.init(mode=options.mode, project=options.project, dir=out_dir,
                              name=options.name or _job_name(out_dir, job), group=options.group or job.get("sweep"),
                              tags=list(options.tags), config=flattened(cfg), reinit="finish_previous",
                              settings=wandb.Settings(silent=True))  # the console is the run's log

    def log_text(self, tag: str, text: str, step: Optional[int] = None) -> None:
        """Once (step None: the config, the mesh layout) in the run's summary; a step's text (GRPO's
        completions) as an HTML panel at its step, which W&B pages through."""
        import wandb

        if step is None:
            self.run.summary[f"text/{tag}"] = text
        else:
            self.run.log({f"text/{tag}": wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_hparams(self, hparam_values: Dict[str, Any], final_metrics: Dict[str, float], step: int) -> None:
        self.run.summary.update(final_metrics)

    def log_summary(self, summary: dict, out_dir: str) -> None:
        self.run.summary.update({f"summary/{key}": value for key, value in _numbers(summary).items()})

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, options: DictConfig, cfg: dict, out_dir: str, job: dict):
        import mlflow

        for name in ("mlflow", "alembic"):  # its database's set-up lines ("Creating initial MLflow database tables")
            logging.getLogger(name).setLevel(logging.WARNING)
        self.mlflow, self.options = mlflow, options
        mlflow.set_tracking_uri(tracking_uri(options, out_dir))
        experiment = options.experiment or job.get("sweep") or job.get("recipe") or "framework"
        if options.tracking_uri is None and mlflow.get_experiment_by_name(experiment) is None:
            # artifacts beside the database, not in ./mlruns under whatever directory the run started in
            root = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "mlartifacts", experiment.replace("/", "_"))
            mlflow.create_experiment(experiment, artifact_location=Path(root).as_uri())
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=_job_name(out_dir, job), tags={"framework.job_dir": out_dir})
        params = {key: json.dumps(value) if not isinstance(value, (int, float, str, bool, type(None))) else value
                  for key, value in flattened(cfg).items()}
        keys = sorted(params)
        for start in range(0, len(keys), 100):  # MLflow takes at most 100 parameters a call
            mlflow.log_params({key: params[key] for key in keys[start:start + 100]}, synchronous=False)

    def log_text(self, tag: str, text: str, step: Optional[int] = None) -> None:
        """text/<tag>.txt once (the config), a step's as text/<tag>/step_<N>.txt: one artifact a step."""
        self.mlflow.log_text(text, f"text/{tag}.txt" if step is None else f"text/{tag}/step_{step:07d}.txt")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Asynchronous (MLflow's queue: no database transaction or HTTP round trip in the step);
        close() flushes it."""
        self.mlflow.log_metrics({tag.replace("@", "_"): float(value) for tag, value in scalars.items()}, step=step,
                                synchronous=False)

    def log_hparams(self, hparam_values: Dict[str, Any], final_metrics: Dict[str, float], step: int) -> None:
        self.log_scalars(step, final_metrics)

    def log_summary(self, summary: dict, out_dir: str) -> None:
        """summary.json's numbers as metrics, the file itself, and with log_checkpoints the
        final checkpoint and the Hugging Face export (checkpoint.final_hf) as artifacts."""
        self.mlflow.log_metrics({f"summary/{key}": value for key, value in _numbers(summary).items()}, synchronous=False)
        self.mlflow.log_dict(summary, "summary.json")
        if self.options.log_checkpoints:
            saved = summary.get("checkpoints") or []
            final = os.path.join(out_dir, "checkpoints", f"step_{saved[-1]['step']}") if saved else None
            for path, name in ((final, "checkpoint"), (os.path.join(out_dir, "hf"), "hf")):
                if path and os.path.isdir(path):
                    self.mlflow.log_artifacts(path, name)

    def close(self) -> None:
        self.mlflow.flush_async_logging()  # every queued metric stored before the run ends
        self.mlflow.end_run()


def _job_name(out_dir: str, job: dict) -> str:
    """The job dir below its sweep dir (a multirun's job number), else its last two parts (DATE/TIME)."""
    if job.get("sweep_dir"):
        return os.path.relpath(out_dir, job["sweep_dir"])
    return "/".join(os.path.normpath(out_dir).split(os.sep)[-2:])


def tracking_uri(options: DictConfig, out_dir: str) -> str:
    """logger.mlflow.tracking_uri, or a sqlite file in the job dir's parent (a sweep's: one for all its jobs)."""
    return options.tracking_uri or f"sqlite:///{os.path.join(os.path.dirname(os.path.abspath(out_dir)), 'mlflow.db')}"


class Loggers:
    """Every configured logger, called alike (rank 0's; other ranks hold none)."""

    def __init__(self, loggers: List[Any]):
        self.loggers = loggers

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def __getattr__(self, method: str):
        def each(*args, **kwargs) -> None:
            for logger in self.loggers:
                getattr(logger, method)(*args, **kwargs)
        return each


def build_loggers(cfg: DictConfig, out_dir: str, purge_step: Optional[int]) -> Loggers:
    """The loggers cfg.logger names. `purge_step` (a resumed run's first step): TensorBoard hides
    what a crashed attempt logged past the checkpoint."""
    options = cfg.logger
    plain = {key: value for key, value in OmegaConf.to_container(cfg, resolve=True).items() if key != "job"}
    job = dict(cfg.get("job") or {})
    loggers: List[Any] = []
    if options.tensorboard:
        loggers.append(TensorBoardLogger(os.path.join(out_dir, "tb"), purge_step=purge_step))
    if options.get("wandb") is not None:
        loggers.append(WandbLogger(options.wandb, plain, out_dir, job))
    if options.get("mlflow") is not None:
        loggers.append(MlflowLogger(options.mlflow, plain, out_dir, job))
    return Loggers(loggers)


WANDB_MODES = ("offline", "online", "disabled")


def check_loggers(cfg: DictConfig) -> None:
    """Before launch: each logger's package is installed, W&B's mode is one it has, an MLflow
    server answers."""
    options = cfg.logger
    for name, package in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if options.get(name) is not None and importlib.util.find_spec(package) is None:
            raise ConfigError("logger", name, f"logs with the `{package}` package, not installed here; pip install "
                                              f"'.[tracking]' (or drop {name} from logger=[...])")
    if options.get("wandb") is not None and options.wandb.mode not in WANDB_MODES:
        raise ConfigError("logger.wandb.mode", options.wandb.mode, f"use one of {', '.join(WANDB_MODES)}")
    uri = options.mlflow.tracking_uri if options.get("mlflow") is not None else None
    if uri and uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5).close()
        except (urllib.error.URLError, OSError) as error:
            raise ConfigError("logger.mlflow.tracking_uri", uri, f"no MLflow server answers there "
                                                                 f"({getattr(error, 'reason', error)}); start it "
                                                                 f"(mlflow server --host ...) or use a sqlite:/// URI") from None


LOGGER_CONFIGS = Path(__file__).resolve().parent.parent / "conf" / "logger"


def check_logger_overrides(overrides: List[str]) -> None:
    """`logger=[...]` on the command line, before Hydra composes it: Hydra merges a logger named
    twice silently, and names no option when one of a list does not exist."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides([o for o in overrides if o.lstrip("+~").startswith(
            "logger=")]):
        names = override.value()
        if not isinstance(names, list):
            continue
        known = sorted(path.stem for path in LOGGER_CONFIGS.glob("*.yaml"))
        for name in names:
            if names.count(name) > 1:
                raise ConfigError("logger", names, f"names {name} twice; name each logger once")
            if str(name) not in known:
                raise ConfigError("logger", names, f"{name} is no logger config; the logger configs are: "
                                                   f"{', '.join(known)}")
