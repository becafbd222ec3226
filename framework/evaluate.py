"""`python -m framework.evaluate SOURCE --tasks TASK[,TASK] [--limit N] [--batch-size B] [--out DIR]
[--run-dir RUN_DIR]`: score a model on benchmark tasks with EleutherAI's lm-eval (the `eval` extra).

SOURCE is a Hugging Face model directory (config.json, *.safetensors, tokenizer files), used as
it is, or a checkpoint of a model=hf run (a step_N dir, or a checkpoints dir: its newest), which
framework.export writes to a temporary Hugging Face directory first (LoRA adapters merged).
lm-eval's Hugging Face backend (HFLM: transformers' model and tokenizer, on cuda when there is
one, else cpu) then answers each task. The tasks in framework/eval_tasks/ ship with the
framework and read their data from beside their YAML, so nothing is downloaded (next_letter:
four-way multiple choice on the alphabet); any other name is one of lm-eval's own tasks, whose
data comes from the Hugging Face Hub where this machine reaches it.

The scores are printed as lm-eval's table and written to DIR/eval.json (default: the checkpoint's
step_N dir for a checkpoint, the current directory for a Hugging Face one; each run rewrites the
file). `--run-dir RUN_DIR` also logs each score as `eval/<task>/<metric>` at the checkpoint's step
to the run's TensorBoard (RUN_DIR/tb). Bad input (a SOURCE that is neither, a model with no
Hugging Face format, an unknown task, lm-eval not installed, an option out of range) exits 2 with
one line naming it, before any model is read; an evaluation that fails exits 1.
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

import yaml

from framework.atomic import atomic_file
from framework.checkpoint.layout import CheckpointError, read_meta
from framework.cli import checkpoint_source, parsed_status
from framework.config.errors import ConfigError
from framework.models.hf import HF_TARGETS
from framework.models.nf4 import torchao_quietly
from framework.parallel.device import resolve_device
from framework.export import export
from framework.training.logger import TensorBoardLogger

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_tasks")
SOURCES = "a Hugging Face model directory (config.json), a step_N checkpoint or a checkpoints dir (its newest)"
INSTALL = "pip install '.[eval]'"


@dataclass
class Source:
    """What SOURCE names: a Hugging Face directory, or a checkpoint (its step_N dir and step)."""
    path: str
    checkpoint: Optional[str] = None
    step: Optional[int] = None


def local_tasks() -> Dict[str, str]:
    """The tasks that ship with the framework: each name and its YAML file."""
    found = {}
    for name in sorted(os.listdir(TASKS_DIR)):
        if name.endswith(".yaml"):
            with open(os.path.join(TASKS_DIR, name)) as f:
                found[yaml.safe_load(f)["task"]] = os.path.join(TASKS_DIR, name)
    return found


def local_task_config(path: str) -> dict:
    """A shipped task's config as lm-eval reads it, its data files made absolute (the datasets
    library reads a relative one from the current directory, not from beside the YAML)."""
    with open(path) as f:
        config = yaml.safe_load(f)
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: os.path.join(os.path.dirname(path), file)
                                              for split, file in files.items()}
    return config


def checked_source(source: str) -> Source:
    """SOURCE as a Hugging Face directory or a checkpoint of a model that has that format, from
    its framework.json alone (no weight read)."""
    path = os.path.abspath(source)
    checkpoint = checkpoint_source(path, SOURCES)
    if checkpoint is None:
        return Source(path)
    meta = read_meta(checkpoint)
    target = (meta["config"].get("model") or {}).get("_target_")
    if target not in HF_TARGETS:
        raise ConfigError("SOURCE", source, f"its model is {target}, which has no Hugging Face format for lm-eval's "
                                            f"Hugging Face backend to load; evaluate a model=hf run's checkpoint or a "
                                            f"Hugging Face directory")
    return Source(path, checkpoint, meta["step"])


def task_names(value: str) -> List[str]:
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise ConfigError("--tasks", value, "give task names separated by commas, e.g. --tasks next_letter")
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise ConfigError("--tasks", value, f"names {repeated} twice; name each task once")
    return names


def task_specs(names: List[str], value: str):
    """lm-eval's TaskManager and what it loads for each name (a shipped task's config, or a name
    from lm-eval's own list, which only a name outside the shipped ones makes it read: ~10 s);
    an unknown name refused, naming the shipped ones."""
    if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("transformers") is None:
        raise ConfigError("--tasks", value, f"runs on EleutherAI's lm-eval (lm_eval) and transformers, not installed "
                                            f"here; {INSTALL}")
    from lm_eval.tasks import TaskManager

    local = local_tasks()
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=any(name not in local for name in names))
    for name in names:
        if name not in manager.all_tasks:
            raise ConfigError("--tasks", name, f"no such task; the local ones are {', '.join(local)} (lm-eval's own: "
                                               f"lm-eval ls tasks)")
    return manager, [local_task_config(local[name]) if name in local else name for name in names]


def check_options(args: argparse.Namespace, source: Source) -> None:
    """Before any loading: the first option out of range, named alone."""
    for name in ("limit", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "must be >= 1")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError("--out", args.out, "is a file; name a directory (eval.json is written in it)")
    if args.run_dir is not None:
        if not os.path.isdir(args.run_dir):
            raise ConfigError("--run-dir", args.run_dir, "no such directory; give the run's dir (outputs/DATE/TIME)")
        if source.checkpoint is None:
            raise ConfigError("--run-dir", args.run_dir, "logs at a checkpoint's step; give a checkpoint as SOURCE")


def lm_eval_results(hf_dir: str, manager, specs: list, limit: Optional[int], batch_size: int) -> dict:
    """lm-eval's results for the Hugging Face model in `hf_dir` (its samples left out)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    device = resolve_device("auto", local_ranks=1).type  # (as a one-rank run's mesh.device_type=auto)
    with torchao_quietly():  # (its model class imports transformers' modeling_utils, whose quantizers load torchao)
        model = HFLM(pretrained=hf_dir, batch_size=batch_size, device=device)
    return simple_evaluate(model=model, tasks=specs, limit=limit, task_manager=manager, log_samples=False)


def evaluate(source: Source, manager, specs: list, limit: Optional[int] = None, batch_size: int = 8) -> dict:
    """lm-eval's results for SOURCE's model; a checkpoint's through a temporary export."""
    if source.checkpoint is None:
        return lm_eval_results(source.path, manager, specs, limit, batch_size)
    with tempfile.TemporaryDirectory(prefix="framework-evaluate-") as tmp:
        export(source.checkpoint, os.path.join(tmp, "hf"), "hf")
        return lm_eval_results(os.path.join(tmp, "hf"), manager, specs, limit, batch_size)


def scalars(results: dict) -> Dict[str, float]:
    """`eval/<task>/<metric>` (`/<filter>` after it where a task filters its answers) of each
    metric lm-eval reports (its keys are `metric,filter`), standard errors left out."""
    found = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if kind and isinstance(value, (int, float)) and not metric.endswith("_stderr"):
                found[f"eval/{task}/{metric}" + ("" if kind == "none" else f"/{kind}")] = float(value)
    return found


def write_results(results: dict, source: Source, batch_size: int, out: str) -> str:
    """eval.json in `out`: lm-eval's results, with SOURCE as the model they name (the temporary
    directory lm-eval loaded a checkpoint's export from is gone) and the checkpoint's step."""
    from lm_eval.utils import handle_non_serializable

    results = {**results, "model_name": source.path, "config": {**results.get("config", {}), "model": source.path,
                                                                "batch_size": batch_size},
               "source": {"path": source.path, "checkpoint": source.checkpoint, "step": source.step}}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "eval.json")
    with atomic_file(path, "w") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable)
    return path


def log_to_run(run_dir: str, step: int, results: dict) -> None:
    logger = TensorBoardLogger(os.path.join(run_dir, "tb"))
    logger.log_scalars(step, scalars(results))
    logger.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m framework.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help=SOURCES)
    p.add_argument("--tasks", required=True, metavar="TASK[,TASK]",
                   help=f"lm-eval task names, separated by commas; shipped here: {', '.join(local_tasks())}")
    p.add_argument("--limit", type=int, metavar="N", help="at most this many examples of each task (default: all)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="examples per forward (default 8)")
    p.add_argument("--out", metavar="DIR", help="write DIR/eval.json (default: the checkpoint's step_N dir; the "
                                                "current directory for a Hugging Face directory)")
    p.add_argument("--run-dir", metavar="RUN_DIR", help="also log eval/<task>/<metric> at the checkpoint's step to "
                                                        "RUN_DIR/tb, the run's TensorBoard")
    return p


def _run(args: argparse.Namespace) -> int:
    source = checked_source(args.source)
    check_options(args, source)
    manager, specs = task_specs(task_names(args.tasks), args.tasks)
    from lm_eval.utils import make_table  # (task_specs checked that lm-eval is installed)

    try:
        results = evaluate(source, manager, specs, args.limit, args.batch_size)
    except (ConfigError, CheckpointError):
        raise
    except Exception as error:  # lm-eval's, transformers', a Hub task's download: the run failed
        print(f"evaluate failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
              file=sys.stderr)
        return 1
    print(make_table(results))
    path = write_results(results, source, args.batch_size, args.out or source.checkpoint or os.getcwd())
    if args.run_dir is not None:
        log_to_run(args.run_dir, source.step, results)
    print(f"wrote {path}" + (f"; logged to {os.path.join(args.run_dir, 'tb')}" if args.run_dir else ""))
    return 0


def main(argv: List[str]) -> int:
    return parsed_status(parser(), argv, _run, "evaluate failed")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
