"""LoRA and QLoRA against full fine-tuning on this machine: each rank's parameter, gradient and
optimizer bytes (summary.json `memory`) and the median step time.

lm_bench (8 layers, dim 512, about 26M parameters) on the byte corpus, rank-8 adapters on wq,
wk, wv, wo, on 1x1 and on fsdp 2x1; with --llama, also the 506M-parameter Llama of
bench/hf_load.py (random weights, written here) on 1x1, a few steps.

    .venv/bin/python bench/lora.py [--steps 12] [--llama]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COMMON = ["recipe=lm_2d", "plan=none", "data.dataset.seq_len=128", "trainer.eval_every=null", "trainer.log_every=1",
          "trainer.progress_bar=false", "logger.tensorboard=false"]
LM_BENCH = ["model=lm_bench", "data.global_batch_size=8"]
TRAINING = [("full", []),
            ("LoRA r=8 on q/k/v/o", ["adapter=lora", "adapter.rank=8", "adapter.targets=[wq,wk,wv,wo]"]),
            ("QLoRA r=8 on q/k/v/o", ["adapter=qlora", "adapter.rank=8", "adapter.targets=[wq,wk,wv,wo]"])]


def run(overrides: list, steps: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "framework.train", *COMMON, f"trainer.max_steps={steps}", *overrides,
                    f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    memory = summary["memory"]["max_over_ranks"]
    return {"step_s": statistics.median(summary["step_times_s"][1:]), **memory}


def table(model: list, meshes: list, steps: int, work: Path) -> None:
    print("| mesh | training | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | ms/step |")
    print("|---|---|---|---|---|---|")
    for mesh in meshes:
        for i, (name, extra) in enumerate(TRAINING):
            r = run([*model, *mesh, *extra], steps, work / f"{len(list(work.iterdir()))}")
            print(f"| {' '.join(mesh)} | {name} | {r['parameters'] / 2**20:.1f} | {r['gradients'] / 2**20:.2f} | "
                  f"{r['optimizer_state'] / 2**20:.2f} | {r['step_s'] * 1000:,.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--llama", action="store_true", help="also the 506M Llama (minutes per step on 2 cores)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    print("lm_bench, 8 x 128 tokens per step")
    table(LM_BENCH, [["mesh=1x1"], ["mesh=2x1", "parallel.dp_strategy=fsdp"]], args.steps, work)
    if args.llama:
        from bench.hf_load import make_checkpoint

        params = make_checkpoint(work / "llama", 24)
        print(f"\nLlama {params / 1e6:.0f}M parameters, 2 x 128 tokens per step")
        table(["model=hf", f"model.path={work / 'llama'}", "data.global_batch_size=2"], [["mesh=1x1"]], 3, work)


if __name__ == "__main__":
    main()
