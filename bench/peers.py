"""The framework against the peers a user would pick on the same machine: transformers' Trainer
(full fine-tuning on one process, DDP over 2 ranks under torchrun, LoRA with PEFT) and TRL's
DPOTrainer (LoRA with PEFT, the reference its adapters off), on the same random Hugging Face
Llama, the same token windows (DPO: the same pairs), batch, optimizer (AdamW, fp32, fused:
both sides' default), grad clip and steps; the two sides alternating in each repeat; the median
step of steps 5.. of each run.

    .venv/bin/python bench/peers.py [--repeats 2] [--steps 20] [--rows full1,ddp2,lora1,dpo1] [--compile]
    .venv/bin/python bench/peers.py --backend transformers --rows full1,ddp2

Reports s/step, tokens/s and the peak RSS of the largest process (a rank) per side, and the
framework / peer ratio of the repeats' means. The peers are the dev extra's references.
--compile: the framework with trainer.compile=blocks against Trainer's torch_compile=True.
--backend transformers: the framework's model is transformers' own class (model.backend), and a
third side, the framework's native model on the same weights, alternates with the other two."""
import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sides import run_side, step_ends  # noqa: E402

HIDDEN, LAYERS, VOCAB, SEQ, BATCH = 512, 8, 8192, 256, 8
LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
PAIRS, PAIR_BYTES = 8, 120  # DPO: pairs per step; the prompt's, the chosen's and the rejected's bytes (tokens)


def make_model_and_data(root: Path) -> dict:
    """A random 34M Llama (hidden 512, 8 layers, vocab 8192) and prepared token data."""
    from framework.prepare import main as prepare
    from tests.hf_models import make_hf_model

    model = make_hf_model("llama", str(root / "llama"), hidden_size=HIDDEN, intermediate_size=1376,
                          num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8, vocab_size=VOCAB,
                          max_position_embeddings=SEQ * 2, tie_word_embeddings=False)
    text = root / "text.txt"
    text.write_text("".join(f"line {i}: the mesh trains one model, step after step\n" for i in range(6000)))
    assert prepare([str(text), "--tokenizer", model, "--out", str(root / "tokens")]) == 0
    words = "mesh rank shard step model batch token layer".split()
    text_of = lambda i, n: " ".join(words[(i * 7 + k * 3) % 8] for k in range(n))[:PAIR_BYTES].ljust(PAIR_BYTES)  # noqa: E731
    pairs = [{"prompt": text_of(i, 30), "chosen": text_of(i + 1, 30), "rejected": text_of(i + 2, 30)}
             for i in range(200)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert prepare([str(root / "pairs.jsonl"), "--tokenizer", model, "--out", str(root / "pairs"), "--prompt-field",
                    "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected"]) == 0
    return {"model": model, "tokens": str(root / "tokens"), "pairs": str(root / "pairs"),
            "pairs_jsonl": str(root / "pairs.jsonl")}


def framework_cmd(row: str, data: dict, steps: int, out: Path, compile_: bool, backend: str = "native") -> list:
    if row == "dpo1":
        return [sys.executable, "-m", "framework.train", "recipe=dpo_hf", f"model.path={data['model']}",
                f"data.path={data['pairs']}", "mesh=1x1", "plan=none", "parallel.dp_strategy=replicate",
                f"adapter.rank={LORA['rank']}", f"adapter.alpha={LORA['alpha']}", "adapter.targets=[wq,wk,wv,wo]",
                "adapter.dropout=0", f"data.global_batch_size={PAIRS}", f"data.dataset.seq_len={2 * PAIR_BYTES + 2}",
                "optim.lr=5e-6", "optim.betas=[0.9,0.999]", "trainer.mixed_precision=null", f"trainer.max_steps={steps}",
                "trainer.warmup_steps=2", "trainer.eval_every=null", "trainer.log_every=10", "trainer.progress_bar=false",
                "logger.tensorboard=false", "checkpoint.every=null",
                f"trainer.compile={'blocks' if compile_ else 'none'}", f"hydra.run.dir={out}"]
    overrides = ["recipe=finetune_hf", f"model.path={data['model']}", f"data.path={data['tokens']}",
                 "data.tokenizer=null", f"data.dataset.seq_len={SEQ}", f"data.global_batch_size={BATCH}",
                 "data.document_masking=false", "plan=none", "parallel.dp_strategy=replicate",
                 "trainer.mixed_precision=null", f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
                 "trainer.eval_every=null", "trainer.log_every=10", "trainer.progress_bar=false",
                 "logger.tensorboard=false", "checkpoint.every=null", f"trainer.compile={'blocks' if compile_ else 'none'}",
                 "mesh=2x1" if row == "ddp2" else "mesh=1x1", f"hydra.run.dir={out}", f"model.backend={backend}"]
    if row == "lora1":
        targets = "wq,wk,wv,wo" if backend == "native" else ",".join(LORA["targets"])
        overrides += ["adapter=lora", f"adapter.rank={LORA['rank']}", f"adapter.alpha={LORA['alpha']}",
                      f"adapter.targets=[{targets}]", "adapter.dropout=0"]
    return [sys.executable, "-m", "framework.train", *overrides]


def peer_cmd(row: str, data: dict, steps: int, out: Path, compile_: bool) -> list:
    args = [__file__, "--peer", row, "--model", data["model"], "--tokens", data["tokens"], "--steps", str(steps),
            "--pairs-jsonl", data["pairs_jsonl"], "--out", str(out)] + (["--compile"] if compile_ else [])
    if row == "ddp2":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", "29517", *args]
    return [sys.executable, *args]


def median_step(times: list) -> float:
    return statistics.median(times[4:])


def run_dpo_peer(args, model, steps) -> None:
    """The DPO row's peer: TRL's DPOTrainer on the same pairs (as text: its tokenizer makes the
    same byte tokens), LoRA through PEFT, the reference its adapters off, sigmoid loss, beta 0.1."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    records = [json.loads(line) for line in Path(args.pairs_jsonl).read_text().splitlines()]
    config = DPOConfig(output_dir=args.out, per_device_train_batch_size=PAIRS, max_length=2 * PAIR_BYTES + 2, beta=0.1,
                       loss_type=["sigmoid"], learning_rate=5e-6, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                       warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=1.0, optim="adamw_torch_fused",
                       max_steps=args.steps, logging_steps=10, save_strategy="no", report_to=[], use_cpu=True,
                       dataloader_num_workers=0, seed=0, disable_tqdm=True, gradient_checkpointing=False)
    DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(records),
               processing_class=AutoTokenizer.from_pretrained(args.model), callbacks=[steps],
               peft_config=LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                      target_modules=LORA["targets"])).train()
    Path(args.out, "peer.json").write_text(json.dumps({"step_times_s": steps.times()}))


def run_peer(args) -> None:
    """One side of a row: transformers' Trainer on the framework's own token windows (TRL's
    DPOTrainer on the same pairs for dpo1)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from framework.data import TokenDataset

    ddp = "RANK" in os.environ

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            inputs = windows[i][0]
            return {"input_ids": inputs, "labels": inputs}

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    if args.peer == "dpo1":
        return run_dpo_peer(args, model, step_ends())
    windows = TokenDataset(args.tokens, SEQ, val_fraction=0.05, document_masking=False)
    if args.peer == "lora1":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                                 target_modules=LORA["targets"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=BATCH // world, max_steps=args.steps, learning_rate=2e-5,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, warmup_steps=2, lr_scheduler_type="cosine",
        max_grad_norm=1.0, optim="adamw_torch_fused", logging_steps=10, save_strategy="no", report_to=[],
        dataloader_num_workers=0, use_cpu=True, seed=0, disable_tqdm=True, torch_compile=args.compile,
        ddp_backend="gloo" if ddp else None)
    steps = step_ends()
    Trainer(model=model, args=training, train_dataset=Windows(), callbacks=[steps]).train()
    if not ddp or dist.get_rank() == 0:
        Path(args.out, "peer.json").write_text(json.dumps({"step_times_s": steps.times()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", default="full1,ddp2,lora1,dpo1")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--backend", choices=["native", "transformers"], default="native")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    parser.add_argument("--pairs-jsonl", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return run_peer(args)
    root = Path(tempfile.mkdtemp(prefix="bench_peers_"))
    data = make_model_and_data(root)
    rows = args.rows.split(",")
    all_sides = ["framework", "peer"] + (["native"] if args.backend != "native" else [])
    results = {row: {side: [] for side in all_sides} for row in rows}
    commands = {"framework": lambda *a: framework_cmd(*a, backend=args.backend), "peer": peer_cmd,
                "native": framework_cmd}
    for repeat in range(args.repeats):
        for row in rows:
            sides = all_sides if repeat % 2 == 0 else all_sides[::-1]
            for side in sides:
                out = root / f"{row}_{side}_{repeat}"
                rss = run_side(commands[side](row, data, args.steps, out, args.compile))["peak_rss"]
                summary = json.loads((out / ("peer.json" if side == "peer" else "summary.json")).read_text())
                step = median_step(summary["step_times_s"])
                results[row][side].append({"step_s": step, "rss": rss})
                print(f"repeat {repeat} {row:6s} {side:9s} {step:.3f} s/step, peak RSS {rss / 2**20:.0f} MiB",
                      flush=True)
    print(f"\n| row | framework s/step | peer s/step | framework / peer | tokens/s (framework, peer) | "
          f"peak RSS MiB (framework, peer) |\n|---|---|---|---|---|---|")
    tokens = {row: PAIRS * 2 * (2 * PAIR_BYTES + 2) if row == "dpo1" else BATCH * SEQ for row in results}
    for row, sides in results.items():
        f, p = ([r["step_s"] for r in sides[s]] for s in ("framework", "peer"))
        ratio = statistics.mean(f) / statistics.mean(p)
        rss = [max(r["rss"] for r in sides[s]) / 2**20 for s in ("framework", "peer")]
        print(f"| {row} | {', '.join(f'{t:.3f}' for t in f)} | {', '.join(f'{t:.3f}' for t in p)} | {ratio:.2f} | "
              f"{tokens[row] / statistics.mean(f):,.0f}, {tokens[row] / statistics.mean(p):,.0f} | "
              f"{rss[0]:.0f}, {rss[1]:.0f} |")
    for row, sides in results.items():
        if "native" in sides:
            f, n = (statistics.mean(r["step_s"] for r in sides[s]) for s in ("framework", "native"))
            print(f"{row}: the framework on transformers' class {f:.3f} s/step, on its native model {n:.3f}: "
                  f"{f / n:.2f}")
    (root / "peers.json").write_text(json.dumps(results, indent=1))
    print(f"\n(raw: {root / 'peers.json'})")


if __name__ == "__main__":
    main()
