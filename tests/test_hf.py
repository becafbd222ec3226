"""Hugging Face models (framework/models/hf.py) against transformers itself, the reference:
logits, loss and gradients on one process and sharded, verify, bad directories refused."""
import json
import os
import re
import shutil

import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, DistributedSampler

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.launch.handoff import rank_config
from framework.export import load_model
from framework.generate import generate, main as generate_main
from framework.launch.local import launch_local, spawn_ranks
from framework.checkpoint.weights import load_hf_weights
from framework.models.hf import HFTransformer, hf_name
from framework.models.hf_export import save_hf
from framework.prepare import main as prepare
from tests.conftest import ROOT, compose_config, run_cli
from tests.errors import relative_error
from tests.hf_models import ARCHITECTURES, reference
from tests.workers import one_step_gradients

import transformers  # noqa: F401  (the dev extra: a broken install fails, never skips)

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def hf_config(path: str, *overrides: str):
    return compose_config(["recipe=lm_2d", "model=hf", f"model.path={path}", "data.dataset.max_bytes=65536",
                           "data.dataset.seq_len=32", "data.global_batch_size=8", "trainer.progress_bar=false",
                           "optim=sgd", "~optim.betas", *overrides])


def loaded(path: str, **options) -> HFTransformer:
    """One process, no process group: built on meta, allocated, weights read by DCP's HF reader."""
    model = HFTransformer(path, **options)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_hf_weights(model, path)
    return model


def first_global_batch(cfg):
    """The first global batch as one process draws it (the framework's sampler promises every
    mesh the same)."""
    dataset = instantiate(cfg.data.dataset)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=cfg.sampler.shuffle,
                                 seed=cfg.sampler.seed, drop_last=True)
    return next(iter(DataLoader(dataset, batch_size=cfg.data.global_batch_size, sampler=sampler)))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def reference_step(path: str, inputs: torch.Tensor, targets: torch.Tensor):
    """transformers' model: loss and gradients (by Hugging Face name) of one batch."""
    model = reference(path)
    loss = cross_entropy(model(inputs).logits, targets)
    loss.backward()
    return float(loss), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_logits_loss_and_gradients_equal_transformers_on_one_process(kind, hf_dirs):
    path = hf_dirs[kind]
    ours, theirs = loaded(path), reference(path)
    with torch.no_grad():
        error = relative_error(ours(TOKENS), theirs(TOKENS).logits)
    print(f"{kind}: logits relative error {error:.1e}")
    assert error <= 1e-5
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    loss = cross_entropy(ours(inputs), targets)
    loss.backward()
    ref_loss, ref_grads = reference_step(path, inputs, targets)
    assert relative_error(float(loss), ref_loss) <= 1e-5
    for name, p in ours.named_parameters():  # transformers' kernels, another order: measured 2.8e-6
        assert relative_error(p.grad, ref_grads[hf_name(name)]) <= 1e-4, name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,mesh,overrides", [
    ("llama", "1x2", ["plan=lm_tp_sp"]),
    ("qwen3", "2x2", ["plan=qk_norm_tp_sp"]),  # q/k norms and a tied output under TP+SP and DP
    pytest.param("mistral", "1x2", ["plan=lm_tp_sp_loss_parallel"], marks=pytest.mark.integration),  # (test_lm's
    ("qwen2", "2x1", ["plan=none", "parallel.dp_strategy=fsdp"]),                                  # loss parallel)
])
def test_sharded_logits_loss_and_gradients_equal_transformers(kind, mesh, overrides, hf_dirs, tmp_path):
    logits_error, loss_error, grad_error = sharded_step_errors(hf_dirs[kind], hf_config(hf_dirs[kind], f"mesh={mesh}",
                                                                                        *overrides), tmp_path, hf_name)
    assert logits_error <= 1e-5  # measured 3.5e-7
    assert loss_error <= 1e-5  # measured 2.6e-7
    assert grad_error <= 5e-5  # measured 7.1e-7


def sharded_step_errors(path: str, cfg, tmp_path, hf_name_of) -> tuple:
    """The relative errors against transformers on one process of the run's logits on TOKENS, and
    of its first global batch's loss and gradients (named for transformers by `hf_name_of`)."""
    validate(cfg)
    ranks = cfg.mesh.shape[0] * cfg.mesh.shape[1]
    result = spawn_ranks(ranks, one_step_gradients, rank_config(cfg), str(tmp_path), TOKENS)[0]
    with torch.no_grad():
        logits_error = relative_error(result["logits"], reference(path)(TOKENS).logits)
    ref_loss, ref_grads = reference_step(path, *first_global_batch(cfg))
    grad_error = max(relative_error(g, ref_grads[hf_name_of(name)]) for name, g in result["grads"].items())
    errors = logits_error, relative_error(result["loss"], ref_loss), grad_error
    print(f"{list(cfg.mesh.shape)}: logits {errors[0]:.1e}, loss {errors[1]:.1e}, gradients {errors[2]:.1e}")
    return errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,mesh,plan", [("llama", "2x2", "lm_tp"),
                                            pytest.param("mistral", "1x2", "lm_tp_sp", marks=pytest.mark.integration),
                                            pytest.param("qwen2", "1x2", "lm_tp_sp_loss_parallel",
                                                         marks=pytest.mark.integration),
                                            pytest.param("qwen3", "1x2", "qk_norm_tp_sp", marks=pytest.mark.integration)])
def test_verify_passes_for_each_shipped_plan(kind, mesh, plan, hf_dirs):
    config = hf_config(hf_dirs[kind])  # the same overrides, on verify's command line
    result = run_cli(["recipe=lm_2d", "model=hf", f"model.path={hf_dirs[kind]}", f"mesh={mesh}", f"plan={plan}",
                      "data.dataset.max_bytes=65536", f"data.dataset.seq_len={config.data.dataset.seq_len}",
                      "data.global_batch_size=8"], module="framework.verify")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK" in result.stdout


def _rewrite_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _copy(hf_dirs, kind, tmp_path) -> str:
    return str(shutil.copytree(hf_dirs[kind], tmp_path / kind))


def _index_naming_a_missing_shard(path: str) -> None:
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00002.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _grow_tokenizer(path: str) -> None:
    """The tokenizer.json in `path` grown to 512 tokens, twice the tiny models' vocab_size."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(256)])
    tokenizer.save(os.path.join(path, "tokenizer.json"))


@pytest.mark.parametrize("case,match", [
    ("no_config", "holds no config.json"),
    ("model_type", r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"),
    ("rope", r"rope scaling type 'yarn' is not implemented"),
    ("window", r"data.dataset.seq_len=32: exceeds the model's sliding_window=16"),
    ("sliding_qwen", r"sets use_sliding_window: true"),
    ("shape", r"the safetensors' model.embed_tokens.weight has shape \[256, 64\], config.json implies \[512, 64\]"),
    ("missing_shard", r"model.safetensors.index.json names model-00002-of-00002.safetensors, which is missing"),
    ("max_positions", r"data.dataset.seq_len=512: exceeds config.json's max_position_embeddings=256 \(in .*llama\), "
                      r"the longest sequence the model was trained on; use at most 256 tokens, or set "
                      r"\+model.max_positions=512 to go past it"),
    ("renamed", r"the safetensors lack model.layers.1.mlp.up_proj.weight \(shape \[96, 64\]\), which config.json implies"),
    ("kv_heads", r"model.n_kv_heads=2: the TP plan splits it across 4 ranks"),
    ("tied_layout", r"plan.output='rowwise': the model ties its output to tok_embeddings \(rowwise here\)"),
])
def test_bad_model_directory_is_refused_before_launch_naming_what(case, match, hf_dirs, tmp_path):
    kind = {"window": "mistral", "sliding_qwen": "qwen2", "tied_layout": "qwen3"}.get(case, "llama")
    path = _copy(hf_dirs, kind, tmp_path)
    # (what the native path does not implement: auto would take transformers' classes)
    overrides = ["model.backend=native"] if case in ("model_type", "rope", "sliding_qwen") else []
    if case == "no_config":
        os.remove(os.path.join(path, "config.json"))
    elif case == "model_type":
        _rewrite_config(path, model_type="gpt2")
    elif case == "rope":
        _rewrite_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    elif case == "window":
        _rewrite_config(path, sliding_window=16)
    elif case == "sliding_qwen":
        _rewrite_config(path, use_sliding_window=True, sliding_window=16)
    elif case == "shape":
        _rewrite_config(path, vocab_size=512)
    elif case == "missing_shard":
        _index_naming_a_missing_shard(path)
    elif case == "max_positions":
        overrides = ["data.dataset.seq_len=512"]
    elif case == "renamed":
        from safetensors.torch import load_file, save_file

        tensors = load_file(os.path.join(path, "model.safetensors"))
        tensors["model.layers.1.mlp.up.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
        save_file(tensors, os.path.join(path, "model.safetensors"))
    elif case == "kv_heads":
        overrides = ["mesh=1x4", "plan=lm_tp_sp"]
    elif case == "tied_layout":
        overrides = ["mesh=1x2", "plan=qk_norm_tp_sp", "plan.output.style=rowwise"]
    with pytest.raises(ConfigError, match=match):
        validate(hf_config(path, *overrides))


def test_token_data_of_a_tokenizer_larger_than_the_model_is_refused_before_launch(hf_dirs, prepared, tmp_path):
    path, tokens = _copy(hf_dirs, "llama", tmp_path), str(tmp_path / "tokens")
    _grow_tokenizer(path)
    assert prepare([os.path.join(os.path.dirname(prepared["packed"]), "text.txt"), "--tokenizer", path,
                    "--out", tokens]) == 0
    cfg = compose_config(["recipe=finetune_hf", f"model.path={path}", f"data.path={tokens}", "data.dataset.seq_len=64"])
    with pytest.raises(ConfigError, match=re.escape(
            f"model.path='{path}': config.json's vocab_size=256 is smaller than the vocabulary (512) of "
            f"{path}/tokenizer.json, which the token data in {tokens} comes from: its ids from 256 on have no "
            f"embedding; use a tokenizer of at most 256 tokens, the one the model was trained with")):
        validate(cfg)


def test_max_positions_lets_a_run_go_past_max_position_embeddings_and_its_export_says_so(hf_dirs, tmp_path):
    validate(hf_config(hf_dirs["llama"], "data.dataset.seq_len=512", "data.dataset.max_bytes=262144",
                       "+model.max_positions=512"))
    out = str(tmp_path / "exported")
    save_hf(loaded(hf_dirs["llama"], max_positions=512), out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["max_position_embeddings"] == 512
    assert generate_main([out, "--prompt", "hi", "--max-new-tokens", "300"]) == 0


def test_a_relative_model_path_is_stored_absolute(hf_dirs, monkeypatch):
    """What the ranks run and a checkpoint saves: export and generate find the model from any
    directory, and so does an interpolation of it (recipes/finetune_hf.yaml's data.tokenizer)."""
    monkeypatch.chdir(os.path.dirname(hf_dirs["llama"]))
    cfg = hf_config("llama", "data.tokenizer=${model.path}")
    validate(cfg)
    saved = rank_config(cfg)
    assert saved["model"]["path"] == saved["data"]["tokenizer"] == hf_dirs["llama"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path,fix", [
    (None, "'???': not given; name the Hugging Face model directory on the command line: model.path=DIR"),
    ("no_such_model", "'{root}/no_such_model': no such directory; point it at a Hugging Face model directory"),
])
def test_finetune_without_a_model_directory_is_one_line_naming_model_path_and_writes_nothing(path, fix, hf_dirs,
                                                                                             tmp_path):
    given = [f"model.path={path}"] if path else []
    result = run_cli(["recipe=finetune_hf", f"data.path={hf_dirs['tokens']}", f"hydra.run.dir={tmp_path / 'job'}",
                      *given], timeout=100)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"config error: model.path={fix.format(root=ROOT)} (config.json, *.safetensors, "
                             f"tokenizer.json)\n")
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("case,argv,fix", [
    ("vocab", [], "SOURCE='{path}': config.json's vocab_size=256 is smaller than the vocabulary (512) of "
                  "{path}/tokenizer.json: its ids from 256 on have no embedding; use a tokenizer of at most 256 "
                  "tokens, the one the model was trained with"),
    ("missing_shard", [], "SOURCE='{path}': model.safetensors.index.json names model-00002-of-00002.safetensors, "
                          "which is missing"),
    ("long", ["--max-new-tokens", "300"],
     "--max-new-tokens=300: with the prompt's 2 tokens, exceeds config.json's max_position_embeddings=256 (in "
     "{path}), the longest sequence the model was trained on; use at most 254 tokens"),
])
def test_generate_refuses_a_model_directory_as_train_does_in_one_line_naming_source(case, argv, fix, hf_dirs,
                                                                                    tmp_path, capsys):
    path = _copy(hf_dirs, "llama", tmp_path)
    if case == "vocab":
        _grow_tokenizer(path)
    elif case == "missing_shard":
        _index_naming_a_missing_shard(path)
    assert generate_main([path, "--prompt", "hi", *argv]) == 2
    assert capsys.readouterr().err == f"config error: {fix.format(path=path)}\n"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_generation_with_kv_cache_equals_transformers_generate(kind, hf_dirs):
    prompt = TOKENS[0, :8].tolist()
    ours = generate(loaded(hf_dirs[kind]), prompt, max_new_tokens=32, stop={0})
    output = reference(hf_dirs[kind]).generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                               eos_token_id=0, pad_token_id=0)
    theirs = output[0, len(prompt):].tolist()
    theirs = theirs[: theirs.index(0) + 1] if 0 in theirs else theirs
    print(f"{kind}: {len(ours)} new tokens")
    assert ours == theirs


@pytest.fixture(scope="module")
def trained_qwen3(hf_dirs, tmp_path_factory) -> str:
    """Checkpoints of 2 TP+SP steps from the tiny Qwen3 (tied output, q/k norms) on 1x2; the run
    also writes its final model as a Hugging Face directory (checkpoint.final_hf), in <run>/hf."""
    out = tmp_path_factory.mktemp("qwen3_run")
    cfg = hf_config(hf_dirs["qwen3"], "mesh=1x2", "plan=qk_norm_tp_sp", "trainer.max_steps=2", "checkpoint.every=2",
                    "logger.tensorboard=false", "checkpoint.final_hf=true")
    launch_local(cfg, str(out))
    return str(out / "checkpoints")


def transformers_logits_error(hf_dir, checkpoints: str) -> float:
    """transformers loads hf_dir with no missing, unexpected or mismatched key; the relative
    error of its logits against the checkpoint's model."""
    from transformers import AutoModelForCausalLM

    theirs, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    ours, _, _ = load_model(checkpoints)
    with torch.no_grad():
        return relative_error(ours(TOKENS), theirs(TOKENS).logits)


def test_export_hf_loads_in_transformers_without_missing_keys_and_equal_logits(trained_qwen3, tmp_path):
    out = tmp_path / "exported"
    result = run_cli([trained_qwen3, str(out), "--format", "hf", "--max-shard-gb", "0.0002"],
                     module="framework.export")
    assert result.returncode == 0, result.stderr
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(os.listdir(out))
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1  # split into shards
    assert transformers_logits_error(out, trained_qwen3) <= 1e-5
    again = run_cli([trained_qwen3, str(out), "--format", "hf"], module="framework.export")
    assert again.returncode == 2 and "exists and is not an empty directory" in again.stderr


def test_a_sharded_run_writes_its_final_model_as_a_hugging_face_directory(trained_qwen3):
    out = os.path.join(os.path.dirname(trained_qwen3), "hf")
    log = open(os.path.join(os.path.dirname(trained_qwen3), "logs", "rank0.log")).read()
    assert f"the final model as a Hugging Face directory (checkpoint.final_hf): {out}\n" in log  # said, not silent
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert transformers_logits_error(out, trained_qwen3) <= 1e-5


@pytest.mark.timeout(240)
def test_a_pipeline_run_writes_its_final_model_from_every_stage(hf_dirs, tmp_path):
    """Llama's 2 layers on 2 pipeline stages: each rank writes its stage's tensors, and rank 0
    joins them into one model.safetensors that transformers loads whole."""
    cfg = hf_config(hf_dirs["llama"], "mesh=pp2x1x1", "plan=none", "trainer.max_steps=2", "checkpoint.every=2",
                    "logger.tensorboard=false", "checkpoint.final_hf=true")
    launch_local(cfg, str(tmp_path))
    assert "model.safetensors" in os.listdir(tmp_path / "hf")
    assert transformers_logits_error(tmp_path / "hf", str(tmp_path / "checkpoints")) <= 1e-5


def test_generate_cli_prints_the_prompt_and_its_greedy_continuation(trained_qwen3, hf_dirs):
    ours, _, _ = load_model(trained_qwen3)
    prompt = "def main():"
    expected = generate(ours, list(prompt.encode()), max_new_tokens=12, stop={0})
    result = run_cli([trained_qwen3, "--prompt", prompt, "--max-new-tokens", "12"], module="framework.generate")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == prompt + bytes(t for t in expected if t).decode("utf-8", errors="replace")


def test_init_from_a_checkpoint_of_another_architecture_is_refused(trained_qwen3, hf_dirs, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.init_from=.*model key 'layers.0.attention.wq.weight' has "
                                          r"shape \[128, 64\] there but \[64, 64\] in this model"):
        validate(hf_config(hf_dirs["llama"], f"checkpoint.init_from={trained_qwen3}"), out_dir=str(tmp_path))


@pytest.mark.timeout(240)
def test_the_finetune_recipe_trains_a_hugging_face_model_on_its_tokenizers_data(hf_dirs, tmp_path):
    """recipes/finetune_hf.yaml as shipped (2x2: FSDP x TP+SP, bf16, AdamW with warmup,
    evaluation, checkpoints), on the tiny Llama and text prepared with its tokenizer.json."""
    cfg = compose_config(["recipe=finetune_hf", f"model.path={hf_dirs['llama']}", f"data.path={hf_dirs['tokens']}",
                          "data.dataset.seq_len=64", "trainer.max_steps=4", "trainer.warmup_steps=2",
                          "trainer.eval_every=2", "trainer.eval_batches=1", "checkpoint.every=4",
                          "trainer.progress_bar=false", "logger.tensorboard=false"])
    summary = launch_local(cfg, str(tmp_path))
    assert len(summary["losses"]) == 4 and len(summary["val_losses"]) == 2
    assert os.path.isdir(tmp_path / "checkpoints" / "step_4")
