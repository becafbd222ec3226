"""The losses of a fixed set of runs, to show a restructuring changed no arithmetic: each run's
summary.json losses (and validation losses) saved, or compared bitwise with a saved file.

    .venv/bin/python bench/fixed_losses.py --save before.json      # on the old code
    .venv/bin/python bench/fixed_losses.py --compare before.json   # on the new: bitwise, or by how much

The set: the tiny LM of lm_2d on 1x1 and 2x2 TP+SP, pp2x2x1 1F1B, lm_moe 2x1 with experts over
DP, cp 1x2x1cp, LoRA on a tiny Hugging Face Llama under fsdp 2x1, DPO (adapters_off) 1x1,
torchft replica groups on 2x1, GRPO (recipe=grpo_lm, its shipped prompts) on 2x1, KTO on the HF
Llama 1x1 and a two-source mixture of two corpora's tokens on 1x1: 6 steps each, from a fresh
clone's data (the byte corpus and a tiny random Llama made with transformers, the dev extra)."""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LM = ["recipe=lm_2d", "model=lm_tiny", "data.dataset.max_bytes=65536", "data.dataset.seq_len=32",
      "data.global_batch_size=8", "trainer.max_steps=6", "trainer.eval_every=3", "trainer.eval_batches=2",
      "trainer.progress_bar=false", "logger.tensorboard=false"]


def runs(data: dict) -> dict:
    hf = [f"model.path={data['model']}", "data.tokenizer=null", "data.dataset.seq_len=24", "data.global_batch_size=4",
          "adapter.rank=4", "adapter.alpha=8", "trainer.max_steps=6", "trainer.eval_every=null",
          "trainer.progress_bar=false", "logger.tensorboard=false", "checkpoint.every=null"]
    return {
        "lm_2d 1x1": [*LM, "mesh=1x1", "plan=none"],
        "lm_2d 2x2 TP+SP": [*LM, "mesh=2x2"],
        "pp2x2x1 1F1B": [*LM, "mesh=pp2x2x1", "plan=none", "parallel.pp_schedule=1f1b"],
        "lm_moe 2x1 EP": ["recipe=lm_moe", "model=lm_moe_tiny", *LM[2:], "mesh=2x1", "plan=none",
                          "parallel.ep_dims=[dp]"],
        "cp 1x2x1cp": [*LM, "mesh=1x2x1cp", "plan=none"],
        "LoRA fsdp 2x1": ["recipe=lora_hf", *hf, f"data.path={data['tokens']}", "mesh=2x1",
                          "parallel.dp_strategy=fsdp"],
        "DPO adapters_off 1x1": ["recipe=dpo_hf", *hf, f"data.path={data['pairs']}", "mesh=1x1",
                                 "parallel.dp_strategy=replicate"],
        "torchft 2x1": [*LM, "mesh=2x1", "plan=none", "launcher.fault_tolerance=torchft"],
        "GRPO grpo_lm 2x1": ["recipe=grpo_lm", "trainer.max_steps=6", "trainer.progress_bar=false",
                             "logger.tensorboard=false"],
        "KTO 1x1": ["recipe=dpo_hf", *hf, "data=kto", f"data.path={data['kto']}", "mesh=1x1",
                    "parallel.dp_strategy=replicate"],
        "mixture 1x1": ["recipe=lora_hf", *hf, "data=mixture", "mesh=1x1", "parallel.dp_strategy=replicate",
                        "data.dataset.seq_len=24", "data.dataset.num_samples=64",
                        f"+data.dataset.sources.a={{weight: 0.7, dataset: {{_target_: framework.data.TokenDataset, "
                        f"path: {data['tokens']}}}}}",
                        f"+data.dataset.sources.b={{weight: 0.3, dataset: {{_target_: framework.data.TokenDataset, "
                        f"path: {data['tokens_b']}}}}}"],
    }


def make_data(root: str) -> dict:
    from framework.prepare import main as prepare
    from tests.hf_models import make_hf_model

    model = make_hf_model("llama", os.path.join(root, "llama"))
    with open(os.path.join(root, "text.txt"), "w") as f:
        f.write("".join(f"line {i}: the mesh trains one model\n" for i in range(2000)))
    with open(os.path.join(root, "text_b.txt"), "w") as f:  # (a mixture's second source: another corpus)
        f.write("".join(f"row {i}: each rank reads its share\n" for i in range(2000)))
    rng = random.Random(0)
    with open(os.path.join(root, "pairs.jsonl"), "w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": f"q{i}:", "chosen": "ab" * (i % 4 + 2),
                                "rejected": "".join(rng.choice("cdefgh") for _ in range(i % 5 + 3))}) + "\n")
    assert prepare([os.path.join(root, "text.txt"), "--tokenizer", model, "--out", os.path.join(root, "tokens")]) == 0
    assert prepare([os.path.join(root, "text_b.txt"), "--tokenizer", model, "--out", os.path.join(root, "tokens_b")]) == 0
    assert prepare([os.path.join(root, "pairs.jsonl"), "--prompt-field", "prompt", "--chosen-field", "chosen",
                    "--rejected-field", "rejected", "--tokenizer", model, "--out", os.path.join(root, "pairs")]) == 0
    with open(os.path.join(root, "kto.jsonl"), "w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": f"q{i}:", "completion": "ab" * (i % 4 + 2) if i % 2 else "cdx" * (i % 3 + 1),
                                "label": bool(i % 2)}) + "\n")
    assert prepare([os.path.join(root, "kto.jsonl"), "--prompt-field", "prompt", "--response-field", "completion",
                    "--label-field", "label", "--tokenizer", model, "--out", os.path.join(root, "kto")]) == 0
    return {"model": model, **{name: os.path.join(root, name) for name in ("tokens", "tokens_b", "pairs", "kto")}}


def losses_of(overrides: list, out: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "framework.train", *overrides, f"hydra.run.dir={out}"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed: {result.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return {"losses": summary["losses"], "val_losses": [loss for _, loss in summary.get("val_losses", [])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", metavar="FILE")
    group.add_argument("--compare", metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        data = make_data(root)
        measured = {name: losses_of(overrides, os.path.join(root, f"run{i}"))
                    for i, (name, overrides) in enumerate(runs(data).items())}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(measured, f, indent=1)
        print(f"{len(measured)} runs saved to {args.save}")
        return
    with open(args.compare) as f:
        saved = json.load(f)
    for name, now in measured.items():
        said = []
        for key in ("losses", "val_losses"):
            before = saved[name][key]
            worst = max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(before, now[key])), default=0.0)
            said.append(f"{key} {'bitwise' if now[key] == before else f'differ: max relative {worst:.2e}'}")
        print(f"{name:24s} {', '.join(said)}")


if __name__ == "__main__":
    main()
