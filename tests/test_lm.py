"""The transformer LM on DP x TP meshes: parity with one process, replica identity, shard sizes,
the corpus, and the FLOPs count behind MFU."""
import pytest
import torch

from framework.data.corpus import ByteCorpus
from framework.config.errors import ConfigError
from framework.launch.handoff import rank_config
from framework.launch.local import launch_local, spawn_ranks
from framework.models.transformer import Transformer
from framework.validate import validate
from tests.conftest import TINY_LM, compose_config
from tests.test_dryrun import tiny_lm_elements_per_rank_under_tp2
from tests.errors import max_relative_error
from tests.reference import reference_training
from tests.workers import train_and_report

# The tiny LM on a 64 KB slice of the corpus; SGD so any gradient error shows in the loss.
TINY = [*TINY_LM, "trainer.warmup_steps=0", "trainer.lr_decay=constant", "trainer.grad_clip=null",
        "trainer.eval_every=null", "logger.tensorboard=false", "optim=sgd", "~optim.betas", "optim.lr=0.5"]
STEPS = 10


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh,plan", [pytest.param("2x2", "lm_tp", marks=pytest.mark.integration),  # (inside lm_tp_sp)
                                       ("2x2", "lm_tp_sp"), ("1x2", "lm_tp_sp_loss_parallel")])
def test_lm_loss_equals_single_process_training(mesh, plan, tmp_path):
    """The training losses, and the validation losses (each DP replica evaluates its share)."""
    evaluated = [o for o in TINY if o != "trainer.eval_every=null"] + ["trainer.eval_every=5", "trainer.eval_batches=2"]
    cfg = compose_config([*evaluated, f"mesh={mesh}", f"plan={plan}", f"trainer.max_steps={STEPS}",
                          "trainer.log_every=5"])
    reference = reference_training(cfg)
    summary = launch_local(cfg, str(tmp_path))
    error = max_relative_error(summary["losses"], reference["losses"])
    val_error = max_relative_error([v for _, v in summary["val_losses"]], [v for _, v in reference["val_losses"]])
    print(f"LM loss parity {mesh} {plan}: max relative error {error:.2e}, validation {val_error:.2e}")
    assert error < 1e-4 and val_error < 1e-4
    assert [s for s, _ in summary["val_losses"]] == [s for s, _ in reference["val_losses"]] == [5, 10]
    assert summary["losses"][-1] < summary["losses"][0]


@pytest.mark.timeout(240)
def test_lm_dp_replicas_identical_and_each_tp_rank_holds_one_tp_th_of_each_sharded_weight(tmp_path):
    cfg = compose_config([*TINY, "mesh=2x2", "plan=lm_tp_sp", "trainer.max_steps=5"])
    reports = [r for _, r in sorted(spawn_ranks(4, train_and_report, rank_config(cfg),
                                                str(tmp_path)).items())]
    full = dict(Transformer(**{k: v for k, v in cfg.model.items() if k != "_target_"}).named_parameters())
    for report in reports:
        peer = reports[report["tp_rank"]]  # DP replica 0, same TP coordinate
        for name, tensor in report["params"].items():
            assert torch.equal(tensor, peer["params"][name]), name
            assert list(tensor.shape) == shape_under_tp2(name, full[name].shape), name
        assert report["param_numel"] == sum(p.numel() for p in full.values())


def shape_under_tp2(name: str, shape) -> list:
    """A tiny-LM parameter's local shape on one of 2 TP ranks under lm_tp / lm_tp_sp (by hand)."""
    shape = list(shape)
    sharded_rows = ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"]
    if name == "tok_embeddings.weight" or name == "output.weight" or any(s in name for s in sharded_rows):
        shape[0] //= 2  # vocabulary rows / colwise output rows
    elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        shape[1] //= 2  # rowwise input columns
    return shape


def test_missing_or_empty_corpus_is_a_config_error_before_launch(tmp_path):
    with pytest.raises(ConfigError, match=r"data.dataset.path='/nonexistent/text': no such file or directory"):
        validate(compose_config(["recipe=lm_2d", "data.dataset.path=/nonexistent/text"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"data.dataset.path=.*holds no window of seq_len\+1=129 bytes"):
        validate(compose_config(["recipe=lm_2d", f"data.dataset.path={empty}"]))


def test_validation_split_must_fill_a_global_batch_and_heads_must_divide_dim():
    with pytest.raises(ConfigError, match=r"data.global_batch_size=16: the dataset's val split has only 7 samples"):
        validate(compose_config(["recipe=lm_2d", "data.dataset.max_bytes=20000"]))
    with pytest.raises(ConfigError, match=r"model.dim=30: must be a multiple of model.n_heads=4"):
        validate(compose_config(["recipe=lm_2d", "model=lm_tiny", "model.dim=30"]))


def test_heads_and_sequence_must_divide_by_the_tp_size():
    with pytest.raises(ConfigError, match=r"model.n_heads=6: the TP plan splits it across 4 ranks"):
        validate(compose_config(["recipe=lm_2d", "mesh=1x4", "model.n_heads=6", "model.dim=96", "model.hidden_dim=96"]))
    with pytest.raises(ConfigError, match=r"data.dataset.seq_len=127: the TP plan splits it across 2 ranks"):
        validate(compose_config(["recipe=lm_2d", "data.dataset.seq_len=127"]))


def test_corpus_windows_are_inputs_and_next_token_targets(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(100)))
    train = ByteCorpus(path=str(text), seq_len=8, val_fraction=0.2)
    assert len(train) == (80 - 1) // 8
    inputs, targets = train[2]
    assert inputs.tolist() == list(range(16, 24)) and targets.tolist() == list(range(17, 25))
    val = ByteCorpus(path=str(text), seq_len=8, split="val", val_fraction=0.2)
    assert val[0][0].tolist() == list(range(80, 88))


def test_flops_per_token_counts_every_matmul_and_attention():
    model = Transformer(vocab_size=256, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    # per layer: wq wk wv wo 4*32*32 + w1 w2 w3 3*32*64; output 32*256; embeddings excluded
    matmul_weights = 2 * (4 * 32 * 32 + 3 * 32 * 64) + 32 * 256
    assert model.flops_per_token(seq_len=16) == 6 * matmul_weights + 12 * 2 * 32 * 16


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,plan", [pytest.param("replicate", "lm_tp_sp_loss_parallel", marks=pytest.mark.integration),
                                           pytest.param("fsdp", "lm_tp_sp", marks=pytest.mark.integration)])
def test_accumulation_and_activation_checkpointing_train_the_plain_run(strategy, plan, tmp_path):
    # 4 sequences per replica in micro-batches of 1 (under loss_parallel the loss is a DTensor),
    # every block recomputed in backward: the weighted micro-batch gradients add up to the whole
    # batch's, synced once per step (DataParallel's all-reduce, FSDP's reduce-scatter).
    cfg = compose_config([*TINY, "mesh=2x2", f"plan={plan}", f"parallel.dp_strategy={strategy}",
                          f"trainer.max_steps={STEPS}", "trainer.log_every=5"])
    whole = launch_local(cfg, str(tmp_path / "whole"))
    cfg.data.micro_batch_size = 1
    cfg.model.activation_checkpointing = "full"
    both = launch_local(cfg, str(tmp_path / "both"))
    error = max_relative_error(both["losses"], whole["losses"])
    print(f"{strategy} 2x2 {plan}, micro-batches of 1, every block recomputed: max relative loss error {error:.2e}")
    assert error < 1e-5  # micro-batch gradients add up in another order than the whole batch's
    # summary.json's memory: every rank holds half of each TP-sharded weight (hand count), fsdp
    # half of that again (2 DP shards; every dim 0 is even), its gradients, and SGD's one momentum
    # buffer per parameter.
    shard = 4 * tiny_lm_elements_per_rank_under_tp2() // (2 if strategy == "fsdp" else 1)
    expected = {"parameters": shard, "gradients": shard, "optimizer_state": shard, "total": 3 * shard}
    assert whole["memory"] == {"rank0": expected, "max_over_ranks": expected}


@pytest.mark.timeout(240)
def test_bf16_autocast_on_a_mesh_agrees_with_one_process_bf16_and_trains(tmp_path):
    cfg = compose_config([*TINY, "mesh=2x2", "plan=lm_tp_sp", f"trainer.max_steps={STEPS}", "trainer.log_every=5",
                          "trainer.mixed_precision=bf16"])
    mesh = launch_local(cfg, str(tmp_path / "mesh"))
    fp32 = reference_training(compose_config([*TINY, "mesh=1x1", "plan=none", f"trainer.max_steps={STEPS}"]))
    cfg.mesh.shape, cfg.plan = [1, 1], {}
    one = launch_local(cfg, str(tmp_path / "one"))
    error = max_relative_error(mesh["losses"], one["losses"])
    print(f"bf16 2x2 lm_tp_sp vs 1x1 bf16: max relative loss error {error:.2e}; "
          f"vs fp32 {max_relative_error(mesh['losses'], fp32['losses']):.2e}")
    assert error < 2e-2
    assert max_relative_error(mesh["losses"], fp32["losses"]) > 0  # autocast did change the numbers
    assert mesh["losses"][-1] < mesh["losses"][0]


@pytest.mark.timeout(240)
def test_fused_adamw_over_plain_and_sharded_parameters_trains_the_loops_curve_of_one_process(tmp_path):
    """plan=lm_tp leaves the norms plain beside TP's DTensors: the fused kernel runs a param group
    of each kind (one would be refused) and trains what torch's per-parameter loop trains in one
    process, with clipping (the foreach sums of squares) on."""
    steps = [*TINY_LM, "trainer.max_steps=10", "trainer.log_every=5", "trainer.grad_clip=0.5", "trainer.eval_every=null",
             "trainer.warmup_steps=0", "trainer.lr_decay=constant", "logger.tensorboard=false"]
    fused = compose_config([*steps, "mesh=1x2", "plan=lm_tp"])
    assert fused.optim.fused
    loop = reference_training(compose_config([*steps, "mesh=1x2", "plan=lm_tp", "optim.fused=false"]))
    summary = launch_local(fused, str(tmp_path))
    error = max_relative_error(summary["losses"], loop["losses"])
    print(f"fused AdamW on 1x2 lm_tp against the loop on one process: max relative error {error:.2e}")
    assert error < 1e-4
    assert summary["losses"][-1] < summary["losses"][0]
