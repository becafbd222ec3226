"""The same training as `framework.train recipe=lm_2d` (bench settings), written by hand with
plain PyTorch: init_process_group, DeviceMesh, parallelize_module, DP, a plain loop. No Hydra,
no framework machinery: only the model and dataset classes are shared, so both sides train the
same thing. DP (--dp) is one of:
  after-backward  gradients averaged over DP after backward, one flat all-reduce (the default)
  ddp             torch's DistributedDataParallel (pure DP only: DDP cannot take TP's DTensors)
  replicate       torch's replicate_with_fsdp (torchtitan's DDP since 2026-03): per block and root

    torchrun --standalone --nproc-per-node 4 bench/handwritten.py --mesh 2 2 --steps 30 --out result.json

--compile compiles each block's forward (fullgraph) after TP, as trainer.compile=blocks does.
--bind-cores binds each rank to its share of the cores, as launcher.bind_cores does (by default
for compiled runs on CPU); without it the ranks float, as a torchrun script's do unless it binds them itself.
"""
import argparse
import faulthandler
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from framework.data.corpus import ByteCorpus
from framework.models.transformer import Transformer


def tp_sp_plan(n_layers: int) -> dict:
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(n_layers):
        plan.update({
            f"layers.{i}.attention_norm": SequenceParallel(),
            f"layers.{i}.attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"layers.{i}.attention.wq": ColwiseParallel(),
            f"layers.{i}.attention.wk": ColwiseParallel(),
            f"layers.{i}.attention.wv": ColwiseParallel(),
            f"layers.{i}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.ffn_norm": SequenceParallel(),
            f"layers.{i}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"layers.{i}.feed_forward.w1": ColwiseParallel(),
            f"layers.{i}.feed_forward.w3": ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def wait_for_inputs(module: torch.nn.Module, args: tuple) -> tuple:
    """torch 2.13: a compiled block's backward mishandles an input whose TP collective is still
    in flight (the embedding's async redistribute); a copy waits for it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tuple(a.clone() if isinstance(getattr(a, "_local_tensor", a), AsyncCollectiveTensor) else a for a in args)


def average_gradients(model: torch.nn.Module, tp_group, dp_group, dp_size: int) -> None:
    """Sum the partial gradients of the sequence-parallel norm weights over TP, then average
    every gradient over DP: one flat all-reduce each."""
    params = [p for p in model.parameters() if p.requires_grad]
    partial = [p for p in params if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()]
    if partial:
        flat = torch._utils._flatten_dense_tensors([p.grad.to_local() for p in partial])
        dist.all_reduce(flat, group=tp_group)
        for p, g in zip(partial, torch._utils._unflatten_dense_tensors(flat, [p.grad.to_local() for p in partial])):
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
    if dp_size > 1:
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat /= dp_size
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def train_step(model, optimizer, loss_fn, batch, mesh, average: bool) -> torch.Tensor:
    """One optimizer step; `average`: the gradients averaged after backward (average_gradients)."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    if average:
        average_gradients(model, mesh["tp"].get_group(), mesh["dp"].get_group(), mesh["dp"].size())
    optimizer.step()
    return loss


def fused_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """One fused kernel, as the framework's default, a param group per kind of parameter (plain,
    or one mesh's DTensors): DTensor's fused kernel takes one kind a call."""
    kinds: dict = {}
    for param in model.parameters():
        kinds.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return torch.optim.AdamW([{"params": k} for k in kinds.values()], lr=0.003, weight_decay=0.1, betas=(0.9, 0.95),
                             fused=True)


def batches_for(mesh, global_batch: int, seq_len: int):
    """This DP replica's batches: DistributedSampler over the DP dim, its share of the global batch."""
    dataset = ByteCorpus(seq_len=seq_len)
    dp_size = mesh["dp"].size()
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=mesh.get_local_rank("dp"), seed=0, drop_last=True)
    return iter(StatefulDataLoader(dataset, batch_size=global_batch // dp_size, sampler=sampler, drop_last=True))


def build_model(mesh, compile_blocks: bool) -> Transformer:
    """conf/model/lm_small.yaml, TP-sharded over mesh["tp"] with the plan above, blocks compiled."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=256, dim=128, n_layers=4, n_heads=8, hidden_dim=352)
    if mesh["tp"].size() > 1:
        model = parallelize_module(model, mesh["tp"], tp_sp_plan(4))
    if compile_blocks:
        for block in model.layers:
            block.register_forward_pre_hook(wait_for_inputs)
            block.forward = torch.compile(block.forward, fullgraph=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", type=int, nargs=2, default=[2, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", choices=["after-backward", "ddp", "replicate"], default="after-backward")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block's forward")
    parser.add_argument("--bind-cores", action="store_true", help="each rank on its own share of the cores")
    args = parser.parse_args()
    if args.bind_cores:
        cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
        local = int(os.environ["LOCAL_RANK"])
        os.sched_setaffinity(0, {cores[(local * threads + i) % len(cores)] for i in range(threads)})
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # bench/stress_hangs.py asks hung ranks for stacks

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", tuple(args.mesh), mesh_dim_names=("dp", "tp"))
    dp_size = args.mesh[0]
    model = build_model(mesh, args.compile)
    if args.dp == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    elif args.dp == "replicate":
        for block in model.layers:
            replicate(block, mesh=mesh["dp"])
        replicate(model, mesh=mesh["dp"])
    optimizer = fused_adamw(model)
    loss_fn = next_token_loss

    step_times, first_step_unix = [], None
    batches = batches_for(mesh, args.global_batch, args.seq_len)
    step_start = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step(model, optimizer, loss_fn, next(batches), mesh, args.dp == "after-backward")
        now = time.perf_counter()
        step_times.append(now - step_start)
        step_start = now
        first_step_unix = first_step_unix or time.time()
    final_loss = loss.detach().clone()  # per replica; the global-batch loss is their DP mean
    dist.all_reduce(final_loss, group=mesh["dp"].get_group())
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times_s": step_times, "first_step_done_unix": first_step_unix,
                       "final_loss": final_loss.item() / dp_size}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    # The framework's default: this host's cores shared out among its ranks (torchrun's own
    # OMP_NUM_THREADS=1 is its default, not a choice), so one-process runs use every core.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    main()
