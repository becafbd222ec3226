"""bench/gpu.py's rows: what each runs (a command, its output folder), what it is worth (tokens
per step, model FLOPs per token) and how its result is read; the shapes of the H200 run and of
the CPU smoke run; the data and the random Hugging Face model the rows share, made where they
run (the byte tokenizer's identity is then the one the model directory holds)."""
import dataclasses
import functools
import glob
import json
import os
import statistics
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.grpo as grpo  # noqa: E402
from bench.long_context import model_overrides as lm_files_overrides  # noqa: E402

# Llama 3.2 1B's shape (tied, 32 heads of 64, 8 KV heads), the framework's constructor names
LLAMA_1B = dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192)
LM_BENCH = dict(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, hidden_dim=1408)  # conf/model/lm_bench
TINY = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128)
H200_BF16 = 989e12  # dense bf16 peak by the datasheet, as framework/training/metrics.py's PEAK_TFLOPS


@dataclasses.dataclass(frozen=True)
class Scale:
    """The shapes, steps and budget of one run of the rows."""
    device: str
    native: dict      # the framework's own model and the transformers peer
    bench: dict       # document masking's lm_bench
    hf: dict          # the random Hugging Face Llama; its byte tokenizer decodes ids past 255 to nothing
    seq: int
    batch: int
    steps: int        # native, peer and masking rows (the first is left out of s/step)
    hf_steps: int
    grpo_steps: int
    new_tokens: int
    budget_s: float
    peak_flops: Optional[float]


GPU = Scale("cuda", LLAMA_1B, LM_BENCH, {**LLAMA_1B, "vocab_size": 8192}, seq=2048, batch=8, steps=10, hf_steps=8,
            grpo_steps=2, new_tokens=256, budget_s=310.0, peak_flops=H200_BF16)
SMOKE = Scale("cpu", TINY, {**TINY, "vocab_size": 256}, TINY, seq=64, batch=2, steps=3,
              hf_steps=3, grpo_steps=2, new_tokens=8, budget_s=1500.0, peak_flops=None)


@dataclasses.dataclass
class Row:
    """`command(out)`: what runs (may prepare shared data first); `read(out)`: its result, a dict
    of step_times_s, losses and memory figures (or GRPO's measured figures)."""
    name: str
    command: Callable[[Path], list]
    read: Callable[[Path], dict]
    estimate_s: float  # wall seconds on the H200, start-up included: the budget skips a row that cannot fit
    cap_s: float       # the row's own timeout
    tokens: Optional[int] = None           # tokens per step
    flops_per_token: Optional[int] = None  # model FLOPs (the framework's formula)
    kind: str = "train"                    # train, or grpo
    note: str = ""


def flops_per_token(shape: dict, seq: int) -> int:
    """The framework's own count (6 per matmul weight, the output projection too when tied, plus
    attention's 12 * layers * dim * seq), of a model built on meta."""
    import torch

    from framework.models import Transformer

    with torch.device("meta"):
        return Transformer(**shape, tie_word_embeddings=True).flops_per_token(seq)


def with_overrides(overrides: list, **changes) -> list:
    """`overrides` with each key in `changes` set (replaced in place, else appended); dots in keys
    are written as `__`. A value of None drops the key."""
    changes = {k.replace("__", "."): v for k, v in changes.items()}
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+")
        if key not in changes:
            out.append(item)
        elif changes[key] is not None:
            out.append(f"{item.split('=', 1)[0]}={changes.pop(key)}")
        else:
            changes.pop(key)
    return out + [f"{k}={v}" for k, v in changes.items() if v is not None]


def train_cmd(overrides: list) -> list:
    return [sys.executable, "-m", "framework.train", *overrides]


def model_keys(shape: dict) -> list:
    """The shape as model overrides; `++` adds a key the model's file lacks (lm_bench: n_kv_heads)."""
    return [f"++model.{k}={v}" for k, v in shape.items()] + ["++model.tie_word_embeddings=true"]


def common(scale: Scale, steps: int, out: Path) -> list:
    return ["mesh=1x1", "plan=none", f"mesh.device_type={scale.device}", "trainer.mixed_precision=bf16",
            f"trainer.max_steps={steps}", f"trainer.log_every={steps}", "trainer.warmup_steps=0",
            "trainer.eval_every=null", "trainer.progress_bar=false", "checkpoint.every=null",
            "logger.tensorboard=false", f"hydra.run.dir={out}"]


def native_overrides(scale: Scale, compile_: str, out: Path) -> list:
    """The framework's own 1B-shaped model on random tokens (issue 64's command), AdamW (fused,
    the default) and grad clip 1.0 as the peer."""
    return ["model=llama3_8b", *model_keys(scale.native), "data=random_tokens", f"data.dataset.seq_len={scale.seq}",
            f"data.global_batch_size={scale.batch}", "optim=adamw", "trainer.grad_clip=1.0",
            f"trainer.compile={compile_}", *common(scale, scale.steps, out)]


def native_cmd(scale: Scale, compile_: str) -> Callable[[Path], list]:
    return lambda out: train_cmd(native_overrides(scale, compile_, out))


def read_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def peer_cmd(scale: Scale, compile_: bool) -> Callable[[Path], list]:
    s = scale.native
    return lambda out: [sys.executable, str(ROOT / "bench" / "gpu_peer.py"), "--json", str(out / "peer.json"),
                        "--dim", str(s["dim"]), "--layers", str(s["n_layers"]), "--heads", str(s["n_heads"]),
                        "--kv-heads", str(s["n_kv_heads"]), "--hidden", str(s["hidden_dim"]),
                        "--vocab", str(s["vocab_size"]), "--seq", str(scale.seq), "--batch", str(scale.batch),
                        "--steps", str(scale.steps), "--device", scale.device] + (["--compile"] if compile_ else [])


class Shared:
    """What several rows read, made once in this process the first time a row asks: the random
    Hugging Face Llama with its byte tokenizer, token data prepared with it, GRPO's prompts and
    reward, byte-level documents for document masking."""

    def __init__(self, scale: Scale, work: Path):
        self.scale, self.work = scale, work

    @functools.cached_property
    def hf_model(self) -> str:
        from framework.models.nf4 import torchao_quietly
        from tests.hf_models import make_hf_model

        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # ("Writing model shards" on the table's console)
        s = self.scale.hf
        with torchao_quietly():  # (transformers' model classes import its quantizers, which load torchao)
            return make_hf_model("llama", str(self.work / "hf_llama"), hidden_size=s["dim"],
                                 intermediate_size=s["hidden_dim"], num_hidden_layers=s["n_layers"],
                                 num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv_heads"],
                                 vocab_size=s["vocab_size"], rope_scaling=None, rope_theta=500000.0,
                                 max_position_embeddings=4 * self.scale.seq, tie_word_embeddings=True)

    @functools.cached_property
    def hf_tokens(self) -> str:
        """Lines of text prepared with the model's tokenizer: > 40 global batches, 5% held out."""
        from framework.prepare import main as prepare

        text = self.work / "hf_text.txt"
        lines = 45 * self.scale.batch * self.scale.seq // 50
        text.write_text("".join(f"line {i}: the mesh trains one model, step after step\n" for i in range(lines)))
        assert prepare([str(text), "--tokenizer", self.hf_model, "--out", str(self.work / "hf_tokens")]) == 0
        return str(self.work / "hf_tokens")

    @functools.cached_property
    def grpo_data(self) -> dict:
        return grpo.make_data(self.work, self.hf_model)

    @functools.cached_property
    def documents(self) -> str:
        """This Python's standard library sources as byte tokens, a document each (packed windows
        then hold several documents and cut some), as bench/long_context.py's."""
        from framework.prepare import main as prepare

        texts = self.work / "texts"
        texts.mkdir(exist_ok=True)
        for source in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:80]:
            (texts / (Path(source).stem + ".txt")).write_bytes(Path(source).read_bytes())
        assert prepare([str(texts), "--out", str(self.work / "documents")]) == 0
        return str(self.work / "documents")


def hf_cmd(scale: Scale, shared: Shared, recipe: str) -> Callable[[Path], list]:
    """A random 1B-shaped Hugging Face Llama through recipe=finetune_hf or lora_hf on one GPU."""
    return lambda out: train_cmd([f"recipe={recipe}", f"model.path={shared.hf_model}", f"data.path={shared.hf_tokens}",
                                  f"data.dataset.seq_len={scale.seq}", f"data.global_batch_size={scale.batch}",
                                  "data.document_masking=false", "parallel.dp_strategy=replicate",
                                  *common(scale, scale.hf_steps, out)])


def masking_cmd(scale: Scale, shared: Shared, masking: bool) -> Callable[[Path], list]:
    """lm_bench on packed documents (bench/long_context.py's overrides), block-causal or causal."""
    def command(out: Path) -> list:
        base = with_overrides(lm_files_overrides(shared.documents, scale.seq, masking), model="lm_bench",
                              data__global_batch_size=scale.batch, launcher__threads_per_rank=None)
        return train_cmd([*base, *model_keys(scale.bench), *common(scale, scale.steps, out)])
    return command


def grpo_framework_cmd(scale: Scale, shared: Shared) -> Callable[[Path], list]:
    """bench/grpo.py's framework side (full fine-tuning, 8 prompts x 8 completions), on the
    device, bf16 on a GPU as TRL's side there."""
    def command(out: Path) -> list:
        cmd = grpo.framework_cmd("full1", shared.grpo_data, scale.grpo_steps, scale.new_tokens, out)
        precision = "bf16" if scale.device == "cuda" else "null"
        return with_overrides(cmd, mesh__device_type=scale.device, trainer__mixed_precision=precision)
    return command


def grpo_peer_cmd(scale: Scale, shared: Shared) -> Callable[[Path], list]:
    return lambda out: grpo.peer_cmd("full1", shared.grpo_data, scale.grpo_steps, scale.new_tokens, out)


def read_peer(out: Path) -> dict:
    return json.loads((out / "peer.json").read_text())


def read_grpo(side: str) -> Callable[[Path], dict]:
    return lambda out: grpo.measured(side, out, 1)


def has_key(overrides: list, key: str) -> bool:
    """Whether the config these overrides compose has `key` (a feature another change adds)."""
    from omegaconf import OmegaConf

    from framework.cli import compose_config

    return OmegaConf.select(compose_config(overrides), key, default=KeyError) is not KeyError


def rows(scale: Scale, work: Path) -> list:
    """Every row, in the order they run: the budget cuts the last ones first."""
    shared = Shared(scale, work)
    native_tokens = scale.batch * scale.seq
    native = flops_per_token(scale.native, scale.seq)
    hf = flops_per_token(scale.hf, scale.seq)
    train = dict(tokens=native_tokens, flops_per_token=native)
    bench = dict(tokens=native_tokens, flops_per_token=flops_per_token(scale.bench, scale.seq))
    return [
        Row("native eager", native_cmd(scale, "none"), read_summary, 30, 120, **train,
            note=f"ln V = {lnv(scale.native):.2f}"),
        Row("peer eager", peer_cmd(scale, False), read_peer, 30, 120, **train, note="transformers, SDPA"),
        Row("native compiled", native_cmd(scale, "blocks"), read_summary, 45, 150, **train),
        Row("lm_bench causal", masking_cmd(scale, shared, False), read_summary, 25, 120, **bench),
        Row("lm_bench doc masking", masking_cmd(scale, shared, True), read_summary, 30, 150, **bench),
        Row("hf finetune_hf", hf_cmd(scale, shared, "finetune_hf"), read_summary, 50, 150, tokens=native_tokens,
            flops_per_token=hf, note=f"vocab {scale.hf['vocab_size']}"),
        Row("hf lora_hf", hf_cmd(scale, shared, "lora_hf"), read_summary, 30, 120, tokens=native_tokens,
            flops_per_token=hf, note="MFU as 6N"),
        Row("grpo framework", grpo_framework_cmd(scale, shared), read_grpo("framework"), 45, 150, kind="grpo"),
        Row("grpo TRL", grpo_peer_cmd(scale, shared), read_grpo("peer"), 45, 150, kind="grpo"),
        Row("peer compiled", peer_cmd(scale, True), read_peer, 80, 150, **train, note="torch.compile(model)"),
    ] + optional_rows(scale, train)


def optional_rows(scale: Scale, train: dict) -> list:
    """The native compiled row with one setting of an issue-66 feature the framework may not have
    yet: the loss over the whole logits (the default on a GPU at this vocabulary is by chunks),
    float8. Skipped, saying so, where the composed config lacks its key."""
    def feature(name: str, key: str, value: str) -> Row:
        def command(out: Path) -> list:
            base = native_overrides(scale, "blocks", out)
            if not has_key(base, key):
                raise Skip(f"this framework has no {key}")
            return train_cmd([*base, f"{key}={value}"])
        return Row(name, command, read_summary, 45, 150, **train)

    return [feature("native compiled whole logits", "trainer.loss_chunk_tokens", "0"),
            feature("native compiled float8", "float8", "tensorwise")]


class Skip(Exception):
    """A row that does not apply here (its feature is absent): not a failure."""


def lnv(shape: dict) -> float:
    import math

    return math.log(shape["vocab_size"])


def step_s(times: list) -> float:
    """The median step after the first (which compiles and warms caches)."""
    return statistics.median(times[1:] or times)
