"""Pipeline parallelism (framework/parallel/pipeline.py) trains the one-process model: every
schedule, composed with DP (replicate, fsdp) and TP+SP; checkpoints move between PP and no PP;
`inspect comm` counts the sends and receives and `inspect trace` orders them; bad PP configs are
refused before launch."""
import json

import pytest
from hydra.errors import HydraException

from framework.cli import hydra_error_line
from framework.config.errors import ConfigError
from framework.validate import validate
from framework.inspect import count_collectives, first_difference, on_ranks, trace_of_one_step
from framework.launch.local import launch_local
from framework.verify import verify
from tests.conftest import TEST_MODELS, compose_config, run_cli
from tests.errors import max_relative_error
from tests.reference import reference_training
from tests.test_lm import TINY

# The tiny LM with 4 blocks (2 stages of 2, or 4 of 1 with 2 stages per rank), SGD, 10 steps.
PP = [*TINY, "model.n_layers=4", "trainer.max_steps=10", "trainer.log_every=5", "plan=none"]


@pytest.fixture(scope="module")
def one_process():
    return reference_training(compose_config([*PP, "mesh=1x1"]))


@pytest.fixture(scope="module")
def one_process_clipped():
    return reference_training(compose_config([*PP, "mesh=1x1", "trainer.grad_clip=0.05"]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overrides", [
    pytest.param(["mesh=pp2x1x1", "parallel.pp_schedule=gpipe"], marks=pytest.mark.integration),
    ["mesh=pp2x1x1", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=4"],
    ["mesh=pp2x1x1", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
    pytest.param(["mesh=pp2x1x1", "parallel.pp_schedule=interleaved_zero_bubble", "parallel.pp_stages_per_rank=2"], marks=pytest.mark.integration),
    pytest.param(["mesh=pp2x1x1", "parallel.pp_schedule=zbv_zero_bubble", "parallel.pp_stages_per_rank=2"], marks=pytest.mark.integration),
    pytest.param(["mesh=pp2x1x1", "parallel.pp_schedule=dualpipev", "parallel.pp_stages_per_rank=2"], marks=pytest.mark.integration),
    pytest.param(["mesh=pp2x2x1"], marks=pytest.mark.integration),  # + DP replicate (gradients synced once per step)
    ["mesh=pp2x2x1", "trainer.grad_clip=0.05", "trainer.check_replicas_every=5"],  # clipped by the norm over every
    # stage's gradients; the replica check compares each stage's ranks (it compared stages' other layers before)
    ["mesh=pp2x2x1", "parallel.dp_strategy=fsdp"],        # + FSDP2, each stage a root
    pytest.param(["mesh.shape=[2,1,2,1]", "mesh.dim_names=[pp,dp_replicate,dp,tp]", "parallel.dp_strategy=hsdp"], marks=pytest.mark.integration),  # + HSDP
    pytest.param(["mesh=pp2x1x2", "plan=lm_tp_sp", "parallel.pp_layers_per_stage=[1,3]"],  # + TP+SP, an uneven split
                 marks=pytest.mark.integration),  # (make test: PP x TP's checkpoint resumes in test_pipeline)
    pytest.param(["mesh=pp2x1x2", "plan=lm_tp_sp_loss_parallel"], marks=pytest.mark.integration),     # + vocabulary-sharded logits on the last stage
], ids=lambda o: " ".join(o))
def test_every_schedule_and_composition_trains_the_one_process_model(overrides, one_process, one_process_clipped,
                                                                     tmp_path):
    summary = launch_local(compose_config([*PP, *overrides]), str(tmp_path))
    reference = one_process_clipped if "trainer.grad_clip=0.05" in overrides else one_process
    error = max_relative_error(summary["losses"], reference["losses"])
    print(f"PP {' '.join(overrides)}: max relative loss error vs 1x1 {error:.2e}")
    assert error < 1e-5


SAVED_UNDER_PP = [*PP, "checkpoint.every=5", "trainer.eval_every=5", "trainer.eval_batches=2"]


@pytest.fixture(scope="module")
def saved_under_pp(tmp_path_factory) -> dict:
    """10 steps on [pp 2, dp 1, tp 2] with TP+SP, a checkpoint and a held-out loss every 5."""
    out = tmp_path_factory.mktemp("pp")
    return launch_local(compose_config([*SAVED_UNDER_PP, "mesh=pp2x1x2", "plan=lm_tp_sp"]), str(out)) | \
        {"step_5": out / "checkpoints" / "step_5"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,plan", [("2x2", "lm_tp_sp"), pytest.param("pp2x2x1", "none", marks=pytest.mark.integration)])
def test_a_checkpoint_saved_under_pp_resumes_without_pp_and_on_another_pp_mesh(mesh, plan, saved_under_pp, one_process,
                                                                               tmp_path):
    """The losses after the resume are the one-process curve's; the held-out losses (forward only,
    through the pipeline where there is one) are those of the run that saved and never stopped."""
    summary = launch_local(compose_config([*SAVED_UNDER_PP, f"mesh={mesh}", f"plan={plan}",
                                           f"checkpoint.resume={saved_under_pp['step_5']}"]), str(tmp_path))
    error = max_relative_error(summary["losses"][5:], one_process["losses"][5:])
    print(f"resume [2,1,2] -> {mesh}: max relative loss error vs 1x1 {error:.2e}")
    assert summary["resumed_from"] and error < 1e-5
    assert [s for s, _ in summary["val_losses"]] == [s for s, _ in saved_under_pp["val_losses"]] == [5, 10]
    assert max_relative_error([v for _, v in summary["val_losses"]], [v for _, v in saved_under_pp["val_losses"]]) < 1e-5


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_sweep_over_a_3d_and_a_2d_mesh_trains_one_model_and_reports_both(tmp_path):
    sweep = tmp_path / "sweep"
    fast = [o for o in PP if not o.startswith("trainer.max_steps")] + ["trainer.max_steps=4", "trainer.eval_every=null"]
    result = run_cli(["-m", "mesh=pp2x1x1,2x1", *fast, "logger.tensorboard=false", f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, result.stderr
    losses = [json.loads((sweep / str(job) / "summary.json").read_text())["losses"] for job in (0, 1)]
    assert max_relative_error(losses[0], losses[1]) < 1e-5
    assert "| 0 | mesh=pp2x1x1 | 2x1x1 | none |" in result.stdout and "| 1 | mesh=2x1 | 2x1 | none |" in result.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,per_rank,micro", [("gpipe", 1, 2), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 4)])
def test_inspect_comm_counts_the_pipelines_sends_and_receives(schedule, per_rank, micro):
    """By hand, for pp=2 (S = 2 x stages per rank): every micro-batch crosses each of the S - 1
    stage boundaries once forward (activations) and once backward (gradients), and each boundary
    has one rank on each side, so each rank sends m (S - 1) times and receives as often. Nothing
    else: the loss goes from the last stage to the others only when it is logged. (The first
    step, which also exchanges shapes, is not the one counted.)"""
    counts = count_collectives([*PP, "mesh=pp2x1x1", f"parallel.pp_schedule={schedule}",
                                f"parallel.pp_stages_per_rank={per_rank}", f"parallel.pp_microbatches={micro}"])
    expected = micro * (2 * per_rank - 1)
    assert counts == {rank: {"c10d.recv_": expected, "c10d.send": expected} for rank in (0, 1)}


@pytest.mark.timeout(240)
def test_inspect_trace_orders_each_stages_sends_and_receives_before_the_one_dp_sync():
    traces = on_ranks(trace_of_one_step, [*PP, "mesh=pp2x2x1"])  # 1F1B, 2 micro-batches per replica
    flat = {rank: [c for event in events for c in event["collectives"]] for rank, events in traces.items()}
    # stage 0 sends both micro-batches' activations, then receives both gradients; stage 1 receives
    # an activation and sends its gradient per micro-batch; DataParallel syncs once, after the schedule
    assert flat[0] == flat[1] == ["send[pp]", "send[pp]", "recv_[pp]", "recv_[pp]", "allreduce_[dp]"]
    assert flat[2] == flat[3] == ["recv_[pp]", "send[pp]", "recv_[pp]", "send[pp]", "allreduce_[dp]"]
    forward = {rank: {".".join(e["module"].split(".")[:2]) for e in events if e["pass"] == "forward"}
               for rank, events in traces.items()}
    assert forward[0] == {"tok_embeddings", "layers.0", "layers.1"}
    assert forward[2] == {"layers.2", "layers.3", "norm", "output"}
    assert first_difference(traces) is None  # sends and receives pair across ranks: not compared


@pytest.mark.parametrize("overrides,message", [
    (["model.n_layers=3"], r"parallel.pp_layers_per_stage=None: an even split, and the model's 3 layers do not split "
                           r"evenly into 2 stages .* e.g. \[2, 1\]"),
    (["parallel.pp_layers_per_stage=[1,2]"], r"parallel.pp_layers_per_stage=\[1, 2\]: give 2 counts .* summing to "
                                             r"the model's 4 layers"),
    (["model.n_layers=1"], r"parallel.pp_layers_per_stage=None: the model's 1 layers cannot fill 2 stages \(pp x "
                           r"pp_stages_per_rank\), each of which needs at least one; use at most 1 stages"),
    (["parallel.pp_microbatches=1"], "parallel.pp_microbatches=1: 1f1b needs at least as many micro-batches as stages"),
    (["parallel.pp_schedule=dualpipev", "parallel.pp_stages_per_rank=2", "parallel.pp_microbatches=2"],
     r"parallel.pp_microbatches=2: dualpipev needs at least as many micro-batches as stages \(4\)"),
    (["parallel.pp_microbatches=3"], r"parallel.pp_microbatches=3: must divide each replica's batch of 8"),
    (["data.micro_batch_size=4"], "data.micro_batch_size=4: under pipeline parallelism the schedule's micro-batches "
                                  "are the gradient accumulation"),
    (["parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_stages_per_rank=1: parallel.pp_schedule=interleaved_1f1b "
                                                "needs 2 or more stages per rank"),
    (["parallel.pp_schedule=gpipe", "parallel.pp_stages_per_rank=2"], "parallel.pp_stages_per_rank=2: "
                                                                      "parallel.pp_schedule=gpipe runs one stage"),
    (["mesh.dim_names=[dp,pp,tp]", "mesh.shape=[1,2,1]"], r"the PP dim 'pp' must be outermost"),
    (["parallel.pp_schedule=zbv_zero_bubble", "parallel.pp_stages_per_rank=2", "trainer.compile=blocks"],
     "trainer.compile='blocks': parallel.pp_schedule=zbv_zero_bubble splits each backward into input and weight"),
])
def test_bad_pipeline_config_is_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([*PP, "mesh=pp2x1x1", *overrides]))


def test_a_model_without_blocks_to_split_is_refused():
    with pytest.raises(ConfigError, match="pipeline parallelism splits a model with tok_embeddings, layers, norm, "
                                          "output .* SeedMLP has not"):
        validate(compose_config(["mesh=pp2x1x1", "plan=none", "data.global_batch_size=4"]))


def test_a_schedule_that_does_not_exist_lists_the_schedules():
    with pytest.raises(HydraException) as info:
        compose_config([*PP, "mesh=pp2x1x1", "parallel.pp_schedule=1f2b"])
    assert hydra_error_line(info.value).endswith("Invalid value '1f2b', expected one of [gpipe, 1f1b, interleaved_1f1b, "
                                                 "interleaved_zero_bubble, zbv_zero_bubble, dualpipev]")


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_verify_passes_under_pp_x_tp_and_names_the_attention_that_reshapes_with_the_global_head_count():
    """Under PP verify compares each module's input and output on its stage's ranks (the last
    micro-batch of step 1), and every parameter's gradient and value from every stage."""
    base = [*PP, "mesh=pp2x1x2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]
    ok, verdict, _ = verify(compose_config([*base, "plan=lm_tp_sp"]))
    assert ok, verdict
    ok, verdict, _ = verify(compose_config([*base, "plan=lm_tp", TEST_MODELS,
                                            "model._target_=tests.workers.GlobalHeadsTransformer"]))
    assert not ok
    assert verdict.endswith("first module whose output differs from one process with a matching input: "
                            "layers.0.attention (not in the plan)"), verdict


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_pipeline_runs_console_reads_like_any_other_runs(tmp_path):
    """Each stage holds only its own layers: the plan's entries for the others' (tok_embeddings,
    norm, output) are left out of its parallelize_module, not warned about with the model's repr."""
    result = run_cli([*PP, "mesh=pp2x1x2", "plan=lm_tp_sp", "trainer.max_steps=2", "logger.tensorboard=false",
                      f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "could not be resolved" not in result.stderr and "Warning" not in result.stderr, result.stderr[-3000:]
