"""Sharded data parallelism (parallel.dp_strategy fsdp, hsdp): every mesh trains the
one-process model, each rank holds its shard of the bytes, and bf16 behaves under sharding as
without it (accumulation and activation checkpointing under fsdp: tests/test_lm.py)."""
import math

import pytest
from hydra.errors import ConfigCompositionException

from framework.launch.local import launch_local
from framework.models.transformer import Transformer
from tests.conftest import QUIET, compose_config
from tests.errors import max_relative_error
from tests.reference import reference_training
from tests.test_lm import TINY, shape_under_tp2

STEPS = 20
SEED_BYTES = 4 * (48 * 12 + 48 + 48 * 48 + 48 + 12 * 48 + 12)  # the seed MLP's fp32 parameters, on 1x1


def fsdp_rank0_bytes(shapes, dp: int) -> int:
    """fp32 bytes of rank 0's FSDP shards: the first dim-0 chunk of each parameter, ceil(rows / dp)
    rows (torch.chunk's split, which FSDP2 pads to on the other ranks)."""
    return 4 * sum(math.ceil(shape[0] / dp) * math.prod(shape[1:]) for shape in shapes)


def tiny_lm_shapes(tp: int) -> list:
    model = Transformer(**{k: v for k, v in compose_config(TINY).model.items() if k != "_target_"})
    return [shape_under_tp2(name, p.shape) if tp == 2 else list(p.shape) for name, p in model.named_parameters()]

CASES = [
    # model, mesh, strategy, plan, rank 0's parameter bytes (hand count)
    pytest.param("seed", "4x1", "fsdp", "seed_mlp_tp", SEED_BYTES // 4, marks=pytest.mark.integration),
    ("seed", "2x2x1", "hsdp", "seed_mlp_tp", SEED_BYTES // 2),
    ("lm", "2x2", "fsdp", "lm_tp_sp", fsdp_rank0_bytes(tiny_lm_shapes(tp=2), 2)),  # TP halves, 2 FSDP shards
    pytest.param("lm", "2x1x2", "hsdp", "lm_tp", fsdp_rank0_bytes(tiny_lm_shapes(tp=2), 1),  # TP halves, 1 shard,
                 marks=pytest.mark.integration),                                            # 2 replicas
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,mesh,strategy,plan,param_bytes", CASES,
                         ids=[" ".join(str(getattr(c, "values", c)[i]) for i in (2, 1, 0, 3)) for c in CASES])
def test_sharded_strategies_train_the_one_process_model_on_a_shard_of_the_bytes(model, mesh, strategy, plan,
                                                                                   param_bytes, tmp_path):
    common = [*QUIET, f"trainer.max_steps={STEPS}", "trainer.log_every=5"]
    # Clipping below the gradients' norm, so a wrong global norm would change the losses too.
    clip = 0.05 if model == "seed" else 0.5
    common += [f"trainer.grad_clip={clip}"] if model == "seed" else [*TINY, f"trainer.grad_clip={clip}"]
    reference = reference_training(compose_config([*common, "mesh=1x1", "plan=none"]))
    summary = launch_local(compose_config([*common, f"mesh={mesh}", f"plan={plan}",
                                           f"parallel.dp_strategy={strategy}"]), str(tmp_path))
    loss_error = max_relative_error(summary["losses"], reference["losses"])
    norm_error = max_relative_error(summary["grad_norms"], reference["grad_norms"][4::5])
    print(f"{strategy} {mesh} {model} {plan}: max relative loss error vs 1x1 {loss_error:.2e}, "
          f"grad norm {norm_error:.2e}; bytes per rank {summary['memory']['max_over_ranks']}")
    tolerance = 1e-5 if model == "seed" else 2e-4  # measured 2e-7; the LM's clipped grad norm 7.2e-6 (fsdp)
    assert loss_error < tolerance and norm_error < tolerance
    assert sum(norm > clip for norm in reference["grad_norms"]) > STEPS // 2  # clipping acted on most steps
    rank0 = summary["memory"]["rank0"]
    assert rank0["parameters"] == rank0["gradients"] == rank0["optimizer_state"] == param_bytes
    assert summary["memory"]["max_over_ranks"]["parameters"] <= param_bytes


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_fsdp_bf16_agrees_with_one_process_bf16_and_keeps_fp32_master_weights(tmp_path):
    common = [*TINY, *QUIET, "trainer.max_steps=10", "trainer.log_every=5", "trainer.mixed_precision=bf16"]
    sharded = launch_local(compose_config([*common, "mesh=2x2", "plan=lm_tp_sp", "parallel.dp_strategy=fsdp"]),
                           str(tmp_path / "fsdp"))
    one = launch_local(compose_config([*common, "mesh=1x1", "plan=none"]), str(tmp_path / "one"))
    fp32 = reference_training(compose_config([*TINY, "mesh=1x1", "plan=none", "trainer.max_steps=10"]))
    error = max_relative_error(sharded["losses"], one["losses"])
    print(f"bf16 fsdp 2x2 lm_tp_sp (MixedPrecisionPolicy) vs 1x1 bf16 (autocast): max relative loss error "
          f"{error:.2e}; vs fp32 {max_relative_error(sharded['losses'], fp32['losses']):.2e}; losses {sharded['losses']}")
    assert error < 2e-2
    assert max_relative_error(sharded["losses"], fp32["losses"]) > 1e-5  # bf16 compute changed the numbers beyond fp32 noise
    assert sharded["losses"][-1] < sharded["losses"][0]
    assert sharded["memory"]["rank0"]["parameters"] == fsdp_rank0_bytes(tiny_lm_shapes(tp=2), 2)  # fp32 shards


def test_an_unknown_strategy_is_refused_at_compose_naming_the_choices():
    with pytest.raises(ConfigCompositionException) as error:
        compose_config(["parallel.dp_strategy=zero"])
    assert "Invalid value 'zero', expected one of [replicate, fsdp, hsdp]" in str(error.value.__cause__)
    assert "full_key: parallel.dp_strategy" in str(error.value.__cause__)
