"""Long context on this machine: lm_small at a long sequence on one process and over 2 and 4
context-parallel ranks (tokens/s, each rank's peak RSS, the dry run's activation bytes), document
masking's cost against plain causal attention, and the K/V all-gather bytes per step against the
analytic count.

    .venv/bin/python bench/long_context.py [--seq-len 4096] [--steps 6]

The data: this Python's standard library sources prepared once as byte tokens, a document per
file (packed windows then hold several documents and cut some). Every rank runs 1 thread.
"""
import argparse
import glob
import os
import resource
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_overrides(data: str, seq_len: int, masking: bool) -> list:
    return ["recipe=lm_files", f"data.path={data}", "model=lm_small", "model.vocab_size=256", "plan=none",
            f"data.dataset.seq_len={seq_len}", "data.global_batch_size=2", f"data.document_masking={masking}",
            "trainer.eval_every=null", "trainer.progress_bar=false", "logger.tensorboard=false",
            "launcher.threads_per_rank=1", "trainer.grad_clip=null"]


def timed_steps(cfg_container: dict, out_dir: str, steps: int) -> dict:
    """In every rank: build, run `steps` train steps; median step time and this process's peak RSS."""
    import torch
    from omegaconf import OmegaConf

    from framework.data.batch import Batch
    from framework.data.loader import DataPosition, batches
    from framework.training.builder import build_and_run
    from framework.training.trainer import Trainer

    torch.set_num_threads(1)
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="optimizer")
    trainer = Trainer(run)
    data = batches(run.sampler, run.dataloader, DataPosition(), run.cfg.data.global_batch_size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(Batch.of(next(data), "cpu"), measure_norm=False)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]), "rss_before_kib": before,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def measure(overrides: list, steps: int) -> dict:
    from framework.cli import compose_config
    from framework.launch.handoff import rank_config
    from framework.launch.local import spawn_ranks

    cfg = compose_config(overrides)
    ranks = 1
    for size in cfg.mesh.shape:
        ranks *= size
    with tempfile.TemporaryDirectory() as out:
        results = spawn_ranks(ranks, timed_steps, rank_config(cfg), out, steps, threads_per_rank=1)
    tokens = cfg.data.global_batch_size * cfg.data.dataset.seq_len
    step = max(r["step_s"] for r in results.values())
    return {"tokens_per_s": tokens / step, "step_s": step,
            "peak_rss_mib": max(r["peak_rss_kib"] for r in results.values()) / 1024,
            "rss_before_mib": max(r["rss_before_kib"] for r in results.values()) / 1024}


def dry_run_activations(overrides: list) -> float:
    from framework.dryrun import compose_config, dry_run

    return max(r.activation_bytes for r in dry_run(compose_config([*overrides, "dryrun.ranks=[0]"]))) / 2**20


def gathered_bytes(overrides: list, cp: int) -> float:
    """Bytes rank 0 receives from the all-gathers of one step, from the dry run's count (each
    all-gather's input, from every other CP rank): the K/V gathers and the positions' one."""
    from framework.dryrun import compose_config, dry_run

    report = dry_run(compose_config([*overrides, "dryrun.ranks=[0]"]))[0]
    return sum(b for (op, _), (_, b) in report.collectives.items() if "all_gather" in op) * (cp - 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from framework.prepare import main as prepare

    work = Path(tempfile.mkdtemp(prefix="bench_cp_"))
    texts = work / "texts"  # a .txt per source file: a document each
    texts.mkdir()
    for source in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:120]:
        (texts / (Path(source).stem + ".txt")).write_bytes(Path(source).read_bytes())
    assert prepare([str(texts), "--out", str(work / "data")]) == 0
    data, seq = str(work / "data"), args.seq_len
    causal = measure([*model_overrides(data, seq, False), "mesh=1x1"], args.steps)
    print(f"lm_small, 2 x {seq} tokens per step, 1 thread per rank")
    print("| layout | document masking | tokens/s | peak RSS per rank (MiB) | activations, dry run (MiB) |")
    print("|---|---|---|---|---|")
    print(f"| 1x1 | off | {causal['tokens_per_s']:.0f} | {causal['peak_rss_mib']:.0f} | "
          f"{dry_run_activations([*model_overrides(data, seq, False), 'mesh=1x1']):.1f} |")
    for mesh in ("1x1", "1x2x1cp", "1x4x1cp"):
        overrides = [*model_overrides(data, seq, True), f"mesh={mesh}"]
        r = measure(overrides, args.steps)
        print(f"| {mesh} | on | {r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} | "
              f"{dry_run_activations(overrides):.1f} |")
        if mesh != "1x1":
            cp = int(mesh.split("x")[1])
            # analytic: K and V of the other c-1 ranks' chunks, per layer, forward: 2 x (c-1)/c x seq x kv_heads
            # x head_dim x 4 bytes per sequence, times the replica's 2 sequences and 4 layers
            analytic = 2 * (cp - 1) / cp * seq * 8 * 16 * 4 * 2 * 4
            print(f"    K/V all-gather received per step on rank 0: {gathered_bytes(overrides, cp) / 2**20:.2f} MiB "
                  f"counted (incl. the positions' gather) vs {analytic / 2**20:.2f} MiB analytic")


if __name__ == "__main__":
    main()
