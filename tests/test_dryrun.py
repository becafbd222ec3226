"""python -m framework.dryrun: one CPU process, the fake process group and meta parameters
against real gloo ranks and hand arithmetic."""

import subprocess
import sys

import pytest

from framework.dryrun import compose_config, dry_run, main
from framework.inspect import collectives_of_one_step, on_ranks
from tests.conftest import run_cli
from tests.test_comm_audit import FSDP_UNITS, TINY


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
        # the 5 sequence-parallel norm weights' partial gradients, and gradient clipping the
        # tp-sharded gradients' sum of squares (one fp32 number).
        assert report.collectives[("c10d.allreduce_", "dp")] == [1, 4 * (elements + n_params)]
        assert report.collectives[("c10d.allreduce_", "tp")] == [2, 4 * 5 * 32 + 4]
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
    # (tp's second allreduce_: gradient clipping's sum of squares)
    assert collectives == {("c10d.allreduce_", "dp"): "1", ("c10d.allreduce_", "tp"): "2",
                           ("c10d_functional.all_gather_into_tensor", "tp"): "19",
                           ("c10d_functional.reduce_scatter_tensor", "tp"): "18"}


@pytest.mark.timeout(60)
def test_a_rank_outside_the_mesh_is_refused(capsys):
    assert main(["mesh=2x2", "dryrun.ranks=[0,4]"]) == 2
    assert capsys.readouterr().err == ("config error: dryrun.ranks=[0, 4]: rank 4 is not a rank of the mesh [2, 2]; "
                                       "give ranks from 0 to 3\n")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_fsdp_is_dry_run_as_it_runs_its_collectives_those_real_ranks_count(micro_batches):
    """FSDP2 stepped on meta: the per-unit all-gathers, re-gathers and reduce-scatters that
    test_comm_audit counts on 4 real gloo ranks for the same config, and the state sharded over
    DP: half of replicate's on dp 2 (lm_tiny's dims and vocab divide by 2: no padding)."""
    overrides = [*TINY, "mesh=2x2", "plan=lm_tp", "data.micro_batch_size=" + str(4 // micro_batches)]
    fsdp, = dry_run(compose_config([*overrides, "parallel.dp_strategy=fsdp"]))
    replicate, = dry_run(compose_config([*overrides, "parallel.dp_strategy=replicate"]))
    counts = counts_per_op(fsdp)
    assert {op: counts[op] for op in FSDP_UNITS} == {"c10d._allgather_base_": micro_batches * FSDP_UNITS[
        "c10d._allgather_base_"], "c10d._reduce_scatter_base_": FSDP_UNITS["c10d._reduce_scatter_base_"]}
    assert counts["c10d.allreduce_"] == 3  # gradient clipping's sums of squares (test_comm_audit says which)
    for state in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        assert 2 * getattr(fsdp, state) == getattr(replicate, state)
    # all-gathered parameters are not activations (FSDP frees them after each unit)
    assert fsdp.activation_bytes == replicate.activation_bytes


@pytest.mark.timeout(60)
def test_hsdp_shards_over_dp_and_all_reduces_the_shards_over_the_replicas():
    report, = dry_run(compose_config([*TINY, "mesh.shape=[2,2,1]", "mesh.dim_names=[dp_replicate,dp,tp]",
                                      "plan=none", "parallel.dp_strategy=hsdp"]))
    replicate, = dry_run(compose_config([*TINY, "mesh=4x1", "plan=none"]))
    assert 2 * report.parameter_bytes == replicate.parameter_bytes
    reduce_scattered = report.collectives[("c10d._reduce_scatter_base_", "dp")]
    # each unit's reduce-scattered gradient shard (1 / dp of its input) all-reduced over dp_replicate
    assert report.collectives[("c10d.allreduce_", "dp_replicate")] == [reduce_scattered[0], reduce_scattered[1] // 2]


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


PIPELINE = [*TINY, "mesh=pp2x2x1", "plan=none", "parallel.pp_microbatches=4"]  # lm_tiny: 2 blocks, 1 per stage


def pp_activations(schedule: str) -> list:
    reports = dry_run(compose_config([*PIPELINE, f"parallel.pp_schedule={schedule}", "dryrun.ranks=[0,2]"]))
    assert [r.stages for r in reports] == [[0], [1]]
    return [r.activation_bytes for r in reports]


@pytest.mark.timeout(150)
def test_dry_run_under_pipeline_parallelism_matches_real_ranks_and_hand_counts():
    overrides = [*PIPELINE, "parallel.pp_schedule=1f1b"]
    real = on_ranks(collectives_of_one_step, overrides)  # 4 gloo ranks, their second step counted
    reports = dry_run(compose_config([*overrides, "dryrun.ranks=[0,1,2,3]"]))
    # each replica's 4 sequences in 4 micro-batches of 1: 1 x 32 tokens x dim 32 in fp32 per transfer
    activation = 1 * 32 * 32 * 4
    for report in reports:
        assert counts_per_op(report) == real[report.rank]
        # every micro-batch crosses the one stage boundary forward (stage 0 sends) and backward
        assert report.collectives[("c10d.send", "pp")] == [4, 4 * activation]
        assert report.collectives[("c10d.recv_", "pp")] == [4, 4 * activation]
    assert [r.stages for r in reports] == [[0], [0], [1], [1]]


@pytest.mark.timeout(60)
def test_dry_run_activations_are_the_micro_batches_each_schedule_keeps_alive():
    gpipe, one_f_one_b = pp_activations("gpipe"), pp_activations("1f1b")
    # GPipe runs all 4 forwards before any backward; 1F1B keeps p - s micro-batches alive on
    # stage s (p = 2). The micro-batches' token ids (stage 0) and targets (the loss on stage 1)
    # are views of one storage, the replica's 4 x 32 int64s, counted once; so are, on both
    # stages, the rows of the rotation table their blocks save (cos and sin: 32 positions x
    # head_dim 8 / 2 in fp32), made on every rank from the step's tokens.
    ids, table = 4 * 32 * 8, 2 * 32 * 4 * 4
    assert gpipe[0] - ids - table == 2 * (one_f_one_b[0] - ids - table)
    assert gpipe[1] - ids - table == 4 * (one_f_one_b[1] - ids - table)


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_1024_rank_3d_mesh_is_simulated_in_one_process():
    result = run_cli(["recipe=lm_3d", "parallel.dp_strategy=replicate", "mesh.shape=[4,32,8]",
                      "data.global_batch_size=256", "dryrun.ranks=[0,1023]"], module="framework.dryrun", timeout=80)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh [pp=4, dp=32, tp=8] = 1024 ranks" in out
    assert "rank 0 (pp 0, dp 0, tp 0, pipeline stage 0)" in out
    rank_1023 = out.split("rank 1023 (pp 3, dp 31, tp 7, pipeline stage 3)")[1].splitlines()
    parameters = [line.split()[0] for line in rank_1023 if line.startswith("  ") and line.split()[0].endswith("weight")]
    assert parameters[0].startswith("layers.3.") and parameters[-1] == "output.weight"  # 4 blocks, 1 per stage
    # 8 sequences per replica in 4 micro-batches of 2; under SP a stage boundary carries the
    # sequence shard: 2 x (128 / 8) tokens x dim 128 in fp32 = 16 KiB, 4 each way
    # and gradient clipping sums the stages' squares over pp: one fp32 number
    p2p = {tuple(line.split()[:2]): " ".join(line.split()[2:]) for line in rank_1023 if " pp " in line}
    assert p2p == {("c10d.recv_", "pp"): "4 64.0 KiB", ("c10d.send", "pp"): "4 64.0 KiB",
                   ("c10d.allreduce_", "pp"): "1 4 B"}


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_70b_model_is_built_and_sharded_without_any_rank_allocating_it():
    """model=llama3_70b (280 GB of fp32 parameters) on dp 8 x tp 8 fsdp: the dry run builds and
    shards it on meta in one process whose peak resident memory (measured 393 MB) is under 2 GB."""
    code = ("import resource; from framework.dryrun import main; "
            "rc = main(['recipe=lm_2d', 'model=llama3_70b', 'data=random_tokens', 'mesh.shape=[8,8]', "
            "'mesh.ranks_per_host=8', 'parallel.dp_strategy=fsdp', 'data.global_batch_size=8', 'dryrun.ranks=[0]']); "
            "print('peak', rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170)
    assert "mesh [dp=8, tp=8] = 64 ranks" in result.stdout, result.stderr[-2000:]
    _, rc, peak = result.stdout.strip().splitlines()[-1].split()
    assert rc == "0" and int(peak) < 2 * 2 ** 30, result.stdout[-2000:]
