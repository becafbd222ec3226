"""Functions the multi-process tests run inside each rank (importable by spawned processes)."""
import json
import os
import signal
import threading
import time
from typing import Optional
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from framework.data.batch import Batch
from framework.training.builder import build_and_run
from framework.models import SeedMLP, Transformer
from framework.models.transformer import Attention, rotary, rotary_frequencies, rotation


class FailOnRank(SeedMLP):
    """The seed model, except that building it raises on one rank: tests failure handling."""

    def __init__(self, fail_rank: int = 1, **sizes):
        if os.environ.get("RANK") == str(fail_rank):
            raise RuntimeError(f"boom on rank {fail_rank}")
        super().__init__(**sizes)


class ReportThreads(SeedMLP):
    """The seed model, which writes the rank's torch thread count to `<out>/threads.rank<N>` and
    the cores it may run on to `<out>/cores.rank<N>`."""

    def __init__(self, out: str, **sizes):
        super().__init__(**sizes)
        if "RANK" in os.environ:  # not the launcher's check on meta
            Path(out, f"threads.rank{os.environ['RANK']}").write_text(str(torch.get_num_threads()))
            Path(out, f"cores.rank{os.environ['RANK']}").write_text(json.dumps(sorted(os.sched_getaffinity(0))))


class MarkTraining(SeedMLP):
    """The seed model, which creates `<out>/training` in rank 0's forward number `at`: a test
    waits for it to signal a run that is training."""

    def __init__(self, out: str, at: int = 5, **sizes):
        super().__init__(**sizes)
        self.marker, self.at, self.calls = Path(out, "training"), at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and os.environ.get("RANK") == "0":
            self.marker.touch()
        return super().forward(x)


class SlowToBuild(SeedMLP):
    """The seed model, whose ranks create `<out>/building` and then take minutes to build: a test
    signals a run before it trains."""

    def __init__(self, out: str, **sizes):
        super().__init__(**sizes)
        if "RANK" in os.environ:  # not the launcher's check on meta
            Path(out, "building").touch()
            time.sleep(600)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def train_and_report(cfg_container: dict, out_dir: str) -> dict:
    """Run the whole pipeline, then report what the tests compare across ranks."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir)
    module = run.module
    report = {
        "rank": dist.get_rank(),
        "dp_rank": run.dp_cp["rank"],
        "tp_rank": run.tp["rank"],
        "params": {name: local_tensor(p) for name, p in module.named_parameters()},
        "param_numel": sum(p.numel() for p in run.model.parameters()),
        "state_dict_keys": sorted(run.model.state_dict()),
        "optimizer_params": sum(len(g["params"]) for g in run.optimizer.param_groups),
        "epoch0_indices": list(iter(run.sampler)),
        "first_batch_inputs": next(iter(run.dataloader))[0],  # what step 1 trained on
        "summary": run.summary,
    }
    dist.destroy_process_group()
    return report


def seed_literal_ddp_then_tp(steps: int) -> dict:
    """The seed's order with torch's own DDP, for comparison: each DP replica gets other data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = DistributedDataParallel(SeedMLP(), process_group=mesh["dp"].get_group())
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel(), "net3": ColwiseParallel(output_layouts=Replicate())}
    model.module = parallelize_module(model.module, mesh["tp"], plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=data), torch.randn(8, 12, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    report = {"params": {name: local_tensor(p) for name, p in model.module.named_parameters()}}
    dist.destroy_process_group()
    return report


class WithUnusedLayer(SeedMLP):
    """The seed model plus a layer forward never uses (a frozen branch, an unused head)."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.unused = nn.Linear(4, 4)


def _first_attempt_on(rank: int) -> bool:
    return os.environ.get("RANK") == str(rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class KillAtForward(SeedMLP):
    """The seed model, except that on the first attempt rank `rank` dies by SIGKILL (no cleanup,
    no error report) in its forward number `at`: what an elastic restart must recover from."""

    def __init__(self, rank: int = 1, at: int = 13, **sizes):
        super().__init__(**sizes)
        self.kill_rank, self.at, self.calls = rank, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and _first_attempt_on(self.kill_rank):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


class TransformerKilledInReplicaGroup(Transformer):
    """The LM, except that on the first attempt of replica group `group` (launcher.fault_tolerance)
    its rank 0 dies by SIGKILL in its forward number `at` (during that step); each forward takes
    at least `step_s`. Restarted, the group is built only once the `marker` file exists, which a
    surviving group writes as it starts step `at` + 1: it committed step `at` alone, whatever
    the machine's speed."""

    def __init__(self, group: int = 1, at: int = 10, step_s: float = 0.0, marker: str = "", **sizes):
        super().__init__(**sizes)
        self.kill_group, self.at, self.calls, self.step_s, self.marker = group, at, 0, step_s, marker
        self.mine = os.environ.get("FRAMEWORK_REPLICA_GROUP", "").startswith(f"{group}/")
        if self.mine and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)

    def forward(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.step_s)  # (steps long enough for the killed group to come back before the end)
        if self.calls == self.at and self.mine and _first_attempt_on(0):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.calls == self.at + 2 and not self.mine:  # forward at + 1 was step `at` again, committed alone
            Path(self.marker).touch()
        return super().forward(*args, **kwargs)


class TransformerDivergingInReplicaGroup(Transformer):
    """The LM, except that replica group `group` nudges its first weight in its forward number
    `at`: a rank-dependent update the replica check must catch."""

    def __init__(self, group: int = 1, at: int = 3, **sizes):
        super().__init__(**sizes)
        self.nudge_group, self.at, self.calls = group, at, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at and os.environ.get("FRAMEWORK_REPLICA_GROUP", "").startswith(f"{self.nudge_group}/"):
            with torch.no_grad():
                next(self.parameters()).add_(1e-3)
        return super().forward(*args, **kwargs)


class KillInSave(SeedMLP):
    """The seed model, except that on the first attempt rank `rank` dies by SIGKILL while its
    state is gathered for save number `at` (the other ranks are already saving)."""

    def __init__(self, rank: int = 0, at: int = 2, **sizes):
        super().__init__(**sizes)
        self.kill_rank, self.at, self.saves = rank, at, 0
        self._register_state_dict_hook(self._count_save)

    def _count_save(self, module, state_dict, prefix, local_metadata):
        self.saves += 1
        if self.saves == self.at and _first_attempt_on(self.kill_rank):
            os.kill(os.getpid(), signal.SIGKILL)


def output_after_loading(cfg_container: dict, out_dir: str, inputs: torch.Tensor) -> torch.Tensor:
    """Build the run up to its checkpoint stage (which loads checkpoint.resume or init_from),
    then the sharded model's output on `inputs`."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="checkpoint")
    with torch.no_grad():
        output = run.model(inputs)
    dist.destroy_process_group()
    return output.full_tensor() if isinstance(output, DTensor) else output


class GlobalHeadsAttention(Attention):
    """The classic TP bug: q/k/v reshaped with the model's global head count. On one process it
    is the same model; under TP each rank holds n_heads / TP heads' channels, so it splits them
    into n_heads heads of the wrong size, and trains a different model without any error."""

    def forward(self, x: torch.Tensor, cache=None, layout=None) -> torch.Tensor:  # byte data: no layout
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(batch, seq, self.n_heads, -1) for w in (self.wq, self.wk, self.wv))
        freqs = rotary_frequencies(q.shape[-1], 10000.0)  # for the (wrong) head size it reshaped to
        q, k = (rotary(t, *rotation(freqs, 0, seq)) for t in (q, k))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class GlobalHeadsTransformer(Transformer):
    """The tiny LM with GlobalHeadsAttention in every block (same weights as Transformer's)."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        for layer in self.layers:
            layer.attention.__class__ = GlobalHeadsAttention
            layer.attention.n_heads = self.n_heads


class WindowRotaryAttention(Attention):
    """A context-parallel bug: keys and values gathered and masked, but queries and keys rotated by
    their places in this rank's chunks, not in the sequence. One process (one chunk, no layout)
    computes the same model."""

    def forward(self, x: torch.Tensor, cache=None, layout=None) -> torch.Tensor:
        if layout is not None:
            cos, sin = self.rope.cos_sin(self.head_dim, 0, x.shape[1], x.device)
            layout = layout._replace(cos=cos, sin=sin)
        return super().forward(x, cache=cache, layout=layout)


class WindowRotaryTransformer(Transformer):
    """The tiny LM with WindowRotaryAttention in every block."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        for layer in self.layers:
            layer.attention.__class__ = WindowRotaryAttention


class ScaledSeedMLP(SeedMLP):
    """The seed model times a learned scalar of its own: a custom parameter no plan entry
    covers, replicated on every TP rank, whose gradient is whole on each (the output it scales
    is replicated), so it is correct under TP and DP."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.scale * super().forward(x)


class DriftOnRank(ScaledSeedMLP):
    """ScaledSeedMLP whose plain `scale` is nudged on one rank in forward number `at`: replicas
    that silently stop being replicas, for the replica check to catch."""

    def __init__(self, rank: int = 1, at: int = 3, **sizes):
        super().__init__(**sizes)
        self.drift_rank, self.at, self.calls = rank, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and os.environ.get("RANK") == str(self.drift_rank):
            with torch.no_grad():
                self.scale.add_(1e-3)
        return super().forward(x)


class BlockOnRank(SeedMLP):
    """The seed model, except that rank `rank` blocks forever in its forward number `at`
    (outside any collective): the other ranks then wait in the step's collectives."""

    def __init__(self, rank: int = 1, at: int = 3, **sizes):
        super().__init__(**sizes)
        self.block_rank, self.at, self.calls = rank, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and os.environ["RANK"] == str(self.block_rank):
            threading.Event().wait()
        return super().forward(x)


class BlockingTransformer(Transformer):
    """The LM, except that rank `rank` blocks forever when its final norm (or the module named
    `where`) runs for the `at`-th time (outside any collective and any compiled block; on the last
    pipeline stage under PP)."""

    def __init__(self, rank: int = 1, at: int = 3, where: str = "norm", **sizes):
        super().__init__(**sizes)
        self.block_rank, self.at, self.calls = rank, at, 0
        self.get_submodule(where).register_forward_pre_hook(self.block_at)

    def block_at(self, module, args):
        self.calls += 1
        if self.calls == self.at and os.environ["RANK"] == str(self.block_rank):
            threading.Event().wait()


class LogitSquareTransformer(Transformer):
    """The LM reporting an auxiliary term, as a mixture of experts reports its load-balancing
    loss: each token's mean squared logit, summed over the micro-batch's tokens."""

    auxiliary_losses: dict = {}

    def forward(self, tokens):
        logits = super().forward(tokens)
        self.auxiliary_losses = {"logit_square": logits.float().pow(2).mean(-1).sum()}
        return logits


class ThreeLayers(nn.Module):
    """a feeds b on every rank; c only on rank 0; d on no rank. Registered d, c, a, b so that
    DataParallel's buckets (reverse order) take b's and a's gradients first, then c's, then d's."""

    def __init__(self):
        super().__init__()
        self.d, self.c, self.a, self.b = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return h + self.c(h) if dist.get_rank() == 0 else h


def data_parallel_gradients(overlap: bool) -> dict:
    """Two ranks, other inputs each, DataParallel with buckets of about one parameter (the first
    of 200 bytes, the rest 400), two steps, the second in two micro-batches (the first under
    no_sync): each rank's own gradients per step (one process, its data), the synced ones, and
    how many buckets each sync had started during backward."""
    from framework.parallel import data_parallel
    from framework.parallel.data_parallel import DataParallel

    data_parallel.FIRST_BUCKET_BYTES, data_parallel.BUCKET_BYTES = 200, 400
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ThreeLayers()
    data = torch.Generator().manual_seed(dist.get_rank())
    x1, x2 = torch.randn(4, 8, generator=data), torch.randn(4, 8, generator=data)

    def gradients() -> dict:
        grads = {name: p.grad.clone() if p.grad is not None else None for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    model(x1).square().sum().backward()
    own = [gradients()]
    (model(x1).square().sum() + model(x2).square().sum()).backward()
    own.append(gradients())
    wrapped = DataParallel(model, init_device_mesh("cpu", (2,)), overlap=overlap)
    started_in_backward = []
    finish = wrapped._finish_all_reduces
    wrapped._finish_all_reduces = lambda: (started_in_backward.append(wrapped._launched), finish())[1]
    wrapped(x1).square().sum().backward()
    synced = [gradients()]
    with wrapped.no_sync():
        wrapped(x1).square().sum().backward()
    wrapped(x2).square().sum().backward()
    synced.append(gradients())
    buckets = [[name for p in bucket.params for name, q in model.named_parameters() if q is p]
               for bucket in wrapped._buckets]
    dist.destroy_process_group()
    return {"own": own, "synced": synced, "buckets": buckets, "started_in_backward": started_in_backward}


def one_step_gradients(cfg_container: dict, out_dir: str, logits_of: Optional[torch.Tensor] = None) -> dict:
    """One forward and backward of the first global batch (the Trainer's): the global loss, the
    full gradients and the batch's count of response tokens; on one process also the mean of
    the two interleaved halves' own means (what averaging two DP replicas' means would give).
    With `logits_of`, first the model's full logits on those tokens."""
    from framework.data.batch import IGNORE
    from framework.training.trainer import Trainer, local_value, mean_over_dp

    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="optimizer")
    trainer = Trainer(run)
    logits = None
    if logits_of is not None:
        with torch.no_grad():
            logits = run.model(logits_of)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    batch = Batch.of(next(iter(run.dataloader)), "cpu")
    inputs, targets = batch.inputs, batch.targets
    loss = trainer.forward_backward(batch)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in run.module.named_parameters() if p.grad is not None}  # (frozen: none)
    result = {"loss": mean_over_dp(run, local_value(loss).reshape(1))[0], "grads": grads,
              "response_tokens": int((targets != IGNORE).sum()), "logits": logits}
    if run.dp_cp["size"] == 1:
        halves = []
        with torch.no_grad():  # each half's own mean: its loss sum over its own count
            for r in (0, 1):
                trainer.denominator, trainer.tokens = float(trainer.objective.count(targets[r::2])), None
                halves.append(float(trainer.compute_loss(Batch(inputs[r::2], targets[r::2]))))
        result["mean_of_halves"] = sum(halves) / 2
    dist.destroy_process_group()
    return result


def compiled_blocks_and_names(cfg_container: dict, out_dir: str) -> dict:
    """Built through fully_shard (the compile stage, where trainer.compile applies, is before it):
    whether each block's forward is a torch.compile'd function, and the model's state_dict keys."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="fully_shard")
    result = {"compiled": [hasattr(block.forward, "_torchdynamo_orig_callable") for block in run.module.layers],
              "names": sorted(run.module.state_dict())}
    dist.destroy_process_group()
    return result


def expert_shapes(cfg_container: dict, out_dir: str, through: str = "expert_parallel") -> dict:
    """Built through `through`: the local shape of each stacked expert weight."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through=through)
    shapes = {name: list(local_tensor(p).shape) for name, p in run.module.named_parameters() if ".experts." in name}
    dist.destroy_process_group()
    return shapes


def expert_biases(cfg_container: dict, out_dir: str) -> dict:
    """Train the whole pipeline; each MoE block's expert bias after it, and the losses."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir)
    biases = {name: buffer.clone() for name, buffer in run.module.named_buffers() if name.endswith("expert_bias")}
    dist.destroy_process_group()
    return {"biases": biases, "losses": run.summary["losses"]}


def starting_weights(cfg_container: dict, out_dir: str) -> dict:
    """Built through the weights stage: the whole value of each parameter this rank holds (a
    pipeline stage: its own) and the buffers, by name."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="weights")
    weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for name, p in run.module.named_parameters()}
    weights.update({name: b.clone() for name, b in run.module.named_buffers()})
    dist.destroy_process_group()
    return weights


def build_peak_bytes(cfg_container: dict, out_dir: str) -> dict:
    """The rank's peak resident memory over building the run through its weights (the kernel's
    VmHWM, reset first), its own parameters' bytes, and the whole model's."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    with open("/proc/self/clear_refs", "w") as f:  # (5: the peak resident set size starts again)
        f.write("5")
    before = status("VmRSS")
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="weights")
    peak = status("VmHWM") - before
    held = sum(t.numel() * t.element_size() for t in (p.to_local() if isinstance(p, DTensor) else p
                                                       for p in run.module.parameters()))
    whole = sum(p.numel() * p.element_size() for p in run.module.parameters())
    dist.destroy_process_group()
    return {"peak": peak, "held": held, "whole": whole}
