"""The planner past this machine: Llama 3 8B and 70B architectures (conf/model/llama3_*.yaml,
random tokens of 8192, 2 sequences per GPU as torchtitan's published runs, bf16, AdamW) on 8, 64
and 512 H100 80 GB from the published profile (framework/planner/profiles.yaml), each plan's
first rows printed and written to bench/paper_plans/<model>_<world>.txt. Every candidate is
dry-run on this CPU, so the space is narrowed where it is large: activation checkpointing
fixed to full (what torchtitan's and Meta's runs at this size use) and, past 8 GPUs, fsdp only.

    .venv/bin/python bench/paper_plans.py [--cases 8b:8,8b:64,8b:512,70b:64,70b:512]
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["recipe=lm_2d", "data=random_tokens", "plan=lm_tp_sp_loss_parallel", "data.dataset.seq_len=8192",
          "trainer.eval_every=null", "trainer.mixed_precision=bf16", "model.activation_checkpointing=full",
          "planner.device=h100"]


def plan(model: str, world: int) -> str:
    strategies = "[fsdp,hsdp]" if world <= 8 else "[fsdp]"
    command = [sys.executable, "-m", "framework.planner", *COMMON, f"model=llama3_{model}", f"planner.world={world}",
               f"data.global_batch_size={2 * world}", f"planner.strategies={strategies}"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    out = result.stdout + result.stderr[-2000:]
    return f"$ {' '.join(command[1:])}\n({time.perf_counter() - start:.0f} s, exit {result.returncode})\n{out}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8b:8,8b:64,8b:512,70b:64,70b:512")
    args = parser.parse_args()
    os.makedirs(os.path.join(ROOT, "bench", "paper_plans"), exist_ok=True)
    for case in args.cases.split(","):
        model, world = case.split(":")
        text = plan(model, int(world))
        with open(os.path.join(ROOT, "bench", "paper_plans", f"{model}_{world}.txt"), "w") as f:
            f.write(text)
        print("\n".join(text.splitlines()[:12]), flush=True)


if __name__ == "__main__":
    main()
