"""Multi-process correctness on real gloo process groups: every mesh shape trains the same
model as one process would, DP replicas stay bitwise identical, parameters stay visible."""
import pytest
import torch
from hydra.utils import instantiate

from framework.launch.handoff import rank_config
from framework.launch.local import RankFailed, launch_local, spawn_ranks
from framework.data import SyntheticRegression
from tests.conftest import QUIET, TEST_MODELS, compose_config
from tests.errors import max_relative_error
from tests.reference import reference_training
from tests.workers import data_parallel_gradients, seed_literal_ddp_then_tp, train_and_report

PARITY_STEPS = 20


@pytest.mark.timeout(180)
@pytest.mark.parametrize("overrides", [
    ["mesh=1x1"],
    ["mesh=2x2", "plan=seed_mlp_colwise_rowwise"],
    pytest.param(["mesh=4x1"], marks=pytest.mark.integration),  # (the 2x2 case's dims, each alone)
    pytest.param(["mesh=1x4"], marks=pytest.mark.integration),
    ["recipe=seed_tp"],  # the seed's Linear, colwise, on a 1-D TP mesh
    pytest.param(["recipe=seed_tp", "model=seed_sequential", "plan=seed_sequential_rowwise_colwise"],
                 marks=pytest.mark.integration),  # (rowwise then colwise: the 2x2 case's plan in the other order)
], ids=lambda o: " ".join(o))
def test_loss_equals_single_process_training(overrides, tmp_path):
    cfg = compose_config([*overrides, f"trainer.max_steps={PARITY_STEPS}", "trainer.log_every=5", *QUIET])
    reference = reference_training(cfg)
    summary = launch_local(cfg, str(tmp_path))
    error = max_relative_error(summary["losses"], reference["losses"])
    print(f"loss parity {' '.join(overrides)}: max relative error {error:.2e}")
    assert error < 1e-5
    assert sum(summary["losses"][-5:]) < sum(summary["losses"][:5])  # and it trains


def _by_rank(reports):
    return [reports[r] for r in sorted(reports)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overrides", [
    ["mesh=2x2"],
    ["recipe=seed_ddp_tp", "trainer.grad_clip=0.3"],  # the seed's 3x2, with clipping on
], ids=["2x2", "3x2-clipped"])
def test_dp_replicas_stay_bitwise_identical_and_parameters_stay_visible(overrides, tmp_path):
    cfg = compose_config([*overrides, "trainer.max_steps=6", "trainer.log_every=1", *QUIET])
    reference = reference_training(cfg)
    reports = _by_rank(spawn_ranks(int(torch.tensor(list(cfg.mesh.shape)).prod()), train_and_report,
                                   rank_config(cfg), str(tmp_path)))
    tp_size = cfg.mesh.shape[1]
    worst = 0.0
    for report in reports:
        peer = reports[report["tp_rank"]]  # DP replica 0 with the same TP coordinate
        assert peer["dp_rank"] == 0 and peer["tp_rank"] == report["tp_rank"]
        for name, tensor in report["params"].items():
            worst = max(worst, (tensor - peer["params"][name]).abs().max().item())
            assert torch.equal(tensor, peer["params"][name]), f"{name} differs across DP on rank {report['rank']}"
        # parameters(), state_dict() and the optimizer still hold every parameter.
        assert report["param_numel"] == reference["numel"]
        assert report["state_dict_keys"] == sorted("module." + k for k in reference["state_dict_keys"])
        assert report["optimizer_params"] == len(reference["param_names"])
        # Each TP rank holds exactly 1/TP of each sharded weight.
        assert report["params"]["net1.weight"].shape == (48 // tp_size, 12)
        assert report["params"]["net2.weight"].shape == (48, 48 // tp_size)
    print(f"max parameter difference across DP replicas {overrides}: {worst}")
    summary = reports[0]["summary"]
    assert max_relative_error(summary["losses"], reference["losses"]) < 1e-5
    # grad_norms: the global norm before clipping, equal to torch's single-process norm.
    assert max_relative_error(summary["grad_norms"], reference["grad_norms"]) < 1e-5
    if cfg.trainer.grad_clip is not None:
        assert max(reference["grad_norms"]) > cfg.trainer.grad_clip  # clipping was really active


@pytest.mark.timeout(240)
def test_clip_by_global_norm_with_mixed_dtensor_and_plain_parameters(tmp_path):
    """colwise net1 + rowwise net2 are DTensors, net3 is plain: the norm still spans all."""
    cfg = compose_config(["mesh=2x2", "plan=seed_mlp_colwise_rowwise", "trainer.grad_clip=0.3",
                          "trainer.max_steps=8", "trainer.log_every=1", *QUIET])
    reference = reference_training(cfg)
    summary = launch_local(cfg, str(tmp_path))
    assert max(reference["grad_norms"]) > 0.3
    assert max_relative_error(summary["grad_norms"], reference["grad_norms"]) < 1e-5
    assert max_relative_error(summary["losses"], reference["losses"]) < 1e-5


@pytest.mark.timeout(180)
def test_a_parameter_no_replica_uses_stays_untouched_as_in_one_process(tmp_path):
    """AdamW's weight decay moves any parameter that has a gradient, even a zero one; like one
    process (and DDP), an unused layer must get none and stay as initialised."""
    cfg = compose_config(["mesh=2x2", TEST_MODELS,
                          "model._target_=tests.workers.WithUnusedLayer", "optim=adamw", "trainer.max_steps=3",
                          *QUIET])
    reference = reference_training(cfg)
    reports = _by_rank(spawn_ranks(4, train_and_report, rank_config(cfg), str(tmp_path)))
    torch.manual_seed(cfg.trainer.seed)
    initial = instantiate(cfg.model).unused.weight
    for report in reports:
        assert torch.equal(report["params"]["unused.weight"], initial)
    assert max_relative_error(reports[0]["summary"]["losses"], reference["losses"]) < 1e-5


@pytest.mark.timeout(180)
def test_sampler_follows_the_dp_submesh(tmp_path):
    """TP peers read the same samples, DP replicas disjoint ones covering the epoch once."""
    cfg = compose_config(["mesh=2x2", "trainer.max_steps=1", *QUIET])
    reports = _by_rank(spawn_ranks(4, train_and_report, rank_config(cfg), str(tmp_path)))
    by_dp = {}
    for report in reports:
        by_dp.setdefault(report["dp_rank"], []).append(report["epoch0_indices"])
    assert sorted(by_dp) == [0, 1]
    for indices in by_dp.values():
        assert all(i == indices[0] for i in indices)  # the whole TP group reads the same batch
    first, second = by_dp[0][0], by_dp[1][0]
    assert not set(first) & set(second)
    assert sorted(first + second) == list(range(1536))
    # The loader really reads through that sampler: step 1's batch is its first 12 indices.
    dataset = SyntheticRegression(**{k: v for k, v in cfg.data.dataset.items() if k != "_target_"})
    for report in reports:
        assert torch.equal(report["first_batch_inputs"], dataset.inputs[report["epoch0_indices"][:12]])


@pytest.mark.timeout(180)
def test_torch_ddp_then_tp_diverges_which_is_why_data_parallel_syncs_itself(tmp_path):
    """The seed's literal code on torch 2.13: DDP(process_group) then parallelize_module(model.module)
    trains without error, but the TP layers' gradients are never all-reduced across DP."""
    reports = _by_rank(spawn_ranks(4, seed_literal_ddp_then_tp, 5))
    diverged = [name for name, t in reports[2]["params"].items() if not torch.equal(t, reports[0]["params"][name])]
    assert "net1.weight" in diverged and "net2.weight" in diverged


@pytest.mark.timeout(180)
def test_the_replica_check_fails_the_run_naming_a_parameter_that_drifted_on_one_rank(tmp_path):
    cfg = compose_config(["mesh=2x2", TEST_MODELS,
                          "model._target_=tests.workers.DriftOnRank", "trainer.max_steps=10",
                          "trainer.check_replicas_every=5", *QUIET])
    with pytest.raises(RankFailed, match=r"RuntimeError: replica check at step 5: parameter scale differs across "
                                         r"all ranks \(it must be identical there\)"):
        launch_local(cfg, str(tmp_path))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False])
def test_bucketed_sync_averages_what_each_rank_produced_and_drops_what_none_did(overlap):
    # Several buckets; parameter c only rank 0 uses, d none. Overlapped, rank 0 starts the buckets
    # of b, a and c during backward and rank 1 only b's and a's (c's waits for the end of
    # backward there), yet they pair up in order. Step 2 adds a micro-batch under no_sync. Each
    # step's gradients are the average of the two ranks' own (c: half rank 0's, rank 1 counting
    # zeros), d keeps none: as one process over both ranks' data.
    reports = spawn_ranks(2, data_parallel_gradients, overlap)
    assert reports[0]["buckets"] == [["b.bias"], ["b.weight", "a.bias"], ["a.weight", "c.bias"],
                                     ["c.weight", "d.bias"], ["d.weight"]]
    if overlap:
        assert reports[0]["started_in_backward"] == [3, 3] and reports[1]["started_in_backward"] == [2, 2]
    else:
        assert reports[0]["started_in_backward"] == reports[1]["started_in_backward"] == [0, 0]
    for step in (0, 1):
        for name, grad in reports[0]["own"][step].items():
            other = reports[1]["own"][step][name]
            expected = None if grad is None and other is None else \
                ((grad if grad is not None else 0) + (other if other is not None else 0)) / 2
            for rank in (0, 1):
                synced = reports[rank]["synced"][step][name]
                if expected is None:
                    assert synced is None, name
                else:
                    # gloo's all-reduce sums in its own order: float32 rounding, not bitwise
                    torch.testing.assert_close(synced, expected, rtol=1e-5, atol=1e-6, msg=f"step {step + 1} {name}")
