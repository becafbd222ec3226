"""float8 (framework.models.float8): which layers torchao's Float8Linear replaces, the
one-step loss and gradients against the unconverted model (float8 is lossy: bounded at 10x the
error measured on this host), the same step under TP 1x2 and FSDP2 2x1 against the one-rank
float8 step, and the refusals before launch. torch 2.13's CPU runs torch._scaled_mm on float8
e4m3 inputs, so all of it runs without a GPU."""
import importlib.util
import logging
import math
import re

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.tensor import DTensor

from framework.config.errors import ConfigError
from framework.launch.local import spawn_ranks
from framework.models import float8
from framework.models.float8 import apply_float8
from framework.models.lifecycle import new_model
from framework.training.builder import build_and_run
from framework.validate import validate
from tests.conftest import TINY_LM, compose_config, run_cli
from tests import workers
from tests.workers import one_step_gradients

# Per test (the refusals without torchao run without it): what converts or checks a device needs it.
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao not installed (pip install -e '.[float8]')")

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


def is_float8(module: nn.Module) -> bool:
    """Whether torchao converted this layer (by name: torchao is imported only where it is installed)."""
    return type(module).__name__ == "Float8Linear"


@needs_torchao
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_every_block_linear_becomes_float8_but_the_output_projection(device):
    model = new_model(compose_config(F8).model, device, seed=0)
    converted = apply_float8(model, "tensorwise")
    assert converted == [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert not is_float8(model.output) and isinstance(model.output, nn.Linear)
    assert all(is_float8(module) == (name in converted) for name, module in model.named_modules())
    assert all(p.device.type == device for p in model.parameters())  # weights kept where they were


@needs_torchao
def test_a_linear_whose_dims_are_not_whole_tiles_stays_as_it_was(caplog):
    model = nn.ModuleDict({"a": nn.Linear(32, 48), "b": nn.Linear(24, 32), "c": nn.Linear(32, 40),
                           "lm_head": nn.Linear(32, 64)})
    weight = model["a"].weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="framework"):
        assert apply_float8(model, "rowwise") == ["a"]
    assert [type(m).__name__ for m in model.values()] == ["Float8Linear", "Linear", "Linear", "Linear"]
    assert torch.equal(model["a"].weight, weight)
    assert caplog.messages == ["float8=rowwise: 1 linear layers as Float8Linear: a"]


@needs_torchao
def test_the_run_says_what_float8_converted(caplog):
    with caplog.at_level(logging.INFO, logger="framework"):
        apply_float8(new_model(compose_config(F8).model, "meta", seed=0), "tensorwise")
    assert caplog.messages == ["float8=tensorwise: 14 linear layers as Float8Linear: "
                               + ", ".join(f"layers.*.{name}" for name in BLOCK_LINEARS)]


@needs_torchao
def test_float8_that_converts_nothing_says_so(caplog):
    model = new_model(compose_config([*F8, "model=seed_linear"]).model, "cpu", seed=0)  # a Linear(12, 12)
    assert apply_float8(model, "tensorwise") == []
    assert [(r.levelname, r.message) for r in caplog.records] == [
        ("WARNING", "float8=tensorwise converted no layer of Linear: float8 takes an nn.Linear (not the "
                    "output projection) whose dims are both multiples of 16, and it has none; it trains unconverted")]


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
        ONE_RANK[recipe] = one_step([*F8, f"float8={recipe}"], tmp_path_factory.mktemp(recipe), recipe)
    return ONE_RANK[recipe]


@needs_torchao
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


# The gradient's relative error against the unconverted one-rank step, measured: a float8 step's
# 4.4e-3 (FSDP2 tensorwise), 5.3e-3 (TP tensorwise), an unconverted FSDP2 step's 4.9e-7 (float32
# rounding). A float8 step must be this far from the unconverted one (a tenth of float8's error).
UNCONVERTED_MARGIN = 3e-4


def float8_step(cfg_container: dict, out_dir: str) -> dict:
    """In each rank: one_step_gradients, and what the float8 stage made: each Float8Linear by name,
    with whether FSDP2 gathers its weight in float8 and the type of the weight's local shard."""
    float8_layers = {}

    def build(*args, **kwargs):
        run = build_and_run(*args, **kwargs)
        for name, module in run.module.named_modules():
            if is_float8(module):
                weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
                float8_layers[name] = (module.config.enable_fsdp_float8_all_gather, type(weight).__name__)
        return run

    workers.build_and_run = build  # (in this rank's process alone)
    return {**one_step_gradients(cfg_container, out_dir), "float8": float8_layers}


@needs_torchao
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,recipe", [
    ("tp 1x2", "tensorwise"), ("fsdp 2x1", "tensorwise"),
    pytest.param("tp 1x2", "rowwise", marks=pytest.mark.integration),
    pytest.param("fsdp 2x1", "rowwise", marks=pytest.mark.integration)])
def test_float8_under_tp_and_fsdp_is_close_to_the_one_rank_float8_step(layout, recipe, tmp_path_factory, tmp_path):
    cfg = OmegaConf.to_container(compose_config([*F8, *LAYOUTS[layout], f"float8={recipe}"]), resolve=True)
    result = spawn_ranks(2, float8_step, cfg, str(tmp_path / "run"))[0]
    loss, grads = relative_errors(result, one_rank_step(recipe, tmp_path_factory))
    loss_bound, grad_bound = LAYOUT_BOUNDS[layout, recipe]
    assert loss <= loss_bound and grads <= grad_bound, (loss, grads)
    assert list(result["float8"]) == [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    gathered = layout.startswith("fsdp") and recipe == "tensorwise"  # (torchao casts rowwise after the gather)
    expected = (True, "WeightWithDynamicFloat8CastTensor") if gathered else (False, "Tensor")
    assert set(result["float8"].values()) == {expected}, result["float8"]
    _, unconverted = relative_errors(result, one_rank_step("null", tmp_path_factory))
    assert unconverted > UNCONVERTED_MARGIN, unconverted


REFUSALS = [
    (["float8=fp8"], r"float8='fp8': unknown recipe; choose tensorwise or rowwise \(null: off\)"),
    (["float8=rowwise", "adapter=lora"],
     r"float8='rowwise': not yet with adapter=lora / qlora: torchao swaps each converted layer"),
]


@pytest.mark.parametrize("overrides,line", REFUSALS, ids=["recipe", "lora"])
def test_a_float8_config_that_cannot_run_is_refused_by_validation(overrides, line):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([*F8, *overrides]))
    assert re.match("config error: " + line, str(refused.value)), str(refused.value)


def test_off_is_null_and_validates_and_the_old_key_says_where_it_went():
    cfg = compose_config([*F8, "float8=null"])
    assert float8.float8_recipe(cfg) is None
    validate(cfg)
    moved = "config error: trainer.float8='tensorwise': no such key; float8, a conversion of the model, moved to " \
            "the top level: float8=tensorwise"
    with pytest.raises(ConfigError, match=re.escape(moved)):
        validate(compose_config([*F8, "+trainer.float8=tensorwise"]))


def test_float8_without_torchao_names_the_extra(monkeypatch):
    def missing():
        raise ImportError("No module named 'torchao'")
    monkeypatch.setattr(float8, "_torchao", missing)
    with pytest.raises(ConfigError, match=re.escape("config error: float8='tensorwise': needs torchao "
                                                    "(pip install -e '.[float8]')")):
        validate(compose_config([*F8, "float8=tensorwise"]))


@needs_torchao
@pytest.mark.parametrize("capability,refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_older_than_sm89_is_refused(capability, refused, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    cfg = compose_config([*F8, "float8=tensorwise"])
    cfg.mesh.device_type = "cuda"
    checked = type("C", (), {"cfg": cfg})()
    if refused:
        with pytest.raises(ConfigError, match=re.escape("compute capability 8.9 or newer (Ada, Hopper); this one "
                                                        "is sm_80; use float8=null")):
            float8.check_float8(checked)
    else:
        float8.check_float8(checked)


@pytest.mark.timeout(120)
def test_an_unknown_recipe_is_refused_in_one_line_before_launch(tmp_path):
    result = run_cli([*F8, "float8=fp8", f"hydra.run.dir={tmp_path / 'job'}"], timeout=110)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: float8='fp8': unknown recipe; choose tensorwise or rowwise (null: off)"]
    assert not (tmp_path / "job").exists()
