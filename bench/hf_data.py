"""data=hf's loader against what training consumes: tokens/s of the loader alone (tokenizing
as it reads, 0 / 1 / 2 workers, indexed and streamed) beside lm_small's and lm_bench's 1x1 step
rates on the same data, the index's cost, and the RSS of one process streaming a 100k-document
dataset from start to end.

    .venv/bin/python bench/hf_data.py [--docs 100000] [--work DIR]

The corpus: JSONL shards of random sentences (bench/prepare.py's words, a fixed seed), a
byte-level BPE of 8000 tokens trained here. Nothing is downloaded.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.prepare import WORDS, make_tokenizer  # noqa: E402

SHARDS, BATCH, SEQ = 4, 16, 128


def make_corpus(folder: Path, docs: int) -> None:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    files = [open(folder / f"part-{i}.jsonl", "w") for i in range(SHARDS)]
    for n in range(docs):
        text = " ".join(rng.choice(WORDS) + rng.choice(["", "s", "ed", "ing"]) for _ in range(rng.randint(20, 60)))
        files[n % SHARDS].write(json.dumps({"text": text}) + "\n")
    for f in files:
        f.close()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def loader_rate(dataset, workers: int, batches: int = 100) -> float:
    """Tokens/s of the training loader (the DP sampler, StatefulDataLoader) over `dataset`."""
    from framework.data.loader import build_dataloader, build_sampler

    loader = build_dataloader(dataset, build_sampler(dataset, 1, 0, True, 0, True), BATCH, workers)
    iterator = iter(loader)
    next(iterator)  # the workers started
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH * SEQ / (time.perf_counter() - start)


def step_rate(model: str, corpus: Path, tokenizer: Path, work: Path) -> float:
    """Tokens/s of a 1x1 training run of `model` on the corpus through data=hf (steady steps)."""
    out = work / f"train_{model}"
    subprocess.run([sys.executable, "-m", "framework.train", "recipe=lm_files", f"model={model}", "data=hf",
                    f"data.path={corpus}", f"data.tokenizer={tokenizer}", "mesh=1x1", "plan=none",
                    f"data.global_batch_size={BATCH}", f"data.dataset.seq_len={SEQ}", "trainer.max_steps=10",
                    "trainer.eval_every=null", "trainer.progress_bar=false", "logger.tensorboard=false",
                    f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    return json.loads((out / "summary.json").read_text())["samples_per_s"] * SEQ


def run(work: Path, docs: int) -> None:
    os.environ["FRAMEWORK_CACHE_DIR"] = str(work / "cache")
    os.environ["HF_DATASETS_CACHE"] = str(work / "datasets")
    corpus, tokenizer = work / "corpus", work / "tokenizer.json"
    if not corpus.exists():
        make_corpus(corpus, docs)
    make_tokenizer(next(corpus.glob("*.jsonl")), tokenizer)
    from framework.data import HFTokenDataset, HFTokenStream

    start = time.perf_counter()
    indexed = HFTokenDataset(str(corpus), str(tokenizer), seq_len=SEQ)
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    HFTokenDataset(str(corpus), str(tokenizer), seq_len=SEQ)
    cached_s = time.perf_counter() - start
    print(json.dumps({"docs": docs, "tokens": int(indexed.documents.offsets[-1]), "index_s": round(index_s, 2),
                      "open_with_cached_index_s": round(cached_s, 2)}), flush=True)
    rates = {}
    for workers in (0, 1, 2):
        rates[f"indexed_w{workers}"] = loader_rate(indexed, workers)
        stream = HFTokenStream(str(corpus), str(tokenizer), seq_len=SEQ)
        stream.for_replica(0, 1)
        rates[f"stream_w{workers}"] = loader_rate(stream, workers)
        print(json.dumps({k: round(v) for k, v in rates.items() if k.endswith(str(workers))}), flush=True)
    steps = {model: step_rate(model, corpus, tokenizer, work) for model in ("lm_small", "lm_bench")}
    print(json.dumps({"loader_tokens_per_s": {k: round(v) for k, v in rates.items()},
                      "step_tokens_per_s_1x1": {k: round(v) for k, v in steps.items()},
                      "slowest_loader_over_fastest_step": round(min(rates.values()) / max(steps.values()), 1)}),
          flush=True)
    # RSS of one process streaming every record (no workers: everything in this process)
    stream = HFTokenStream(str(corpus), str(tokenizer), seq_len=SEQ)
    stream.for_replica(0, 1)
    marks, windows = [], 0
    total = int(indexed.documents.offsets[-1]) // SEQ
    for windows, _ in enumerate(stream, 1):
        if windows % max(1, total // 10) == 0:
            marks.append(round(rss_mb(), 1))
    print(json.dumps({"stream_windows": windows, "rss_mb_at_each_tenth": marks}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    if args.work:
        run(Path(args.work), args.docs)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-hf-data-") as work:
            run(Path(work), args.docs)


if __name__ == "__main__":
    main()
