"""Throughput of the real-data path: `framework.prepare` on a generated corpus (MB/s, tokens/s
and peak RSS with 1 and 2 workers), and the training loader over the prepared tokens against
the step rate of lm_small (the loader must never be what a step waits for).

    .venv/bin/python bench/prepare.py [--mb 200] [--work DIR]

The corpus is JSONL of random sentences (a fixed seed); the tokenizer a byte-level BPE of 8000
tokens trained here on the first MB. Nothing is downloaded.
"""
import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("data mesh rank model tensor shard replica gradient optimizer step loss token batch sequence "
         "parallel pipeline checkpoint resume epoch sampler loader kernel memory compute network").split()


def make_corpus(path: Path, megabytes: int) -> None:
    rng = random.Random(0)
    target = megabytes * 1_000_000
    with open(path, "w") as f:
        written = 0
        while written < target:
            text = " ".join(rng.choice(WORDS) + rng.choice(["", "s", "ed", "ing"]) for _ in range(rng.randint(50, 400)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)


def make_tokenizer(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(corpus) as f:
        sample = [json.loads(line)["text"] for line, _ in zip(f, range(2000))]
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer.save(str(out))


def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    """One prepare in a fresh child; its wall time, and the peak RSS of its largest process."""
    probe = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
    cmd = [sys.executable, "-c", probe, sys.executable, "-m", "framework.prepare", str(corpus),
           "--tokenizer", str(tokenizer), "--out", str(out), "--workers", str(workers)]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    meta = json.loads((out / "meta.json").read_text())
    size = corpus.stat().st_size
    return {"workers": workers, "wall_s": round(wall, 2), "MB_per_s": round(size / 1e6 / wall, 2),
            "tokens_per_s": round(meta["tokens"] / wall), "tokens": meta["tokens"],
            "peak_rss_MB": round(int(result.stdout.strip().splitlines()[-1]) / 1024)}


def loader_rate(data: Path, batches: int = 200) -> float:
    """Samples/s of the training loader (sampler, StatefulDataLoader, TokenDataset) at lm_small's
    shape (16 sequences of 128 tokens), one process."""
    sys.path.insert(0, str(ROOT))
    from framework.data.loader import build_dataloader, build_sampler
    from framework.data.datasets import TokenDataset

    dataset = TokenDataset(str(data), seq_len=128)
    loader = build_dataloader(dataset, build_sampler(dataset, 1, 0, True, 0, True), 16, 0)
    iterator = iter(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * 16 / (time.perf_counter() - start)


def step_rate(data: Path, work: Path) -> float:
    """Samples/s of lm_small training on 1x1 over the same tokens (steady steps)."""
    out = work / "train"
    subprocess.run([sys.executable, "-m", "framework.train", "recipe=lm_files", f"data.path={data}", "mesh=1x1",
                    "plan=none", "trainer.max_steps=12", "trainer.eval_every=null", "trainer.progress_bar=false",
                    "logger.tensorboard=false", f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    return json.loads((out / "summary.json").read_text())["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    if args.work:
        run(Path(args.work), args.mb)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-prepare-") as work:  # ~450 MB: removed afterwards
            run(Path(work), args.mb)


def run(work: Path, megabytes: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer = work / "corpus.jsonl", work / "tokenizer.json"
    if not corpus.exists():
        make_corpus(corpus, megabytes)
    make_tokenizer(corpus, tokenizer)
    results = []
    for workers in (1, 2):
        out = work / f"tokens_w{workers}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        results.append(run_prepare(corpus, tokenizer, out, workers))
        print(json.dumps(results[-1]), flush=True)
    same = (work / "tokens_w1" / "tokens.bin").read_bytes() == (work / "tokens_w2" / "tokens.bin").read_bytes()
    loader, step = loader_rate(work / "tokens_w1"), step_rate(work / "tokens_w1", work)
    print(json.dumps({"corpus_MB": round(corpus.stat().st_size / 1e6, 1), "same_tokens_1_and_2_workers": same,
                      "loader_samples_per_s": round(loader), "lm_small_1x1_samples_per_s": round(step, 1),
                      "loader_over_step": round(loader / step, 1)}))


if __name__ == "__main__":
    main()
