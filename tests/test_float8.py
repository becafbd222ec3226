"""trainer.float8 (framework.models.float8): which layers torchao's Float8Linear replaces, the
one-step loss and gradients against the unconverted model (float8 is lossy: bounded at 10x the
error measured on this host), the same step under TP 1x2 and FSDP2 2x1 against the one-rank
float8 step, and the refusals before launch. torch 2.13's CPU runs torch._scaled_mm on float8
e4m3 inputs, so all of it runs without a GPU."""
import math
import re

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from framework.config.errors import ConfigError
from framework.launch.local import spawn_ranks
from framework.models import float8
from framework.models.float8 import apply_float8, is_float8
from framework.models.lifecycle import new_model
from framework.validate import validate
from tests.conftest import TINY_LM, compose_config, run_cli
from tests.workers import one_step_gradients

pytest.importorskip("torchao")

F8 = [*TINY_LM, "plan=none", "mesh=1x1"]
# lm_tiny: dim 32, hidden 64, 4 heads of 8, vocab 256, 2 blocks
BLOCK_LINEARS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
# measured on torch 2.13 CPU, torchao 0.18 (one step of lm_tiny against its fp32 step): relative
# loss error tensorwise 3.0e-5, rowwise 5.9e-7 (the untrained model's loss is near ln 256 whatever
# its logits); relative gradient error (all parameters as one vector) tensorwise 5.3e-3, rowwise
# 3.5e-3. Bounds at 10x, the loss's no tighter than rtol 1e-5.
LOSS_BOUND = {"tensorwise": 3e-4, "rowwise": 1e-5}
GRAD_BOUND = {"tensorwise": 5.3e-2, "rowwise": 3.5e-2}


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_every_block_linear_becomes_float8_but_the_output_projection(device):
    model = new_model(compose_config(F8).model, device, seed=0)
    converted = apply_float8(model, "tensorwise")
    assert converted == [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert not is_float8(model.output) and isinstance(model.output, nn.Linear)
    assert all(is_float8(module) == (name in converted) for name, module in model.named_modules())
    assert all(p.device.type == device for p in model.parameters())  # weights kept where they were


def test_a_linear_whose_dims_are_not_whole_tiles_stays_as_it_was():
    model = nn.ModuleDict({"a": nn.Linear(32, 48), "b": nn.Linear(24, 32), "c": nn.Linear(32, 40),
                           "lm_head": nn.Linear(32, 64)})
    weight = model["a"].weight.detach().clone()
    assert apply_float8(model, "rowwise") == ["a"]
    assert [type(m).__name__ for m in model.values()] == ["Float8Linear", "Linear", "Linear", "Linear"]
    assert torch.equal(model["a"].weight, weight)


def one_step(overrides: list, tmp_path, name: str) -> dict:
    cfg = OmegaConf.to_container(compose_config(overrides), resolve=True)
    return spawn_ranks(math.prod(cfg["mesh"]["shape"]), one_step_gradients, cfg, str(tmp_path / name))[0]


def relative_errors(result: dict, reference: dict) -> tuple:
    """The loss's relative error and the gradient's (all parameters' as one vector, in norm)."""
    loss = abs(float(result["loss"]) - float(reference["loss"])) / abs(float(reference["loss"]))
    names = sorted(reference["grads"])
    ours, theirs = (torch.cat([r["grads"][k].flatten() for k in names]) for r in (result, reference))
    grads = float((ours - theirs).norm() / theirs.norm())
    return loss, grads


ONE_RANK: dict = {}


def one_rank_step(recipe: str, tmp_path_factory) -> dict:
    """The one-rank step of `recipe` (null: unconverted), run once per module."""
    if recipe not in ONE_RANK:
        ONE_RANK[recipe] = one_step([*F8, f"trainer.float8={recipe}"], tmp_path_factory.mktemp(recipe), recipe)
    return ONE_RANK[recipe]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_float8_step_is_close_to_the_unconverted_step(recipe, tmp_path_factory):
    result, fp32 = one_rank_step(recipe, tmp_path_factory), one_rank_step("null", tmp_path_factory)
    loss, grads = relative_errors(result, fp32)
    assert set(result["grads"]) == set(fp32["grads"])
    assert 0 < loss < LOSS_BOUND[recipe] and 0 < grads < GRAD_BOUND[recipe], (loss, grads)  # lossy, not by much


LAYOUTS = {"tp 1x2": ["mesh=1x2", "plan=lm_tp"], "fsdp 2x1": ["mesh=2x1", "parallel.dp_strategy=fsdp"]}
# Against the one-rank float8 step of the recipe; measured (loss, gradient relative errors), bounds
# at 10x (no tighter than 1e-5). TP: the same but for the shards' summation order (a tensorwise
# scale's amax is reduced over the shards): tensorwise (0, 3.5e-8), rowwise (8.4e-8, 4.4e-5).
# FSDP2: its weights gathered in float8 (tensorwise); each DP rank scales its own half of the
# batch's activations, so tensorwise rounds differently: (3.0e-6, 3.1e-3); rowwise (0, 1.7e-4).
LAYOUT_BOUNDS = {("tp 1x2", "tensorwise"): (1e-5, 1e-5), ("tp 1x2", "rowwise"): (1e-5, 4.4e-4),
                 ("fsdp 2x1", "tensorwise"): (3e-5, 3.1e-2), ("fsdp 2x1", "rowwise"): (1e-5, 1.7e-3)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,recipe", [
    ("tp 1x2", "tensorwise"), ("fsdp 2x1", "tensorwise"),
    pytest.param("tp 1x2", "rowwise", marks=pytest.mark.integration),
    pytest.param("fsdp 2x1", "rowwise", marks=pytest.mark.integration)])
def test_float8_under_tp_and_fsdp_is_close_to_the_one_rank_float8_step(layout, recipe, tmp_path_factory, tmp_path):
    result = one_step([*F8, *LAYOUTS[layout], f"trainer.float8={recipe}"], tmp_path, "run")
    loss, grads = relative_errors(result, one_rank_step(recipe, tmp_path_factory))
    loss_bound, grad_bound = LAYOUT_BOUNDS[layout, recipe]
    assert loss <= loss_bound and grads <= grad_bound, (loss, grads)


REFUSALS = [
    (["trainer.float8=fp8"], r"trainer.float8='fp8': unknown recipe; choose tensorwise or rowwise \(null: off\)"),
    (["trainer.float8=rowwise", "adapter=lora"],
     r"trainer.float8='rowwise': not yet with adapter=lora / qlora: torchao swaps each converted layer"),
]


@pytest.mark.parametrize("overrides,line", REFUSALS, ids=["recipe", "lora"])
def test_a_float8_config_that_cannot_run_is_refused_by_validation(overrides, line):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([*F8, *overrides]))
    assert re.match("config error: " + line, str(refused.value)), str(refused.value)


def test_off_is_null_or_false_and_validates():
    for value in ("null", "false"):
        cfg = compose_config([*F8, f"trainer.float8={value}"])
        assert float8.float8_recipe(cfg.trainer) is None
        validate(cfg)


def test_float8_without_torchao_names_the_extra(monkeypatch):
    def missing():
        raise ImportError("No module named 'torchao'")
    monkeypatch.setattr(float8, "_torchao", missing)
    with pytest.raises(ConfigError, match=re.escape("config error: trainer.float8='tensorwise': needs torchao "
                                                    "(pip install -e '.[float8]')")):
        validate(compose_config([*F8, "trainer.float8=tensorwise"]))


@pytest.mark.parametrize("capability,refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_older_than_sm89_is_refused(capability, refused, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    cfg = compose_config([*F8, "trainer.float8=tensorwise"])
    cfg.mesh.device_type = "cuda"
    checked = type("C", (), {"cfg": cfg})()
    if refused:
        with pytest.raises(ConfigError, match=re.escape("compute capability 8.9 or newer (Ada, Hopper); this one "
                                                        "is sm_80; use trainer.float8=null")):
            float8.check_float8(checked)
    else:
        float8.check_float8(checked)


@pytest.mark.timeout(120)
def test_an_unknown_recipe_is_refused_in_one_line_before_launch(tmp_path):
    result = run_cli([*F8, "trainer.float8=fp8", f"hydra.run.dir={tmp_path / 'job'}"], timeout=110)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: trainer.float8='fp8': unknown recipe; choose tensorwise or rowwise (null: off)"]
    assert not (tmp_path / "job").exists()
