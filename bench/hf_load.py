"""Loading a Hugging Face checkpoint: peak RSS per rank and time, sharded on 4 ranks (fsdp 4x1,
TP 1x4) against one process loading it whole and against transformers' from_pretrained.

    .venv/bin/python bench/hf_load.py [--work DIR] [--layers 24]

The checkpoint is a randomly initialized Llama-architecture model of about 0.5B parameters
(hidden 1024, 24 layers, 16 heads / 4 key-value heads, MLP 5120, vocabulary 32000), written
here as safetensors in 1 GB shards with an index (nothing is downloaded).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
              intermediate_size=5120, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
              rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, dtype="float32")


def make_checkpoint(out: Path, layers: int) -> int:
    """Random weights under Hugging Face's names, in 1 GB safetensors shards; return the parameter count."""
    from safetensors.torch import save_file

    from framework.models.hf import HFTransformer, hf_state_dict

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    shapes = {k: t.shape for k, t in hf_state_dict(HFTransformer(str(out)).state_dict(), tied=False).items()}
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = torch.randn(shape) * 0.02
        size += current[name].numel() * 4
        if size > 2**30:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(torch.Size(s).numel() for s in shapes.values())


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_on_rank(cfg_container: dict, out_dir: str) -> dict:
    """A rank of the framework: the builder's stages through fully_shard, where the sharded
    model is allocated and its slices read."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from framework.training.builder import build_and_run

    before = _peak_mb()
    start = time.perf_counter()
    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="fully_shard")
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in run.module.parameters())
    dist.destroy_process_group()
    return {"peak_mb": _peak_mb(), "before_mb": before, "seconds": seconds, "local_params": local}


ONE_PROCESS = {
    "framework, 1 process": """
from framework.checkpoint.weights import load_hf_weights
from framework.models.hf import HFTransformer
m = HFTransformer(PATH); m.to_empty(device="cpu"); m.tie_weights(); load_hf_weights(m, PATH)""",
    "transformers from_pretrained": """
import torch, transformers
transformers.AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)""",
}


def one_process(label: str, path: Path) -> dict:
    code = (f"import resource, time, warnings; warnings.simplefilter('ignore'); PATH = {str(path)!r}\n"
            f"start = time.perf_counter()\n{ONE_PROCESS[label]}\n"
            "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    seconds, peak = map(float, out.stdout.split()[-2:])
    return {"peak_mb": peak, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default=None)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    from framework.cli import compose_config
    from framework.launch.handoff import rank_config
    from framework.launch.local import spawn_ranks

    work = Path(args.work or tempfile.mkdtemp(prefix="hf_load_"))
    path = work / "llama"
    params = make_checkpoint(path, args.layers) if not (path / "config.json").exists() else None
    print(f"checkpoint {path}" + (f": {params / 1e6:.0f}M parameters" if params else ""))
    rows = [(label, one_process(label, path)) for label in ONE_PROCESS]
    for mesh, extra in (("4x1", ["plan=none", "parallel.dp_strategy=fsdp"]), ("1x4", ["plan=lm_tp_sp"])):
        cfg = compose_config(["recipe=lm_2d", "model=hf", f"model.path={path}", f"mesh={mesh}",
                              "trainer.progress_bar=false", *extra])
        reports = spawn_ranks(4, load_on_rank, rank_config(cfg), str(work / f"run_{mesh}"))
        worst = max(reports.values(), key=lambda r: r["peak_mb"])
        rows.append((f"framework {mesh} (worst of 4 ranks)", worst))
    whole = rows[0][1]["peak_mb"]
    print("| load | peak RSS per process (MB) | x one process | seconds |\n|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['peak_mb']:.0f} | {r['peak_mb'] / whole:.2f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
