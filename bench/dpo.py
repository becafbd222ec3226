"""DPO's step time and reference memory on this machine: lm_bench (26M parameters) on synthetic
byte-level preference pairs, 8 pairs of 2 x 128 tokens per step, against SFT on the same
sequences (each pair's two responses as instruction examples: 16 per step), 1x1, AdamW.

    .venv/bin/python bench/dpo.py [--steps 12]
"""
import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["recipe=lm_files", "model=lm_bench", "model.vocab_size=256", "plan=none", "mesh=1x1",
          "data.dataset.seq_len=128", "trainer.eval_every=null", "trainer.log_every=1", "trainer.progress_bar=false",
          "logger.tensorboard=false", "checkpoint.every=null"]
LORA = ["adapter=lora", "adapter.rank=8", "adapter.targets=[wq,wk,wv,wo]"]
RUNS = [("SFT, full", ["data=instructions", "data.global_batch_size=16"], "sft"),
        ("DPO, full, frozen_copy", ["data=preferences", "data.global_batch_size=8", "objective.reference=frozen_copy",
                                    "adapter=none"], "pairs"),
        ("DPO, full, precomputed", ["data=preferences", "data.global_batch_size=8", "objective.reference=precomputed",
                                    "adapter=none"], "pairs"),
        ("SFT, LoRA", ["data=instructions", "data.global_batch_size=16", *LORA], "sft"),
        ("DPO, LoRA, adapters_off", ["data=preferences", "data.global_batch_size=8", *LORA], "pairs"),
        ("DPO, LoRA, precomputed", ["data=preferences", "data.global_batch_size=8", "objective.reference=precomputed",
                                    *LORA], "pairs")]


def make_data(work: Path) -> dict:
    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefgh ") for _ in range(n))  # noqa: E731
    pairs = [{"prompt": text(40), "chosen": text(80), "rejected": text(80)} for _ in range(400)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (work / "sft.jsonl").write_text("".join(json.dumps({"prompt": p["prompt"], "response": p[k]}) + "\n"
                                            for p in pairs for k in ("chosen", "rejected")))
    prepare = [sys.executable, "-m", "framework.prepare"]
    subprocess.run([*prepare, str(work / "pairs.jsonl"), "--out", str(work / "pairs"), "--prompt-field", "prompt",
                    "--chosen-field", "chosen", "--rejected-field", "rejected"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run([*prepare, str(work / "sft.jsonl"), "--out", str(work / "sft"), "--prompt-field", "prompt",
                    "--response-field", "response"], cwd=ROOT, check=True, capture_output=True)
    return {"pairs": work / "pairs", "sft": work / "sft"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_dpo_"))
    data = make_data(work)
    print("| run | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | reference (MiB) | ms/step |")
    print("|---|---|---|---|---|---|")
    for i, (name, overrides, kind) in enumerate(RUNS):
        out = work / f"run{i}"
        subprocess.run([sys.executable, "-m", "framework.train", *COMMON, *overrides, f"data.path={data[kind]}",
                        f"trainer.max_steps={args.steps}", f"hydra.run.dir={out}"], cwd=ROOT, check=True,
                       capture_output=True)
        summary = json.loads((out / "summary.json").read_text())
        m = summary["memory"]["max_over_ranks"]
        print(f"| {name} | {m['parameters'] / 2**20:.1f} | {m['gradients'] / 2**20:.2f} | "
              f"{m['optimizer_state'] / 2**20:.2f} | {m.get('reference', 0) / 2**20:.1f} | "
              f"{statistics.median(summary['step_times_s'][2:]) * 1000:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
