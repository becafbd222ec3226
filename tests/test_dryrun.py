"""python -m framework.dryrun: one CPU process, the fake process group and meta parameters
against real gloo ranks and hand arithmetic."""

import pytest

from framework.dryrun import compose_config, dry_run, main
from framework.inspect import collectives_of_one_step, on_ranks
from tests.conftest import run_cli
from tests.test_comm_audit import TINY


def counts_per_op(report) -> dict:
    counts = {}
    for (op, _dim), (count, _bytes) in report.collectives.items():
        counts[op] = counts.get(op, 0) + count
    return counts


def tiny_lm_elements_per_rank_under_tp2() -> int:
    """lm_tiny (vocab 256, dim 32, 2 layers, hidden 64) under TP=2: local parameter elements."""
    embeddings = 256 // 2 * 32                        # rowwise: half the vocabulary
    per_layer = (32                                   # attention_norm: replicated
                 + 3 * (32 // 2 * 32)                 # wq, wk, wv colwise: half the output rows
                 + 32 * (32 // 2)                     # wo rowwise: half the input columns
                 + 32                                 # ffn_norm
                 + 2 * (64 // 2 * 32)                 # w1, w3 colwise
                 + 32 * (64 // 2))                    # w2 rowwise
    return embeddings + 2 * per_layer + 32 + 256 // 2 * 32   # + final norm + output colwise


@pytest.mark.timeout(150)
def test_dry_run_of_2x2_matches_real_ranks_collectives_and_hand_computed_shard_sizes():
    overrides = [*TINY, "mesh=2x2", "plan=lm_tp_sp"]
    real = on_ranks(collectives_of_one_step, overrides)  # 4 gloo ranks, each counting its collectives
    reports = dry_run(compose_config([*overrides, "dryrun.ranks=[0,1,2,3]"]))
    assert [r.rank for r in reports] == [0, 1, 2, 3]
    elements = tiny_lm_elements_per_rank_under_tp2()  # fp32
    n_params = 1 + 2 * 9 + 1 + 1
    for report in reports:
        assert counts_per_op(report) == real[report.rank]
        assert report.parameter_bytes == report.gradient_bytes == 4 * elements
        assert report.optimizer_bytes == 2 * 4 * elements  # AdamW: exp_avg and exp_avg_sq
        # DP averages every local gradient plus one used-flag per parameter in one bucket; TP sums
        # the 5 sequence-parallel norm weights' partial gradients.
        assert report.collectives[("c10d.allreduce_", "dp")] == [1, 4 * (elements + n_params)]
        assert report.collectives[("c10d.allreduce_", "tp")] == [1, 4 * 5 * 32]
        parameters = {name: rest for name, *rest in report.parameters}
        assert parameters["tok_embeddings.weight"] == [[128, 32], [256, 32], "tp: Shard(dim=0)"]
        assert parameters["layers.1.attention.wo.weight"] == [[32, 16], [32, 32], "tp: Shard(dim=1)"]
        assert parameters["norm.weight"] == [[32], [32], "tp: Replicate()"]
        assert report.activation_bytes > 0


@pytest.mark.timeout(90)
def test_a_1024_rank_mesh_is_simulated_in_one_process():
    # How long it takes is a benchmark figure (bench/), not an assertion: run_cli's timeout bounds a hang.
    result = run_cli(["recipe=lm_2d", "mesh.shape=[128,8]", "mesh.ranks_per_host=8", "data.global_batch_size=256",
                      "dryrun.ranks=[0,1023]"], module="framework.dryrun", timeout=80)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh [dp=128, tp=8] = 1024 ranks" in out
    assert "rank 0 (dp 0, tp 0)" in out and "rank 1023 (dp 127, tp 7)" in out
    rank_1023 = out.split("rank 1023 (dp 127, tp 7)")[1].splitlines()
    assert any(line.split()[:3] == ["layers.3.attention.wq.weight", "[16,", "128]"] for line in rank_1023)
    # lm_small has 4 layers: SP gathers 2L+2 times forward, 2L+1 backward; reduce-scatters 2L+1 each way.
    collectives = {tuple(line.split()[:2]): line.split()[2] for line in rank_1023 if line.startswith("    c10d")}
    assert collectives == {("c10d.allreduce_", "dp"): "1", ("c10d.allreduce_", "tp"): "1",
                           ("c10d_functional.all_gather_into_tensor", "tp"): "19",
                           ("c10d_functional.reduce_scatter_tensor", "tp"): "18"}


@pytest.mark.timeout(60)
def test_a_rank_outside_the_mesh_is_refused(capsys):
    assert main(["mesh=2x2", "dryrun.ranks=[0,4]"]) == 2
    assert capsys.readouterr().err == ("config error: dryrun.ranks=[0, 4]: rank 4 is not a rank of the mesh [2, 2]; "
                                       "give ranks from 0 to 3\n")


@pytest.mark.timeout(60)
def test_a_sharded_strategy_is_refused_with_the_way_to_dry_run_its_mesh(capsys):
    assert main(["mesh=4x1", "parallel.dp_strategy=fsdp"]) == 2
    assert capsys.readouterr().err.startswith(
        "config error: parallel.dp_strategy='fsdp': the dry run steps on meta tensors, and FSDP2 refuses parameters "
        "on meta before it all-gathers; dry-run the mesh with dp_strategy=replicate")


@pytest.mark.timeout(60)
def test_a_device_too_small_is_refused_and_plain_parameters_are_named(capsys):
    assert main([*TINY, "mesh=1x2", "plan=lm_tp", "dryrun.device_memory_gb=0.0001"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("dry run: does not fit: rank 0's estimated peak ")
    assert "exceeds dryrun.device_memory_gb=0.0001" in err and len(err.splitlines()) == 1
    norm = next(line for line in out.splitlines() if line.strip().startswith("norm.weight"))
    assert norm.endswith("replicated plain tensor")  # lm_tp leaves the norms out of the plan


@pytest.mark.timeout(60)
def test_optimizer_state_follows_the_optimizer():
    with_momentum, plain = (dry_run(compose_config(["mesh=2x2", *extra]))[0] for extra in ([], ["optim.momentum=0"]))
    assert with_momentum.optimizer_bytes == with_momentum.parameter_bytes > 0  # SGD's momentum buffer
    assert plain.optimizer_bytes == 0
