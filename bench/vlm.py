"""Vision-language SFT (data=vision) against transformers' Trainer on this machine: the same tiny
random Gemma 3 (tests/hf_models.py's make_vlm: a SigLIP tower on 16x16 inputs, 2 + 2 layers),
the same records (a question about a 512x512 PNG of noise and colour, decoded and resized by the
model's own processor for every sample), batch 8, AdamW (fp32, fused), grad clip, 20 steps; the
median step of steps 5.. of each run; the sides alternating in each repeat.

Two loader settings per side: 2 worker processes (data=vision's default), where the images are
decoded beside the step, and 0, where the step's own process decodes them.

    .venv/bin/python bench/vlm.py [--repeats 2] [--steps 20]
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sides import run_side, step_ends  # noqa: E402

BATCH, SEQ, RECORDS, SIDE = 8, 64, 256, 512


def make_model_and_data(root: Path) -> dict:
    import numpy as np
    from PIL import Image

    from tests.hf_models import COLOURS, make_vlm

    model = make_vlm(str(root / "vlm"))
    rng, noise = random.Random(0), np.random.default_rng(0)
    names = sorted(COLOURS)
    for i in range(16):  # 16 distinct files, each a colour under noise
        pixels = np.clip(np.array(COLOURS[names[i % 4]]) + noise.normal(0, 20, (SIDE, SIDE, 3)), 0, 255)
        Image.fromarray(pixels.astype("uint8")).save(root / f"{i}.png")
    with open(root / "train.jsonl", "w") as f:
        for _ in range(RECORDS):
            i = rng.randrange(16)
            f.write(json.dumps({"image": f"{i}.png", "prompt": "What colour is it?", "response": names[i % 4]}) + "\n")
    return {"model": model, "records": str(root / "train.jsonl")}


def framework_cmd(data: dict, steps: int, workers: int, out: Path) -> list:
    return [sys.executable, "-m", "framework.train", "model=hf", f"model.path={data['model']}", "plan=none",
            "mesh=1x1", "data=vision", f"data.path={data['records']}", f"data.global_batch_size={BATCH}",
            f"data.dataset.seq_len={SEQ}", f"data.num_workers={workers}", "optim=adamw", "optim.lr=1e-4",
            "optim.weight_decay=0.0", "trainer.grad_clip=1.0", "trainer.mixed_precision=null",
            f"trainer.max_steps={steps}", "trainer.eval_every=null", "trainer.log_every=10",
            "trainer.progress_bar=false", "logger.tensorboard=false", "checkpoint.every=null", f"hydra.run.dir={out}"]


def peer_cmd(data: dict, steps: int, workers: int, out: Path) -> list:
    return [sys.executable, __file__, "--peer", "--model", data["model"], "--records", data["records"],
            "--steps", str(steps), "--workers", str(workers), "--out", str(out)]


def run_peer(args) -> None:
    """transformers' Trainer on the same records: a dataset that runs the processor on each
    record (the chat template's conversation, the prompt and image tokens labelled -100), and a
    collator that pads the batch."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

    processor = AutoProcessor.from_pretrained(args.model)
    records = [json.loads(line) for line in Path(args.records).read_text().splitlines()]
    root = Path(args.records).parent

    class Records(torch.utils.data.Dataset):
        def __len__(self):
            return len(records)

        def __getitem__(self, i):
            r = records[i]
            user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["prompt"]}]}
            answer = {"role": "assistant", "content": [{"type": "text", "text": r["response"]}]}
            text = processor.apply_chat_template([user, answer], tokenize=False)
            prompt = processor.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
            encoded = processor(text=[text], images=[[Image.open(root / r["image"]).convert("RGB")]],
                                return_tensors="pt")
            ids = encoded["input_ids"][0]
            learned = len(processor.tokenizer(text[len(prompt):], add_special_tokens=False)["input_ids"])
            labels = torch.full_like(ids, -100)
            labels[-learned:] = ids[-learned:]
            return {"input_ids": ids, "labels": labels, "token_type_ids": encoded["token_type_ids"][0],
                    "pixel_values": encoded["pixel_values"][0]}

    def collate(samples):
        length = max(len(s["input_ids"]) for s in samples)
        pad = lambda key, value: torch.stack([torch.cat([s[key], torch.full((length - len(s[key]),), value)])  # noqa: E731
                                              for s in samples])
        for s in samples:
            s["attention_mask"] = torch.ones_like(s["input_ids"])
        return {"input_ids": pad("input_ids", processor.tokenizer.pad_token_id),
                "attention_mask": pad("attention_mask", 0), "labels": pad("labels", -100),
                "token_type_ids": pad("token_type_ids", 0),
                "pixel_values": torch.stack([s["pixel_values"] for s in samples])}

    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=BATCH, max_steps=args.steps, learning_rate=1e-4,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused", lr_scheduler_type="constant",
        logging_steps=10, save_strategy="no", report_to=[], dataloader_num_workers=args.workers, use_cpu=True,
        seed=0, disable_tqdm=True, remove_unused_columns=False)
    steps = step_ends()
    Trainer(model=model, args=training, train_dataset=Records(), data_collator=collate, callbacks=[steps]).train()
    Path(args.out, "peer.json").write_text(json.dumps({"step_times_s": steps.times()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return run_peer(args)
    root = Path(tempfile.mkdtemp(prefix="bench_vlm_"))
    data = make_model_and_data(root)
    sides = [("framework", 2), ("peer", 2), ("framework", 0), ("peer", 0)]
    results = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            name, workers = side
            out = root / f"{name}_{workers}_{repeat}"
            command = (framework_cmd if name == "framework" else peer_cmd)(data, args.steps, workers, out)
            run_side(command)
            times = json.loads((out / ("peer.json" if name == "peer" else "summary.json")).read_text())["step_times_s"]
            results[side].append(statistics.median(times[4:]))
            print(f"repeat {repeat} {name:9s} workers={workers} {results[side][-1]:.3f} s/step", flush=True)
    print("\n| loader workers | framework s/step | Trainer s/step | framework / Trainer |\n|---|---|---|---|")
    for workers in (2, 0):
        f, p = results["framework", workers], results["peer", workers]
        print(f"| {workers} | {', '.join(f'{t:.3f}' for t in f)} | {', '.join(f'{t:.3f}' for t in p)} | "
              f"{statistics.mean(f) / statistics.mean(p):.2f} |")


if __name__ == "__main__":
    main()
