"""The framework's training loop against the hand-written one in the same processes: each rank
builds both (the framework's run through its builder, bench/handwritten.py's model, optimizer
and data), then alternates blocks of steps of each, the order reversed every other round. What
differs between two processes (their imports, heaps, launch) cannot show up here, so a gap
between separate runs (bench/run.py) that this does not show lies outside the loop and model.

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/same_process.py --mesh 1x2 --compile
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from omegaconf import open_dict

from framework.cli import compose_config
from framework.training.builder import build_and_run
from framework.training.trainer import Trainer

from handwritten import batches_for, build_model, fused_adamw, next_token_loss, train_step
from run import FRAMEWORK_SETTINGS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="1x2")
    parser.add_argument("--compile", action="store_true", help="both sides compile each block")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="per block; the first of each is left out")
    args = parser.parse_args()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["LOCAL_WORLD_SIZE"])))
    with tempfile.TemporaryDirectory(prefix="framework-same-process-") as out_dir:
        os.makedirs(os.path.join(out_dir, "logs"))
        compare(args, out_dir)
    dist.destroy_process_group()


def compare(args: argparse.Namespace, out_dir: str) -> None:
    cfg = compose_config([*FRAMEWORK_SETTINGS, f"mesh={args.mesh}", f"trainer.log_every={args.steps}",
                          f"trainer.compile={'blocks' if args.compile else 'none'}"])
    run = build_and_run(cfg, out_dir, through="objective")

    def framework_steps(n: int) -> list:
        with open_dict(cfg):
            cfg.trainer.max_steps = run.state.step + n
        return Trainer(run).train()["step_times_s"][-n:]

    model = build_model(run.mesh, args.compile)
    optimizer = fused_adamw(model)
    loss_fn, batches = next_token_loss, batches_for(run.mesh, cfg.data.global_batch_size, cfg.data.dataset.seq_len)

    def handwritten_steps(n: int) -> list:
        times, start = [], time.perf_counter()
        for _ in range(n):
            train_step(model, optimizer, loss_fn, next(batches), run.mesh, average=True)
            now = time.perf_counter()
            times.append(now - start)
            start = now
        return times

    sides = {"framework": framework_steps, "hand-written": handwritten_steps}
    times = {side: [] for side in sides}
    for side in sides.values():  # compile and warm up both
        side(3)
    for i in range(args.rounds):
        for side in list(sides)[::-1 if i % 2 else 1]:
            dist.barrier()
            times[side] += sides[side](args.steps)[1:]
    if dist.get_rank() == 0:
        medians = {side: statistics.median(t) for side, t in times.items()}
        print(f"mesh {args.mesh}{', compiled' if args.compile else ''}, {args.rounds} rounds x {args.steps} steps, "
              f"median step: framework {medians['framework']:.4f} s, hand-written {medians['hand-written']:.4f} s, "
              f"ratio {medians['framework'] / medians['hand-written']:.3f}")


if __name__ == "__main__":
    main()
