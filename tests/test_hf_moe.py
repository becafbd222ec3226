"""Hugging Face mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral; framework/models/hf.py)
against transformers itself: logits, loss, gradients and the load-balancing loss on one
process, the files' one-tensor-per-expert names in and out, each expert-parallel rank reading
and writing only its own experts, and config.json fields that are not implemented refused."""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.launch.handoff import rank_config
from framework.launch.local import launch_local, spawn_ranks
from framework.checkpoint.weights import load_hf_weights
from framework.models.hf import HFTransformer, hf_state_dict, materialize, model_state_dict
from framework.models.hf_export import save_hf, save_hf_sharded
from framework.models.moe import moe_blocks
from framework.parallel.expert_parallel import apply_ep
from tests.conftest import run_cli
from tests.hf_models import MOE_ARCHITECTURES, make_hf_model, reference
from tests.errors import relative_error
from tests.test_hf import (TOKENS, _copy, _rewrite_config, cross_entropy, first_global_batch, hf_config, loaded,
                           transformers_logits_error)
from tests.test_hf import test_greedy_generation_with_kv_cache_equals_transformers_generate as greedy_equals_transformers
from tests.workers import one_step_gradients

import transformers  # noqa: F401  (the dev extra: a broken install fails, never skips)

AUX = 0.1  # the load-balancing loss's weight in the tests' losses, so its gradient shows in the router's


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    return {kind: make_hf_model(kind, str(root / kind)) for kind in MOE_ARCHITECTURES}


def saved_gradients(model, out: str) -> dict:
    """transformers' gradients under the names of its files: save_pretrained of a model whose
    weights are its gradients (it splits its fused experts into one tensor per expert)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(out)
    return load_file(os.path.join(out, "model.safetensors"))


def reference_step_with_aux(path: str, inputs: torch.Tensor, targets: torch.Tensor, out: str):
    """transformers' loss (cross-entropy + AUX x its aux_loss), aux_loss and gradients by file name."""
    model = reference(path)
    output = model(inputs, output_router_logits=True)
    loss = cross_entropy(output.logits, targets) + AUX * output.aux_loss
    loss.backward()
    return float(loss.detach()), float(output.aux_loss.detach()), saved_gradients(model, out)


def stack_errors(ours: dict, theirs: dict) -> dict:
    """Relative error of each tensor of `ours` against `theirs` (the same names, all of them)."""
    assert sorted(ours) == sorted(theirs)
    return {name: relative_error(tensor, theirs[name]) for name, tensor in ours.items()}


@pytest.mark.parametrize("kind", list(MOE_ARCHITECTURES))
def test_logits_loss_load_balance_and_gradients_equal_transformers(kind, moe_dirs, tmp_path):
    path = moe_dirs[kind]
    ours = loaded(path)
    with torch.no_grad():
        error = relative_error(ours(TOKENS), reference(path)(TOKENS).logits)
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    logits = ours(inputs)
    load_balance = ours.auxiliary_losses["load_balance"] / inputs.numel()  # reported as a sum over tokens
    loss = cross_entropy(logits, targets) + AUX * load_balance
    loss.backward()
    ref_loss, ref_aux, ref_grads = reference_step_with_aux(path, inputs, targets, str(tmp_path / "grads"))
    grad_errors = stack_errors(model_state_dict(ours, {n: p.grad for n, p in ours.named_parameters()}), ref_grads)
    print(f"{kind}: logits {error:.1e}, loss {abs(float(loss) - ref_loss):.1e}, load balance "
          f"{abs(float(load_balance) - ref_aux):.1e}, gradients {max(grad_errors.values()):.1e}")
    assert error <= 1e-5
    assert relative_error(float(load_balance), ref_aux) <= 1e-5
    assert relative_error(float(loss), ref_loss) <= 1e-5
    assert all(e <= 5e-5 for e in grad_errors.values()), grad_errors  # transformers' experts: measured 1.5e-6


@pytest.mark.parametrize("kind", list(MOE_ARCHITECTURES))
def test_the_load_balance_weight_is_router_aux_loss_coef_only_where_transformers_trains_it(kind, moe_dirs):
    """transformers adds router_aux_loss_coef x aux_loss to the loss only with output_router_logits."""
    with open(os.path.join(moe_dirs[kind], "config.json")) as f:
        config = json.load(f)
    expected = config["router_aux_loss_coef"] if config["output_router_logits"] else 0.0
    assert HFTransformer(moe_dirs[kind]).aux_coefficients == {"load_balance": expected}


@pytest.mark.parametrize("kind", list(MOE_ARCHITECTURES))
def test_export_writes_one_tensor_per_expert_that_transformers_loads_with_our_logits(kind, moe_dirs, tmp_path):
    """Exported after our weights changed (so what transformers reads is what export wrote, not
    the source's files): no missing or unexpected keys, our logits."""
    from transformers import AutoModelForCausalLM

    ours, out = loaded(moe_dirs[kind]), str(tmp_path / "exported")
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_hf(ours, out)
    theirs, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    assert sorted(load_file(os.path.join(out, "model.safetensors"))) == \
        sorted(load_file(os.path.join(moe_dirs[kind], "model.safetensors")))  # the files' names, as save_pretrained
    with torch.no_grad():
        assert relative_error(ours(TOKENS), theirs(TOKENS).logits) <= 1e-5


@pytest.mark.parametrize("kind", list(MOE_ARCHITECTURES))
def test_greedy_generation_with_kv_cache_equals_transformers_generate(kind, moe_dirs):
    greedy_equals_transformers(kind, moe_dirs)


def expert_parallel_load_and_save(path: str, out: str) -> dict:
    """On each of 2 ranks: the model built on meta, its experts spread over both (DTensors
    sharded on the expert dim), allocated, read, perturbed by the rank and written
    (save_hf_sharded, as checkpoint.final_hf does). This rank's experts (global index -> its w1
    after reading, and as written) and the expert entries of its Hugging Face state dict."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh, rank = init_device_mesh("cpu", (2,)), dist.get_rank()
    model = HFTransformer(path)
    apply_ep(model, mesh, None)
    materialize(model, "cpu")
    load_hf_weights(model, path)
    first = moe_blocks(model)[0].experts.w1
    offset = rank * first.to_local().shape[0]
    read = {offset + e: w.detach().clone() for e, w in enumerate(first.to_local())}
    with torch.no_grad():
        for block in moe_blocks(model):
            block.experts.w1.to_local().add_(rank + 1.0)
    names = sorted(name for name in model_state_dict(model, model.state_dict()) if ".experts." in name)
    save_hf_sharded(model, out, rank)
    written = {offset + e: w.detach().clone() for e, w in enumerate(first.to_local())}
    dist.destroy_process_group()
    return {"read": read, "written": written, "names": names}


@pytest.mark.timeout(240)
def test_each_expert_parallel_rank_reads_and_writes_only_its_own_experts(moe_dirs, tmp_path):
    path, out = moe_dirs["qwen3_moe"], str(tmp_path / "hf")  # layer 0 sparse, 4 experts: 2 per rank
    results = spawn_ranks(2, expert_parallel_load_and_save, path, out)
    source, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (path, out))
    name = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    for rank, result in results.items():
        assert sorted(result["read"]) == [2 * rank, 2 * rank + 1]
        assert result["names"] == sorted(f"model.layers.0.mlp.experts.{e}.{w}.weight" for e in result["read"]
                                         for w in ("gate_proj", "up_proj", "down_proj"))
        for e in result["read"]:
            assert torch.equal(result["read"][e], source[name.format(e)])
            assert torch.equal(result["written"][e], exported[name.format(e)])
            assert torch.equal(exported[name.format(e)], source[name.format(e)] + (rank + 1.0))
    assert sorted(exported) == sorted(source)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,mesh,overrides", [
    ("qwen3_moe", "1x1", []),
    ("qwen3_moe", "2x1", []),  # the routing of both replicas' tokens pooled in the load balance
    ("qwen3_moe", "2x1", ["parallel.ep_dims=[dp]"]),  # 2 experts per rank, read from the files by their rank
    ("qwen3_moe", "2x1", ["parallel.dp_strategy=fsdp"]),  # FSDP shards the stacks on the expert dim too
    ("qwen3_moe", "2x2", ["plan=qk_norm_moe_tp", "parallel.ep_dims=[dp,tp]"]),  # 1 expert per rank, attention TP
    ("qwen2_moe", "pp2x2x1", ["parallel.ep_dims=[dp]"]),  # 2 stages (no aux loss trained), experts over DP
    pytest.param("qwen2_moe", "2x1", ["parallel.ep_dims=[dp]"], marks=pytest.mark.integration),
    pytest.param("mixtral", "2x1", ["parallel.ep_dims=[dp]"], marks=pytest.mark.integration),
], ids=["1x1", "dp", "ep", "fsdp", "ep-dp-tp", "qwen2_moe-pp-ep", "qwen2_moe-ep", "mixtral-ep"])
def test_the_trainers_step_equals_transformers_training_loss_and_gradients(kind, mesh, overrides, moe_dirs, tmp_path):
    """One step of the framework's trainer (built on meta, experts sharded under EP, then read):
    its loss is transformers' training loss, cross-entropy + router_aux_loss_coef x aux_loss
    where config.json's output_router_logits is true (Qwen3-MoE here), and its gradients
    transformers' (under pp: each stage's, from its ranks)."""
    path = moe_dirs[kind]
    cfg = hf_config(path, f"mesh={mesh}", "plan=none", *overrides)
    validate(cfg)
    results = spawn_ranks(math.prod(cfg.mesh.shape), one_step_gradients, rank_config(cfg), str(tmp_path))
    grads = {name: grad for result in results.values() for name, grad in result["grads"].items()}
    model = reference(path)
    inputs, targets = first_global_batch(cfg)
    output = model(inputs, output_router_logits=True)
    aux = model.config.router_aux_loss_coef * output.aux_loss if model.config.output_router_logits else 0.0
    ref_loss = cross_entropy(output.logits, targets) + aux
    ref_loss.backward()
    grad_errors = stack_errors(hf_state_dict(grads, False, kind), saved_gradients(model, str(tmp_path / "grads")))
    loss_error = relative_error(results[0]["loss"], float(ref_loss.detach()))
    print(f"{kind} {mesh} {overrides}: loss {loss_error:.1e}, gradients {max(grad_errors.values()):.1e}")
    assert loss_error <= 1e-5  # measured 8.7e-8
    assert all(e <= 5e-5 for e in grad_errors.values()), grad_errors  # measured 1.5e-6


@pytest.mark.timeout(300)
def test_a_run_trains_a_mixture_of_experts_and_exports_it_for_transformers(moe_dirs, tmp_path):
    """framework.train on one process, then framework.export --format hf of its checkpoint."""
    cfg = hf_config(moe_dirs["qwen2_moe"], "mesh=1x1", "plan=none", "trainer.max_steps=2", "checkpoint.every=2",
                    "logger.tensorboard=false")
    summary = launch_local(cfg, str(tmp_path / "run"))
    assert len(summary["losses"]) == 2
    checkpoints, out = str(tmp_path / "run" / "checkpoints"), tmp_path / "exported"
    result = run_cli([checkpoints, str(out), "--format", "hf"], module="framework.export")
    assert result.returncode == 0, result.stderr
    assert transformers_logits_error(out, checkpoints) <= 1e-5


def _drop_tensor(path: str, name: str) -> None:
    from safetensors.torch import save_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors[name]
    save_file(tensors, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("kind,changes,match", [
    ("mixtral", {"router_jitter_noise": 0.1}, r"config.json sets router_jitter_noise: 0.1 \(noise on the experts' "
                                              r"input in training\), which this framework does not implement"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, r"config.json's num_experts_per_tok=5 exceeds its 4 experts"),
    ("qwen2_moe", {"use_sliding_window": True}, r"config.json sets use_sliding_window: true"),
    ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight",
     r"the safetensors lack model.layers.0.mlp.experts.3.up_proj.weight \(shape \[32, 64\]\), which config.json "
     r"implies"),
])
def test_what_a_mixture_of_experts_does_not_implement_is_refused_naming_it(kind, changes, match, moe_dirs, tmp_path):
    path = _copy(moe_dirs, kind, tmp_path)
    if isinstance(changes, dict):
        _rewrite_config(path, **changes)
    else:
        _drop_tensor(path, changes)
    with pytest.raises(ConfigError, match=match):
        validate(hf_config(path, "mesh=1x1", "plan=none", "model.backend=native"))
