"""LoRA against full fine-tuning on this machine: lm_bench (8 layers, dim 512, about 26M
parameters) on the byte corpus, rank-8 adapters on wq, wk, wv, wo; each rank's parameter,
gradient and optimizer bytes (summary.json `memory`) and the median step time, on 1x1 and on
fsdp 2x1.

    .venv/bin/python bench/lora.py [--steps 12]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["recipe=lm_2d", "model=lm_bench", "plan=none", "data.global_batch_size=8", "data.dataset.seq_len=128",
         "trainer.eval_every=null", "trainer.log_every=1", "trainer.progress_bar=false", "logger.tensorboard=false"]
LORA = ["adapter=lora", "adapter.rank=8", "adapter.targets=[wq,wk,wv,wo]"]


def run(overrides: list, steps: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "framework.train", *MODEL, f"trainer.max_steps={steps}", *overrides,
                    f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    memory = summary["memory"]["max_over_ranks"]
    return {"step_s": statistics.median(summary["step_times_s"][2:]), **memory}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    print("| mesh | training | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | ms/step |")
    print("|---|---|---|---|---|---|")
    for mesh in (["mesh=1x1"], ["mesh=2x1", "parallel.dp_strategy=fsdp"]):
        for name, extra in (("full", []), ("LoRA r=8 on q/k/v/o", LORA)):
            r = run([*mesh, *extra], args.steps, work / f"{mesh[0].split('=')[1]}_{len(extra)}")
            print(f"| {' '.join(mesh)} | {name} | {r['parameters'] / 2**20:.1f} | {r['gradients'] / 2**20:.2f} | "
                  f"{r['optimizer_state'] / 2**20:.2f} | {r['step_s'] * 1000:.0f} |")


if __name__ == "__main__":
    main()
