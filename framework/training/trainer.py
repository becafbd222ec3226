"""The Trainer: one train_step (forward and backward, clip, optimizer, schedule) that the loop,
verify, inspect and the dry run share, evaluation, and the loop that steps, evaluates, saves
and logs. What it measures and reports is framework.training.metrics; what it carries across a
checkpoint is framework.training.state.

The step's loss is the objective's (framework.training.objectives): each micro-batch's loss sum
over the step's units (StepShare), the global batch's count of units over the DP size, so that DP's
gradient average is the global sum over the global count on every mesh, with micro-batches and
pipeline stages alike. Losses stay on their ranks until a logging step; then one all-reduce over
the DP group turns the pending per-replica losses into global-batch losses (TP ranks already
agree), so the hot path has no extra collective. (Data whose targets may not count, instruction
data, adds one: its count of units, a number all-reduced over DP once per step. Under torchft's
replica groups each step's loss is averaged over the groups that trained it, since the quorum may
change from one step to the next: it rides in the gradients' all-reduce.)

Fault tolerance is a component with hooks on the loop (run.fault_tolerance: begin, before_step,
should_commit, after_step; framework.parallel.fault_tolerance), no fault tolerance the default.
"""
import gc
import logging
import os
import time
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from framework.data.batch import Batch
from framework.data.loader import batches
from framework.models.hf_export import save_hf_sharded
from framework.parallel.grad_norm import clip_grad_norm, global_grad_norm
from framework.parallel.pipeline import Pipeline, gathered_over_stages
from framework.parallel.pipeline_layout import microbatches
from framework.parallel.plan import vocabulary_sharded
from framework.parallel.replica_check import check_replicas
from framework.training.interrupt import Interrupt
from framework.training.metrics import Metrics
from framework.training.objectives.base import StepShare
from framework.training.profiling import format_summary, profiled, summary, trace_path
from framework.training.run import Run
from framework.training.watchdog import StallWatchdog
from framework.models.protocol import offered

log = logging.getLogger("framework")


def local_value(loss: torch.Tensor) -> torch.Tensor:
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()


def mean_over_dp(run: Run, values: torch.Tensor) -> List[float]:
    """Mean over DP replicas of each per-replica value (a 1-D tensor, changed in place): the
    global-batch values. Under pipeline parallelism only the last stage computed the losses:
    its values go to the pipeline first (when they are read, not every step)."""
    if run.stages:
        dist.broadcast(values, src=dist.get_global_rank(run.pp_group, run.pp["last"]), group=run.pp_group)
    if run.dp_cp["size"] > 1:
        dist.all_reduce(values, group=run.dp_cp_group)
        values /= run.dp_cp["size"]
    return values.cpu().tolist()


class PendingLosses:
    """The per-replica losses of the steps since the last logging or saving step, written in
    place into one buffer allocated before the loop. A tensor kept per step instead pins a small
    allocation above each step's freed temporaries, and glibc's heap cannot reuse the space under
    it: measured on 1x2 lm_small with log_every=300, each rank grew by about 2 MB a step (550 ->
    950 MB in 300 steps) and its steps slowed by the page faults (bench/README.md)."""

    def __init__(self, capacity: int, device: torch.device):
        self.buffer = torch.zeros(capacity, device=device)
        self.count = 0

    def append(self, loss: torch.Tensor) -> None:
        self.buffer[self.count] = local_value(loss)
        self.count += 1

    def take(self) -> torch.Tensor:
        """The pending losses (a view of the buffer, read before the next append); none left."""
        values, self.count = self.buffer[: self.count], 0
        return values


@contextmanager
def garbage_frozen() -> Iterator[None]:
    """Everything built before the loop (modules, parameters, configs, compiled graphs) out of the
    garbage collector's reach while it runs: the collections that DTensor's per-op garbage
    triggers no longer traverse all of it each time. Measured (bench/README.md): 1x2 compiled
    lm_small, median step 0.1992 -> 0.1925 s, faster in 5 of 5 alternating repeats."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Trainer:
    """Trains a run the builder built (framework.training.builder): train_step is one optimizer
    step; train() is the loop from the run's TrainState to trainer.max_steps."""

    def __init__(self, run: Run, make_stage: Optional[Callable] = None):
        """make_stage: how a pipeline stage is made (framework.parallel.pipeline.Pipeline)."""
        self.run, self.cfg, self.objective = run, run.cfg, run.objective
        self.device = torch.device(run.cfg.mesh.device_type)
        self.count_is_fixed = self.objective.count_is_fixed(run.dataset)
        plan = OmegaConf.to_container(self.cfg.plan, resolve=True) if self.cfg.plan else {}
        self.vocabulary_sharded = vocabulary_sharded(plan, run.tp.get("size", 1))
        self.step = StepShare()  # what this step's micro-batch losses are normalized by, and its terms
        self.pipeline = self._build_pipeline(make_stage) if run.stages else None

    def _build_pipeline(self, make_stage: Optional[Callable]) -> Pipeline:
        """This rank's stages under parallel.pp_schedule. Each micro-batch's loss is already its
        share of the step's (micro_batch_loss), so the schedule does not rescale the gradients."""
        run, p = self.run, self.cfg.parallel
        run.gradient_sync.sync_after_pipeline()
        n_stages = run.pp["size"] * p.pp_stages_per_rank
        self.microbatches = microbatches(p, n_stages)
        return Pipeline(run.stages, n_stages, run.pp_group, p.pp_schedule, self.microbatches, self.micro_batch_loss,
                        device=self.device, make_stage=make_stage)

    def _pipeline_where(self) -> str:
        """For the stall watchdog's report: which stages this rank runs, and what it waits for."""
        if self.pipeline is None:
            return ""
        stages = ", ".join(str(index) for index, _ in self.run.stages)
        return (f" in pipeline stage {stages} of {self.pipeline.n_stages} (a wait here is the schedule's send/recv of "
                f"activations or gradients with the neighbouring stages)")

    def pipeline_context(self):
        """What compute_loss enters around forward and loss (and forward_backward around
        backward), around the whole schedule instead, which runs both: bf16 autocast (replicate),
        loss_parallel (vocabulary-sharded logits)."""
        contexts = ExitStack()
        contexts.enter_context(self._autocast())
        contexts.enter_context(self._loss_parallel())
        return contexts

    def _loss_parallel(self):
        """torch's loss_parallel where the plan leaves the logits sharded on the vocabulary
        (framework.parallel.plan.vocabulary_sharded), around a forward's loss and its backward."""
        return loss_parallel() if self.vocabulary_sharded else nullcontext()

    def _pipeline_forward_backward(self, batch: Batch) -> torch.Tensor:
        """The schedule's micro-batches (parallel.pp_microbatches) through the stages, then the
        replicate strategy's gradient sync, once. Returns what forward_backward does."""
        run = self.run
        with self.pipeline_context():
            total = self.pipeline.step(batch)
        run.gradient_sync.sync_gradients()
        return total

    # -- one step -----------------------------------------------------------------------

    def micro_batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss: the objective's sum over the step's units,
        its auxiliary terms over the step's tokens (the pipeline's last stage calls this too).
        The terms add up in the step's (StepShare)."""
        return self.objective(outputs, targets, self.run.module, self.step)

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        """Forward and micro_batch_loss, under autocast with trainer.mixed_precision=bf16 (fp32
        master weights: autocast casts per op, and its fp32 ops, the loss among them, stay fp32);
        logits the plan leaves sharded on the vocabulary (output_layouts shard(-1),
        use_local_output false) get torch's loss_parallel instead of a gather."""
        with self._autocast(), self._loss_parallel():
            return self.micro_batch_loss(self.objective.forward(self.run.model, batch), batch.targets)

    def _autocast(self):
        """bf16 autocast with trainer.mixed_precision=bf16 under replicate; fsdp / hsdp: FSDP2's
        MixedPrecisionPolicy casts instead (framework.parallel.fully_shard)."""
        cfg = self.cfg
        bf16 = cfg.trainer.mixed_precision == "bf16" and cfg.parallel.dp_strategy == "replicate"
        return torch.autocast(cfg.mesh.device_type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Zero the gradients, then forward, loss and backward (gradients come out final), per
        micro-batch (data.micro_batch_size; under PP the schedule's): each loss is its share of
        the step's (micro_batch_loss), so the gradients add up to the global batch's, and the DP
        strategy finalizes them (TP partials, DP average) once, after the last. Returns the
        replica's share of the global-batch loss, whose mean over DP is the global-batch loss."""
        self.run.optimizer.zero_grad(set_to_none=True)
        with self._autocast():  # (GRPO generates the completions it learns from; other objectives: the batch)
            batch = self.objective.rollout(self.run.module, batch, self.run.state.step if self.run.state else 0)
        self.step = StepShare(self.units_per_replica(batch.targets), float(batch.inputs.numel()))
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batch)
        chunks = batch.split(self.cfg.data.micro_batch_size or len(batch.inputs))
        for i, micro_batch in enumerate(chunks):
            loss = self.compute_loss(micro_batch)
            self.step.loss = loss.detach() if self.step.loss is None else self.step.loss + loss.detach()
            # micro-batches before the last add up their gradients without syncing them over DP
            with nullcontext() if i == len(chunks) - 1 else self.run.gradient_sync.no_sync():
                with self._loss_parallel():
                    loss.backward()
        return self.step.loss

    def units_per_replica(self, targets: torch.Tensor) -> float:
        """The global batch's count of units over the DP size: a micro-batch's loss sum over
        this, summed over micro-batches and averaged over DP, is the global sum over the global
        count, however the units fall on replicas and micro-batches. Where every unit counts it
        is this replica's own count, with no communication; else one all-reduce over DP."""
        if self.count_is_fixed:
            return float(self.objective.fixed_count(targets))
        count = self.objective.count(targets).double()
        if self.run.dp_cp["size"] > 1:
            dist.all_reduce(count, group=self.run.dp_cp_group)
        if count.is_meta:  # the dry run (its collective recorder counted the all-reduce): no values
            return float(targets.numel())
        return max(1.0, count.item()) / self.run.dp_cp["size"]

    def train_step(self, batch: Batch, measure_norm: bool,
                   on_gradients: Callable[[], None] = lambda: None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One optimizer step: forward_backward, `on_gradients` (verify reads them before
        clipping spreads one wrong gradient over all), trainer.grad_clip's clipping (or, when
        `measure_norm`, the global gradient norm alone), the optimizer and the LR schedule.
        Returns the replica batch's loss and the norm (None when neither was asked for)."""
        run = self.run
        loss = self.forward_backward(batch)
        on_gradients()
        clip = self.cfg.trainer.grad_clip
        if clip is not None:
            norm = clip_grad_norm(run.model.parameters(), clip, run.pp_group)
        else:
            norm = global_grad_norm(run.model.parameters(), run.pp_group) if measure_norm else None
        if run.fault_tolerance.should_commit():  # (torchft: every live replica group finished the step)
            run.optimizer.step()
            run.scheduler.step()
        return loss, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """The held-out loss over trainer.eval_batches global batches: the objective's sum over
        all their units over the count of them (the same normalization as a step's)."""
        run = self.run
        run.model.eval()
        data = iter(run.val_dataloader)
        sums, counts = [], []
        step, self.step = self.step, StepShare(tokens=None)  # plain sums (divided by the count below), no terms
        for _ in range(min(self.cfg.trainer.eval_batches, len(run.val_dataloader))):
            batch = Batch.of(next(data), self.device)
            if self.pipeline is not None:  # forward only through the stages
                with self.pipeline_context():
                    sums.append(self.pipeline.evaluate(batch))
            else:
                sums.append(local_value(self.compute_loss(batch)))
            counts.append(self.objective.count(batch.targets).float())
        run.model.train()
        self.step = step  # (the training step's terms, still to be logged)
        # batches' losses and counts summed here, then averaged over DP (and torchft's replica groups,
        # each of which evaluated its own share): their ratio is the global one
        sum_and_count = run.fault_tolerance.mean(torch.stack([torch.stack(sums).sum(), torch.stack(counts).sum()]))
        total, count = mean_over_dp(run, sum_and_count)
        return total / max(count, 1.0)

    # -- the loop -----------------------------------------------------------------------

    def train(self) -> Optional[dict]:
        """Steps from the one after the TrainState's (step 1, or the one after a resumed
        checkpoint) to trainer.max_steps, saving where checkpoint.every says; the history
        (losses, grad norms, validation losses, step times, saves) continues the checkpoint's.
        A resumed checkpoint at or past max_steps leaves nothing to do: None, and no summary."""
        run, trainer, state = self.run, self.cfg.trainer, self.run.state
        if state.step >= trainer.max_steps:
            if run.rank == 0:
                log.info("nothing to train: resumed at step %d and trainer.max_steps=%d", state.step, trainer.max_steps)
            return None
        data = batches(run.sampler, run.dataloader, state.position, self.cfg.data.global_batch_size)
        self.metrics = Metrics(run, state.step + 1, state.history["step_times_s"])
        self.watchdog = StallWatchdog(trainer.stall_timeout_s, run.rank, run.out_dir)
        # not yet averaged over DP: at most log_every (a logging step flushes them), nor more than the steps left
        self.pending = PendingLosses(min(trainer.log_every, trainer.max_steps - state.step), self.device)
        run.model.train()
        faults = run.fault_tolerance
        faults.begin(self)  # (torchft: what a restarted replica group receives)
        stopped, redo = None, None
        with garbage_frozen(), profiled(run.out_dir, run.rank, trainer.profile_steps) as profiler, \
                Interrupt(run.rank, faults.stopping_signals) as interrupt:
            while state.step < trainer.max_steps:
                self.watchdog.stage(f"step {state.step + 1}: replica groups' quorum")
                if faults.before_step():  # a restarted replica group took a live one's state: go on from there
                    data = batches(run.sampler, run.dataloader, state.position, self.cfg.data.global_batch_size)
                    redo = None
                step = state.step = state.step + 1
                logging_step = step % trainer.log_every == 0 or step == trainer.max_steps
                self.watchdog.stage(f"step {step}: data, forward and backward{self._pipeline_where()}")
                batch = redo if redo is not None else self.metrics.taken(Batch.of(next(data), self.device))
                lr = run.optimizer.param_groups[0]["lr"]
                loss, grad_norm = self.train_step(batch, logging_step, on_gradients=lambda: self.watchdog.stage(
                    f"step {step}: gradient norm, optimizer step"))
                loss = faults.after_step(loss)
                if loss is None:  # a replica group failed in it: the live groups run it
                    state.step, redo = step - 1, batch  # again, on the same batch
                    continue
                redo = None
                self.pending.append(loss)
                stopped = interrupt.agreed()
                self._after_step(step, logging_step, grad_norm, stopping=stopped is not None)
                if logging_step:
                    self.metrics.log_step(step, state.history["losses"][-1], lr, state.history["grad_norms"][-1])
                if profiler:
                    profiler.step()
                if stopped:
                    break
        self._log_profile(profiler)
        self._finish(stopped)
        return self.metrics.summary(state.history, stopped)

    def _log_profile(self, profiler) -> None:
        """trainer.profile_steps' summary, in each rank's own log (rank 0's is also the console)."""
        if profiler:
            run = self.run
            log.info("profile of steps 2-%d:\n%s", self.cfg.trainer.profile_steps + 1,
                     "\n".join(format_summary(run.rank, summary(profiler), trace_path(run.out_dir, run.rank))))

    def _finish(self, stopped: Optional[str]) -> None:
        """After the last step: the last async save finished, then checkpoint.final_hf's model
        (the model at the end, not where a signal stopped it)."""
        run = self.run
        self.watchdog.stage("waiting for the last checkpoint save")
        run.checkpointer.close()
        if self.cfg.checkpoint.final_hf and not stopped:
            self.watchdog.stage("writing the Hugging Face model")
            save_hf_sharded(run.module, os.path.join(run.out_dir, "hf"), run.rank)
            if run.rank == 0:
                log.info("the final model as a Hugging Face directory (checkpoint.final_hf): %s",
                         os.path.join(run.out_dir, "hf"))
        self.watchdog.close()  # (a rank that raises exits, and its watchdog thread with it)

    def _after_step(self, step: int, logging_step: bool, grad_norm: Optional[torch.Tensor],
                    stopping: bool = False) -> None:
        """What follows a step, each when due: the replica check, evaluation, the losses'
        all-reduce into the history, the checkpoint save (or publishing a finished async one).
        The step a signal stops the run at (`stopping`) takes its losses and, when checkpoints
        are on, a save."""
        run, trainer, history = self.run, self.cfg.trainer, self.run.state.history
        # replicate only: fsdp holds one shard per DP rank; hsdp's replicas of a shard are not compared yet
        if trainer.check_replicas_every and self.cfg.parallel.dp_strategy == "replicate" \
                and step % trainer.check_replicas_every == 0:
            self.watchdog.stage(f"step {step}: replica check")
            check_replicas(run.module, run.dp_cp_group, step, run.stage_group)
            run.fault_tolerance.check(run.module, step)  # (torchft: across the replica groups too)
        if trainer.eval_every and step % trainer.eval_every == 0:
            self.watchdog.stage(f"step {step}: evaluation")
            self.metrics.exclude(self._evaluate_and_log(step))
        self.metrics.step_done(step)
        saving = run.checkpointer.due(step) or (stopping and bool(run.checkpointer.every))
        if logging_step or saving or stopping:  # a checkpoint holds every loss up to its step
            self.watchdog.stage(f"step {step}: loss all-reduce")
            history["losses"] += mean_over_dp(run, self.pending.take())
        if logging_step:
            history["grad_norms"].append(float(grad_norm))
            self._log_terms(step)
            values = offered(run.module).logged_metrics()
            self.metrics.scalars(step, gathered_over_stages(values, run.pp_group) if run.pp else values)
        self.watchdog.finished()  # the step, and its evaluation
        if saving:
            self.watchdog.stage(f"step {step}: checkpoint save")
            self.metrics.saved(step, run.checkpointer.save(step))  # it records the save
            self.watchdog.finished()
        else:
            run.checkpointer.poll()

    def _log_terms(self, step: int) -> None:
        """The step's terms the objective shows (auxiliary losses, DPO's rewards) as global-batch
        values, like its loss, its text (GRPO's sample completions: rank 0's), and a mixture's learned tokens per source since the last logging
        step, to TensorBoard: one all-reduce, on logging steps."""
        for tag, text in self.objective.logged_text().items():
            self.metrics.loggers.log_text(tag, text, step)
        tags = self.objective.logged_terms(self.run.module)
        terms = [local_value(torch.as_tensor(self.step.terms.get(name, 0.0), device=self.device)) for name in tags]
        tokens = self.metrics.take_source_tokens()
        if terms or len(tokens):
            values = mean_over_dp(self.run, torch.cat([torch.stack(terms) if terms else tokens[:0], tokens]))
            self.metrics.scalars(step, dict(zip(tags.values(), values)))
            self.metrics.headline = {name: value for name, value in zip(tags, values)
                                     if name in self.objective.headline}
            self.metrics.source_shares(step, values[len(terms):])

    def _evaluate_and_log(self, step: int) -> float:
        """The validation loss at `step`, into the history and TensorBoard; returns its seconds."""
        start = time.perf_counter()
        history = self.run.state.history
        history["val_losses"].append([step, self.evaluate()])
        self.metrics.scalars(step, {"val_loss": history["val_losses"][-1][1]})
        return time.perf_counter() - start
