"""Hugging Face models (framework/models/hf.py) against transformers itself, the reference:
logits, loss and gradients on one process and sharded, verify, bad directories refused."""
import json
import os
import shutil

import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, DistributedSampler

from framework.config.errors import ConfigError
from framework.config.validate import validate
from framework.launch.handoff import rank_config
from framework.launch.local import spawn_ranks
from framework.models import NextTokenLoss
from framework.models.hf import HFTransformer, hf_name, load_hf_weights
from tests.conftest import compose_config, run_cli
from tests.hf_models import ARCHITECTURES, make_hf_model, reference
from tests.workers import one_step_gradients

pytest.importorskip("transformers")

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf_model(kind, str(root / kind)) for kind in ARCHITECTURES}


def hf_config(path: str, *overrides: str):
    return compose_config(["recipe=lm_2d", "model=hf", f"model.path={path}", "data.dataset.max_bytes=65536",
                           "data.dataset.seq_len=32", "data.global_batch_size=8", "trainer.progress_bar=false",
                           "optim=sgd", "~optim.betas", *overrides])


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def loaded(path: str) -> HFTransformer:
    """One process, no process group: built on meta, allocated, weights read by DCP's HF reader."""
    model = HFTransformer(path)
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


def reference_step(path: str, inputs: torch.Tensor, targets: torch.Tensor):
    """transformers' model: loss and gradients (by Hugging Face name) of one batch."""
    model = reference(path)
    loss = NextTokenLoss()(model(inputs).logits, targets)
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
    loss = NextTokenLoss()(ours(inputs), targets)
    loss.backward()
    ref_loss, ref_grads = reference_step(path, inputs, targets)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    for name, p in ours.named_parameters():
        assert relative_error(p.grad, ref_grads[hf_name(name)]) <= 1e-5, name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,mesh,overrides", [
    ("llama", "1x2", ["plan=lm_tp_sp"]),
    ("qwen3", "2x2", ["plan=qk_norm_tp_sp"]),  # q/k norms and a tied output under TP+SP and DP
    ("mistral", "1x2", ["plan=lm_tp_sp_loss_parallel"]),
    ("qwen2", "2x1", ["plan=none", "parallel.dp_strategy=fsdp"]),
])
def test_sharded_logits_loss_and_gradients_equal_transformers(kind, mesh, overrides, hf_dirs, tmp_path):
    path = hf_dirs[kind]
    cfg = hf_config(path, f"mesh={mesh}", *overrides)
    validate(cfg)
    ranks = cfg.mesh.shape[0] * cfg.mesh.shape[1]
    result = spawn_ranks(ranks, one_step_gradients, rank_config(cfg), str(tmp_path), TOKENS)[0]
    with torch.no_grad():
        logits_error = relative_error(result["logits"], reference(path)(TOKENS).logits)
    ref_loss, ref_grads = reference_step(path, *first_global_batch(cfg))
    grad_error = max(relative_error(g, ref_grads[hf_name(name)]) for name, g in result["grads"].items())
    print(f"{kind} {mesh} {overrides}: logits {logits_error:.1e}, loss {abs(result['loss'] - ref_loss):.1e}, "
          f"gradients {grad_error:.1e}")
    assert logits_error <= 1e-5
    assert abs(result["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)
    assert grad_error <= 1e-5
