"""What a run measures and reports, apart from the loop that trains: step and window timers
(evaluation kept out, a save's blocking recorded with the save), the progress bar, TensorBoard
(rank 0), tokens/s and MFU over the tokens a step forwards, the training state's bytes after the
first step, on a GPU the allocator's peaks (framework.training.memory), and summary.json."""
import json
import logging
import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf
from tqdm import tqdm

from framework.atomic import atomic_file
from framework.checkpoint.layout import step_dir
from framework.data.batch import Batch
from framework.data.batch import IGNORE
from framework.checkpoint.weights import restart_count
from framework.parallel.mesh import layout_table
from framework.training.logger import Loggers, build_loggers
from framework.training.memory import DeviceMemory, MemorySnapshot, figures_line, state_bytes, trouble
from framework.training.run import Run
from framework.models.protocol import offered

log = logging.getLogger("framework")

# The GPUs' published figures, the planner's (planner.device=NAME) and MFU's: a data file, so read by
# path (the planner is a layer above).
DEVICE_PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "planner", "profiles.yaml")


def device_profiles() -> Dict[str, dict]:
    """Each GPU's published figures by its profile name (h100, h200, a100): framework/planner/profiles.yaml."""
    with open(DEVICE_PROFILES) as f:
        return yaml.safe_load(f)


def peak_flops(cfg) -> Optional[float]:
    """The device's dense bf16 matmul peak (its profile's matmul_tflops, the figure MFU is commonly quoted
    against), found by profile name in the CUDA device's name; trainer.peak_tflops overrides it."""
    if cfg.trainer.peak_tflops is not None:
        return cfg.trainer.peak_tflops * 1e12
    if cfg.mesh.device_type != "cuda":
        return None
    name = torch.cuda.get_device_name().lower()
    return next((profile["matmul_tflops"] * 1e12 for key, profile in device_profiles().items() if key in name), None)


def mfu(tokens_per_s: float, flops_per_token: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_per_token / peak_flops


def memory_per_rank(run: Run) -> dict:
    """This rank's training-state bytes (with what the objective holds besides, DPO's reference)
    and the largest over all ranks (one all-reduce)."""
    mine = state_bytes(run.module, run.optimizer)
    held = run.objective.held_bytes()
    mine = {**{k: v for k, v in mine.items() if k != "total"}, **held, "total": mine["total"] + sum(held.values())}
    largest = torch.tensor(list(mine.values()), dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {f"rank{run.rank}": mine,
            "max_over_ranks": dict(zip(mine, (int(v) for v in largest.tolist())))}


class Metrics:
    """Timers and reports of one attempt, which starts at step `first` (after a resumed
    checkpoint) and continues the history's step times."""

    def __init__(self, run: Run, first: int, step_times: List[float]):
        cfg = run.cfg
        self.run, self.first, self.step_times = run, first, step_times
        # rank 0's; purge_step hides events a crashed attempt logged past the checkpoint: no duplicate points
        self.loggers = build_loggers(cfg, run.out_dir, first if run.resumed else None) if run.rank == 0 else Loggers([])
        self.loggers.log_text("config", OmegaConf.to_yaml(cfg))
        self.loggers.log_text("mesh_layout", layout_table(cfg.mesh.shape, cfg.mesh.dim_names, run.roles.spans()))
        self.progress = tqdm(total=cfg.trainer.max_steps, initial=first - 1, desc="train",
                             disable=not (run.rank == 0 and cfg.trainer.progress_bar))
        self.global_batch = cfg.data.global_batch_size
        self.seq_len = getattr(run.dataset, "seq_len", None)  # token datasets: also report tokens/s
        self.tokens_per_sample: Optional[float] = None  # forwarded, the objective's count (taken)
        model = run.module
        self.flops_per_token = offered(model).flops_per_token(self.seq_len) if self.seq_len else None
        self.peak = peak_flops(cfg)
        self.start = self.window_start = self.step_start = time.perf_counter()
        self.window_first = first
        self.first_step_s: Optional[float] = None
        self.first_step_unix: Optional[float] = None
        self.memory: Optional[dict] = None
        self.headline: Dict[str, float] = {}  # the objective's terms shown beside the loss (GRPO's reward), last logged
        # a mixture's sources (framework.data.mixture): learned tokens per source since the last logging step
        self.source_names = list(getattr(run.dataset, "source_names", ()))
        self.source_tokens = torch.zeros(len(self.source_names), device=cfg.mesh.device_type)
        self.device_memory = DeviceMemory.of(torch.device(cfg.mesh.device_type).type)
        self.snapshot = MemorySnapshot(run.out_dir, run.rank, cfg.trainer.memory_snapshot) if self.device_memory \
            else None
        if cfg.trainer.memory_snapshot and not self.device_memory and run.rank == 0:
            log.warning("trainer.memory_snapshot=true records a GPU allocator's history: nothing to record on %s",
                        cfg.mesh.device_type)

    def taken(self, batch: Batch) -> Batch:
        """A batch the loop takes: the tokens a step forwards per sample (the objective's count:
        GRPO's group, a pair's two sequences), and a mixture's learned tokens per source."""
        if self.seq_len and self.tokens_per_sample is None:
            self.tokens_per_sample = self.run.objective.forwarded_tokens(batch) / len(batch.inputs)
        if batch.source is not None:
            learned = (batch.targets != IGNORE).flatten(1).sum(1).float()
            self.source_tokens += torch.bincount(batch.source, weights=learned, minlength=len(self.source_names))
        return batch

    def take_source_tokens(self) -> torch.Tensor:
        tokens, self.source_tokens = self.source_tokens, torch.zeros_like(self.source_tokens)
        return tokens

    def source_shares(self, step: int, tokens: List[float]) -> None:
        """Each source's share of the window's learned tokens (all DP replicas'), to TensorBoard."""
        if tokens:
            self.scalars(step, {f"data/share/{name}": count / max(sum(tokens), 1.0)
                                for name, count in zip(self.source_names, tokens)})

    def scalars(self, step: int, values: dict) -> None:
        """To every logger, on steps with something to log (a tracker call is a round trip)."""
        if values:
            self.loggers.log_scalars(step, values)

    def exclude(self, seconds: float) -> None:
        """Time spent outside training (evaluation): kept out of step times and throughput."""
        self.step_start += seconds
        self.window_start += seconds
        self.start += seconds

    def step_done(self, step: int) -> None:
        """The step's time (a save's blocking is recorded with the save), fault tolerance's
        figures (torchft: the live replica groups); after the first step, when the optimizer's
        state exists, the training state's bytes."""
        now = time.perf_counter()
        self.step_times.append(now - self.step_start)
        self.step_start = now
        self.progress.update(1)
        self.scalars(step, self.run.fault_tolerance.scalars())
        if self.first_step_s is None:
            self.first_step_s, self.first_step_unix = now - self.start, time.time()
            self.memory = memory_per_rank(self.run)
            self.scalars(self.first, {f"memory/{k}_bytes": v for k, v in self.memory["max_over_ranks"].items()})

    def saved(self, step: int, blocking_s: float) -> None:
        self.step_start = time.perf_counter()
        self.scalars(step, {"checkpoint_blocking_s": blocking_s})

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        """A logging step: the window's throughput since the last one, to the bar and TensorBoard."""
        step_time = (time.perf_counter() - self.window_start) / (step - self.window_first + 1)
        self.window_start, self.window_first = time.perf_counter(), step + 1
        self.progress.set_postfix(loss=f"{loss:.4f}", **{name: f"{value:.4f}" for name, value in self.headline.items()})
        values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "samples_per_s": self.global_batch / step_time,
                  "step_time_s": step_time}
        if self.tokens_per_sample:
            values["tokens_per_s"] = self.global_batch * self.tokens_per_sample / step_time
        if self.flops_per_token and self.peak and self.tokens_per_sample:
            values["mfu"] = mfu(values["tokens_per_s"], self.flops_per_token, self.peak * dist.get_world_size())
        if self.device_memory:
            values.update(self.device_window(step))
        self.scalars(step, values)

    def device_window(self, step: int) -> dict:
        """This rank's allocator peaks since the last logging step in its log (a warning when it
        retried or ran out), the largest over ranks (one all-reduce) for the loggers."""
        figures = self.device_memory.window()
        log.info("step %d: %s", step, figures_line(figures))
        warning = trouble(figures)
        if warning:
            log.warning("rank %d: %s", self.run.rank, warning)
        largest = torch.tensor(list(figures.values()), dtype=torch.float64, device=self.source_tokens.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return {f"memory/{name}": value for name, value in zip(figures, largest.tolist())}

    def summary(self, history: dict, stopped_by: Optional[str] = None) -> dict:
        """The attempt's summary; rank 0 also logs it, gives the loggers the hparams and the
        summary's figures, closes them and writes summary.json. `stopped_by`: the signal that ended the run before max_steps."""
        cfg, run = self.run.cfg, self.run
        last = run.state.step  # trainer.max_steps, or where a signal stopped the run
        self.progress.close()
        wall = time.perf_counter() - self.start  # training time, evaluation excluded
        steady_steps = last - self.first  # this attempt's steps after its first
        # None (JSON null) when this attempt ran only its first step, which is not timed
        samples_per_s = self.global_batch * steady_steps / (wall - self.first_step_s) if steady_steps > 0 else None
        summary = {
            "mesh_shape": list(cfg.mesh.shape),
            "dim_names": list(cfg.mesh.dim_names),
            "plan": OmegaConf.to_container(cfg.plan, resolve=True),
            "steps": last,
            "stopped": {"signal": stopped_by, "step": last, "checkpoint": step_dir(run.checkpointer.dir, last)
                        if history["checkpoints"] and history["checkpoints"][-1]["step"] == last else None}
            if stopped_by else None,
            "final_loss": history["losses"][-1],
            "losses": history["losses"],
            "grad_norms": history["grad_norms"],
            "val_losses": history["val_losses"],
            "overrides": list(cfg.get("overrides", [])),
            "first_step_s": self.first_step_s,  # this attempt's first step (compiles, warms caches): kept out of samples_per_s
            "first_step_done_unix": self.first_step_unix,  # for startup timing from outside (bench/)
            "step_times_s": self.step_times,
            "wall_s": wall,
            "samples_per_s": samples_per_s,
            # every token a step forwards (docs/training.md): GRPO's completions, both sequences of DPO's pairs
            "tokens_per_step": self.global_batch * self.tokens_per_sample if self.tokens_per_sample else None,
            "tokens_per_s": samples_per_s * self.tokens_per_sample if self.tokens_per_sample and samples_per_s else None,
            "resumed_from": {"path": run.resumed.path, "step": run.resumed.step, "load_s": run.resumed.load_s}
            if run.resumed else None,
            "restarts": restart_count(),
            "checkpoints": history["checkpoints"],
            "memory": self.memory,  # bytes of parameters, gradients, optimizer state: rank 0's and the max over ranks
            "device_memory": self.device_summary(),  # on a GPU: the allocator's peaks over the run (None on a CPU)
            **run.fault_tolerance.summary(),  # launcher.fault_tolerance: the live replica groups of each step
            **run.objective.summary(),  # objective=grpo: the seconds each step spent generating
        }
        if run.rank == 0:
            self._report(summary)
        return summary

    def device_summary(self) -> Optional[dict]:
        """The run's allocator peaks, rank 0's and the largest over ranks (one all-reduce); with
        trainer.memory_snapshot, each rank's snapshot dumped."""
        if not self.device_memory:
            return None
        self.device_memory.window()  # (the steps since the last logging step)
        self.snapshot.close()
        mine = self.device_memory.run_peak
        largest = torch.tensor(list(mine.values()), dtype=torch.float64, device=self.source_tokens.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return {f"rank{self.run.rank}": mine, "max_over_ranks": dict(zip(mine, largest.tolist()))}

    def _report(self, summary: dict) -> None:
        cfg, samples_per_s = self.run.cfg, summary["samples_per_s"]
        throughput = f"{samples_per_s:.1f} samples/s" if samples_per_s else "samples/s not measured (only a first step)"
        shown = "".join(f", {name} {value:.4f}" for name, value in self.headline.items())
        log.info("final loss %.6f%s after %d steps, %s", summary["final_loss"], shown, summary["steps"], throughput)
        if self.loggers:
            self.loggers.log_hparams(
                {"mesh": "x".join(map(str, cfg.mesh.shape)), "dim_names": list(cfg.mesh.dim_names),
                 "plan": summary["plan"], "global_batch_size": self.global_batch, "max_steps": cfg.trainer.max_steps,
                 **dict(override.split("=", 1) for override in summary["overrides"] if "=" in override)},
                {"final/loss": summary["final_loss"],
                 **({"final/samples_per_s": samples_per_s} if samples_per_s else {})},
                summary["steps"],
            )
            self.loggers.log_summary(summary, self.run.out_dir)
            self.loggers.close()
        with atomic_file(os.path.join(self.run.out_dir, "summary.json")) as f:
            json.dump(summary, f, indent=2)
