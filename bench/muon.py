"""optim=muon against AdamW, and the distributed Muon's collectives against torch.optim.Muon's.

    .venv/bin/python bench/muon.py                 # every row, 2 repeats, alternating
    .venv/bin/python bench/muon.py --repeats 1 --steps 3 --out /tmp/muon.md

Rows (medians of the steps after the first; fp32 weights):
- bench/peers.py's random 34M Llama (model=hf, 8 x 256 tokens a step): a whole train step and the
  optimizer's share of it, AdamW (fused) against Muon (float32 Newton-Schulz, ns_dtype=auto's
  choice on a CPU) on 1x1 and on 2x2 FSDP2 x TP, with what one optimizer step communicates.
- lm_small on 2x1 FSDP2, bf16 Newton-Schulz: framework.training.muon against torch.optim.Muon
  stepping the same hidden matrices as the FSDP2 DTensors they are (torch's CommDebugMode counts
  the collectives; its AdamW side left out, so the step trains less: the counts are the point).
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measured_steps(cfg_container: dict, out_dir: str, steps: int, torch_muon: bool) -> dict:
    """In every rank: build, train `steps` steps timing each and its optimizer step, count what
    the last optimizer step communicates. torch_muon: torch.optim.Muon over the Muon side's
    DTensors instead of framework.training.muon (its AdamW side dropped: the count is Muon's)."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.tensor.debug import CommDebugMode

    from framework.data.batch import Batch
    from framework.data.loader import DataPosition, batches
    from framework.training.builder import build_and_run
    from framework.training.trainer import Trainer

    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="optimizer")
    if torch_muon:
        muon = [g for g in run.optimizer.param_groups if g.get("muon")][0]
        run.optimizer = torch.optim.Muon(muon["params"], lr=muon["lr"], momentum=muon["momentum"],
                                         weight_decay=muon["weight_decay"])
        run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: 1.0)
    trainer = Trainer(run)
    optimizer, step_of = run.optimizer, run.optimizer.step
    timings, sent = {"optimizer": []}, []
    exchange = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return exchange(output, input, *args, **kwargs)

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        with CommDebugMode() as comm:
            result = step_of(*args, **kwargs)
        timings["optimizer"].append(time.perf_counter() - start)
        timings["comm"] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        return result

    optimizer.step = timed_step
    dist.all_to_all_single = counted
    data = batches(run.sampler, run.dataloader, DataPosition(), run.cfg.data.global_batch_size)
    times = []
    for _ in range(steps):
        sent.clear()
        start = time.perf_counter()
        trainer.train_step(Batch.of(next(data), "cpu"), measure_norm=False)
        times.append(time.perf_counter() - start)
    dist.all_to_all_single = exchange
    return {"step_s": statistics.median(times[1:]), "optimizer_s": statistics.median(timings["optimizer"][1:]),
            "comm": timings["comm"], "all_to_all_bytes_sent": sum(sent)}


def measure(overrides: list, steps: int, torch_muon: bool = False) -> dict:
    from framework.cli import compose_config
    from framework.launch.handoff import rank_config
    from framework.launch.local import spawn_ranks

    cfg = compose_config(overrides)
    ranks = 1
    for size in cfg.mesh.shape:
        ranks *= size
    with tempfile.TemporaryDirectory() as out:
        results = spawn_ranks(ranks, measured_steps, rank_config(cfg), out, steps, torch_muon)
    slowest = max(results.values(), key=lambda r: r["step_s"])
    return {"step_s": slowest["step_s"], "optimizer_s": max(r["optimizer_s"] for r in results.values()),
            "comm": results[0]["comm"], "bytes": sum(r["all_to_all_bytes_sent"] for r in results.values())}


def row(name: str, runs: list) -> str:
    step = statistics.median(r["step_s"] for r in runs)
    opt = statistics.median(r["optimizer_s"] for r in runs)
    return (f"| {name} | {step:.3f} | {opt:.3f} | {opt / step:.2f} | {runs[-1]['comm']} | "
            f"{runs[-1]['bytes'] / 2 ** 20:.1f} MiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="muon_bench.md", help="the table, written as each row ends")
    args = parser.parse_args()
    from bench.peers import make_model_and_data

    root = Path(tempfile.mkdtemp(prefix="muon-bench-"))
    data = make_model_and_data(root)
    llama = ["model=hf", f"model.path={data['model']}", "data=tokens", f"data.path={data['tokens']}",
             "data.global_batch_size=8", "data.dataset.seq_len=256", *QUIET]
    small = ["recipe=lm_2d", "~optim.betas", "data.global_batch_size=8", *QUIET]  # lm_small, 8 x 128 bytes
    fsdp_tp = ["mesh=2x2", "plan=lm_tp", "parallel.dp_strategy=fsdp"]
    muon = ["optim=muon", "optim.ns_dtype=float32"]
    rows = {"34M Llama 1x1, AdamW": [*llama, "mesh=1x1", "plan=none", "optim=adamw"],
            "34M Llama 1x1, Muon (fp32 Newton-Schulz)": [*llama, "mesh=1x1", "plan=none", *muon],
            "34M Llama 2x2 FSDP2 x TP, AdamW": [*llama, *fsdp_tp, "optim=adamw"],
            "34M Llama 2x2 FSDP2 x TP, Muon (fp32)": [*llama, *fsdp_tp, *muon],
            "lm_small 2x1 FSDP2, Muon (bf16, as torch)": [*small, "mesh=2x1", "plan=none",
                                                          "parallel.dp_strategy=fsdp", "optim=muon",
                                                          "optim.ns_dtype=bfloat16"]}
    results = {name: [] for name in [*rows, "lm_small 2x1 FSDP2, torch.optim.Muon on the DTensors"]}
    lines = ["| row | step s | optimizer step s | optimizer share | collectives of one optimizer step (rank 0) | "
             "all_to_all bytes (all ranks, one step) |", "|---|---|---|---|---|---|"]
    for _ in range(args.repeats):  # alternating: every row once per repeat
        for name, overrides in rows.items():
            results[name].append(measure(overrides, args.steps))
            if name.startswith("lm_small"):
                results["lm_small 2x1 FSDP2, torch.optim.Muon on the DTensors"].append(
                    measure(overrides, args.steps, torch_muon=True))
    table = "\n".join(lines + [row(name, runs) for name, runs in results.items()])
    Path(args.out).write_text(table + "\n")
    print(table, flush=True)


QUIET = ["trainer.progress_bar=false", "logger.tensorboard=false", "checkpoint.every=null", "trainer.eval_every=null"]


if __name__ == "__main__":
    main()
