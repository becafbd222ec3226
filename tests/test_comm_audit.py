"""The collectives of one step of the tiny LM (2 layers) on a 1x2 mesh, derived by hand from
the plan, against what `framework.inspect comm` counts on each rank."""
import pytest

from framework.inspect import count_collectives, first_difference, on_ranks, trace_of_one_step
from tests.conftest import TINY_LM, run_cli

TINY = TINY_LM
LAYERS = 2  # conf/model/lm_tiny.yaml


@pytest.mark.timeout(180)
def test_lm_tp_step_collectives_match_the_plan():
    # Forward:
    #   tok_embeddings rowwise, output replicate: partial lookups summed      1 all_reduce
    #   per layer, wo and w2 rowwise, output replicate                         2 all_reduce
    #   output colwise, output_layouts replicate: gather the logits            1 all_gather
    # Backward:
    #   each colwise layer's replicated input gets a partial gradient:
    #   per layer wq, wk, wv, w1, w3 (each converts its input separately)      5 all_reduce
    #   output's input                                                         1 all_reduce
    #   (rowwise layers and the gather's backward need no communication)
    # Gradient clipping (trainer.grad_clip): the squares of the TP-sharded gradients, all
    # sharded on the tp dim, summed over it once (the plain norm weights' are whole)   1 allreduce_
    # Optimizer step, DP (size 1) and replicated norm weights (not DTensors): none.
    expected = {"c10d_functional.all_reduce": 1 + 2 * LAYERS + 5 * LAYERS + 1,
                "c10d_functional.all_gather_into_tensor": 1, "c10d.allreduce_": 1}
    assert count_collectives([*TINY, "mesh=1x2", "plan=lm_tp"])[0] == expected


@pytest.mark.timeout(180)
def test_lm_tp_sp_step_collectives_match_the_plan():
    # Forward (the residual stream is sequence-sharded between TP regions):
    #   tok_embeddings rowwise, output shard(1)                                1 reduce_scatter
    #   per layer, attention and feed_forward inputs shard(1) -> replicate     2 all_gather
    #   per layer, wo and w2 rowwise, output shard(1)                          2 reduce_scatter
    #   output colwise: input shard(1) -> replicate, logits gathered           2 all_gather
    # Backward (each forward redistribution reversed):
    #   all_gather of a sequence-sharded input -> reduce_scatter of its
    #   partial gradient: per layer 2 (q/k/v share one gathered input), output 1
    #   reduce_scatter onto sequence shards -> all_gather of the gradient:
    #   per layer wo and w2, and tok_embeddings                                2L+1 all_gather
    # Gradient finalization: the sequence-parallel norm weights (2 per layer + final norm) get
    # partial gradients, summed together by DataParallel                       1 allreduce_
    # Gradient clipping: the tp-sharded gradients' squares summed over tp (the norm weights are
    # replicated DTensors, counted whole)                                       1 allreduce_
    expected = {"c10d_functional.reduce_scatter_tensor": (1 + 2 * LAYERS) + (2 * LAYERS + 1),
                "c10d_functional.all_gather_into_tensor": (2 * LAYERS + 2) + (2 * LAYERS + 1),
                "c10d.allreduce_": 1 + 1}
    assert count_collectives([*TINY, "mesh=1x2", "plan=lm_tp_sp"])[0] == expected


@pytest.mark.integration  # (make test: the counts by hand, in this process)
@pytest.mark.timeout(180)
def test_inspect_cli_prints_counts_and_dp_adds_one_bucketed_all_reduce():
    result = run_cli(["comm", *TINY, "mesh=2x2", "plan=lm_tp_sp"], module="framework.inspect")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split() for line in result.stdout.splitlines() if line.startswith("  "))
    # DP averaging of all gradients fits one 25 MB bucket: one more allreduce_ than on 1x2.
    assert lines == {"c10d_functional.all_gather_into_tensor": "11", "c10d_functional.reduce_scatter_tensor": "10",
                     "c10d.allreduce_": "3", "total": "24"}


@pytest.mark.timeout(180)
def test_inspect_trace_shows_each_ranks_passes_in_order_with_their_collectives():
    result = run_cli(["trace", *TINY, "mesh=1x2", "plan=lm_tp_sp"], module="framework.inspect")
    assert result.returncode == 0, result.stderr
    traces, rank = {}, None
    for line in result.stdout.splitlines():
        if line.startswith("rank "):
            rank = int(line.split()[1].rstrip(":"))
            traces[rank] = []
        elif line.startswith("  "):
            _, kind, module, *collectives = line.split()
            traces[rank].append((kind, module, collectives))
    assert traces[0] == traces[1]  # the two TP ranks: same passes, same collectives, same order
    passes = lambda kind: [c for k, _, cs in traces[0] if k == kind for c in cs]  # noqa: E731
    rs, ag = "reduce_scatter_tensor[tp]", "all_gather_into_tensor[tp]"
    # Forward: embeddings scatter the sequence; per layer gather for attention, scatter after wo,
    # gather for the MLP, scatter after w2; the output gathers its input and then the logits.
    assert passes("forward") == [rs] + [ag, rs, ag, rs] * LAYERS + [ag, ag]
    # Backward reverses each: the output's gather -> scatter; per layer (last first) the w2 scatter
    # -> gather, the MLP gather -> scatter, and so on; the embeddings' scatter -> gather; then
    # DataParallel sums the sequence-parallel norms' partial gradients over TP.
    assert passes("backward") == [rs] + [ag, rs, ag, rs] * LAYERS + [ag, "allreduce_[tp]"]
    assert [m for k, m, _ in traces[0] if k == "forward"][:3] == ["(model)", "tok_embeddings", "layers.0"]
    assert result.stdout.strip().endswith("every rank issues its groups' collectives in the same order as the other "
                                          "ranks of each group")


def test_first_difference_names_the_group_the_position_and_both_ranks_passes():
    def trace(*collectives):
        return [{"pass": "backward", "module": f"layers.{i}", "collectives": [c]} for i, c in enumerate(collectives)]
    traces = {0: trace("all_reduce[dp]", "reduce_scatter_tensor[tp]", "all_gather_into_tensor[tp]"),
              1: trace("all_reduce[dp]", "all_gather_into_tensor[tp]", "reduce_scatter_tensor[tp]")}
    assert first_difference(traces) == ("tp collective #1: rank 0 issues reduce_scatter_tensor[tp] in backward "
                                        "layers.1, rank 1 issues all_gather_into_tensor[tp] in backward layers.1")
    assert first_difference({0: trace("all_reduce[dp]"), 1: trace("all_reduce[dp]", "all_reduce[dp]")}) == \
        "dp: rank 0 issues 1 collectives, rank 1 2"
    assert first_difference({0: trace("all_reduce[dp]"), 1: trace("all_reduce[dp]")}) is None


@pytest.mark.timeout(180)
def test_gradient_accumulation_syncs_dp_once_per_step_not_per_micro_batch():
    # The seed MLP on 2x1: 12 samples per replica, in 4 micro-batches of 3. DataParallel's one
    # bucketed all-reduce (gradients and used-flags) runs after the last micro-batch only.
    assert count_collectives(["mesh=2x1", "data.micro_batch_size=3"])[0] == {"c10d.allreduce_": 1}


# FSDP2 under parallel.dp_strategy=fsdp, units = each block and the root (framework.parallel.fully_shard):
#   forward: every unit's parameters all-gathered                         1 + L _allgather_base_
#   backward: the blocks' again (resharded after forward; the root keeps
#   its own until the step ends)                                          L _allgather_base_
#   gradients reduce-scattered per unit (averaged over DP, once per step)  1 + L _reduce_scatter_base_
FSDP_UNITS = {"c10d._allgather_base_": (1 + LAYERS) + LAYERS, "c10d._reduce_scatter_base_": 1 + LAYERS}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mesh,micro_batches", [("2x1", 1), ("2x2", 1), ("2x1", 4)])
def test_fsdp_step_gathers_per_unit_and_reduce_scatters_once_per_step_beside_tp(mesh, micro_batches):
    # On 2x2 TP adds what it does on 1x2 under lm_tp (test_lm_tp_step_collectives_match_the_plan);
    # DataParallel's all-reduce is gone (FSDP's reduce-scatter replaces it). With 4 micro-batches
    # (of 1 sequence) each gathers again; the gradients are reduce-scattered after the last only.
    # Gradient clipping sums the gradients' squares over each dim they are sharded on, once per
    # mesh and set of dims: 2x1, all on dp: 1 allreduce_; 2x2, the TP layers' on (dp, tp): 2, the
    # norm weights' on dp alone: 1.
    tp = {"c10d_functional.all_reduce": 1 + 2 * LAYERS + 5 * LAYERS + 1,
          "c10d_functional.all_gather_into_tensor": 1} if mesh == "2x2" else {}
    fsdp = {"c10d._allgather_base_": micro_batches * FSDP_UNITS["c10d._allgather_base_"],
            "c10d._reduce_scatter_base_": FSDP_UNITS["c10d._reduce_scatter_base_"],
            "c10d.allreduce_": 3 if mesh == "2x2" else 1}
    per_replica = 8 // 2  # TINY's global batch over DP 2
    counts = count_collectives([*TINY, f"mesh={mesh}", "plan=lm_tp", "parallel.dp_strategy=fsdp",
                                f"data.micro_batch_size={per_replica // micro_batches}"])[0]
    assert counts == {**fsdp, **tp}


@pytest.mark.timeout(180)
def test_data_parallel_all_reduces_a_bucket_while_backward_still_runs():
    # lm_small's gradients (3.5 MB) fill two buckets: the first capped at 1 MiB as DDP's (the
    # output layer, the final norm, the last blocks: the first gradients backward produces), the
    # rest. The first bucket's all-reduce starts inside the blocks' backward, before the
    # embeddings' (the last module backward reaches); the second once the embeddings' gradient exists.
    # (Overlap asked for: on CPUs the default waits for backward to end, the next test.)
    trace = on_ranks(trace_of_one_step, ["recipe=lm_2d", "mesh=2x1", "plan=none", "parallel.overlap_dp_sync=true"])[0]
    backward = [e["module"] for e in trace if e["pass"] == "backward"]
    dp_all_reduces = [(e["pass"], e["module"]) for e in trace for c in e["collectives"] if c == "allreduce_[dp]"]
    assert len(dp_all_reduces) == 2
    assert dp_all_reduces[0][0] == "backward" and dp_all_reduces[0][1].startswith("layers.")
    assert dp_all_reduces[1] == ("backward", backward[-1]) == ("backward", "tok_embeddings")


def test_on_cpus_data_parallel_waits_for_backward_by_default():
    """parallel.overlap_dp_sync=null on a CPU mesh: both buckets' all-reduces start once backward
    is done (gloo's threads would take the cores backward computes on), after the last module's
    backward, the embeddings'."""
    trace = on_ranks(trace_of_one_step, ["recipe=lm_2d", "mesh=2x1", "plan=none"])[0]
    backward = [e["module"] for e in trace if e["pass"] == "backward"]
    dp_all_reduces = [(e["pass"], e["module"]) for e in trace for c in e["collectives"] if c == "allreduce_[dp]"]
    assert dp_all_reduces == [("backward", backward[-1])] * 2 and backward[-1] == "tok_embeddings"
