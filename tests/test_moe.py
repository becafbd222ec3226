"""Mixture of experts (framework.models.moe) and expert parallelism (framework.parallel.expert_parallel):
a block against a per-token loop written by hand, the load-balancing loss against transformers'
formula written out, and every expert layout against one process, checkpoints between layouts."""
import pytest
import torch
import torch.nn.functional as F
from omegaconf import open_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.launch.handoff import rank_config
from framework.dryrun import dry_run
from framework.inspect import collectives_of_one_step, count_collectives, on_ranks
from framework.launch.local import launch_local, spawn_ranks
from framework.models.moe import MoE, load_balance_loss, moe_blocks, update_expert_biases
from framework.models.transformer import FeedForward, Transformer
from framework.verify import verify
from tests.conftest import TEST_MODELS, TINY_LM, compose_config, run_cli
from tests.errors import max_relative_error
from tests.reference import reference_training, swiglu
from tests.test_cli import read_events
from tests.test_dryrun import counts_per_op
from tests.workers import expert_biases, expert_shapes

# The tiny MoE LM (4 experts, top 2, a shared expert) on the tiny corpus; SGD, so any gradient
# error shows in the loss; the load-balancing loss weighted 0.1 so it moves the weights too.
MOE = [*TINY_LM, "model=lm_moe_tiny", "plan=none", "model.moe.aux_loss_coef=0.1", "trainer.warmup_steps=0",
       "trainer.lr_decay=constant", "trainer.grad_clip=null", "trainer.eval_every=null", "logger.tensorboard=false",
       "optim=sgd", "~optim.betas", "optim.lr=0.5", "trainer.max_steps=8", "trainer.log_every=4"]


def load_max_over_mean(routing, layer: int, every: int) -> torch.Tensor:
    """TensorBoard's moe/layer{N}_load_max_over_mean by hand: the busiest expert's token slots
    over the mean, counted over each logging window's steps."""
    loads = [sum(step[layer] for step in routing.loads[start:start + every])
             for start in range(0, len(routing.loads), every)]
    return torch.tensor([float(load.max() / load.mean()) for load in loads])


def test_a_moe_block_sends_each_token_to_its_top_k_experts_as_a_loop_by_hand():
    torch.manual_seed(0)
    for norm, shared in ((True, None), (False, FeedForward(8, 6))):
        block = MoE(8, 5, n_experts=4, top_k=2, norm_topk_prob=norm, shared_expert=shared, shared_gate=shared is not None)
        x = torch.randn(3, 7, 8)
        expected = []
        for token in x.reshape(-1, 8):
            probabilities = F.softmax(block.gate(token), dim=-1)
            weights, chosen = probabilities.topk(2)
            weights = weights / weights.sum() if norm else weights
            out = sum(w * swiglu(token, *(getattr(block.experts, n)[e] for n in ("w1", "w2", "w3")))
                      for w, e in zip(weights, chosen.tolist()))
            if shared is not None:
                out = out + torch.sigmoid(block.shared_expert_gate(token)) * shared(token)
            expected.append(out)
        torch.testing.assert_close(block(x), torch.stack(expected).view(3, 7, 8), rtol=1e-5, atol=1e-6)


def test_a_biased_block_chooses_by_the_biased_scores_and_weighs_by_the_probabilities_as_a_loop_by_hand():
    """DeepSeek-V3's aux-loss-free routing: the bias decides which experts a token goes to, the
    router's own probabilities (renormalized over the chosen) how much each counts."""
    torch.manual_seed(0)
    block = MoE(8, 5, n_experts=4, top_k=2, bias_update_rate=0.01)
    block.expert_bias.copy_(torch.tensor([0.2, 0.0, -0.2, 0.05]))
    x = torch.randn(3, 7, 8)
    expected, moved = [], 0
    for token in x.reshape(-1, 8):
        probabilities = F.softmax(block.gate(token), dim=-1)
        chosen = (probabilities + block.expert_bias).topk(2).indices
        moved += set(chosen.tolist()) != set(probabilities.topk(2).indices.tolist())
        weights = probabilities[chosen] / probabilities[chosen].sum()
        expected.append(sum(w * swiglu(token, *(getattr(block.experts, n)[e] for n in ("w1", "w2", "w3")))
                            for w, e in zip(weights, chosen.tolist())))
    assert moved > 0  # the bias changed some tokens' experts: an unbiased choice would fail below
    # one token's few matmuls against the block's batched ones (measured 3.8e-7)
    torch.testing.assert_close(block(x), torch.stack(expected).view(3, 7, 8), rtol=1e-5, atol=1e-6)


def test_the_expert_bias_moves_up_for_an_underloaded_expert_down_for_an_overloaded_one_by_the_rate():
    """After a step, by hand: bias_e += rate x sign(mean load - load_e); the step's load starts again."""
    block = MoE(8, 5, n_experts=4, top_k=2, bias_update_rate=0.25)
    block.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.5, 1.0]))
    block.step_load.copy_(torch.tensor([7.0, 1.0, 4.0, 4.0]))  # mean 4: expert 0 over it, 1 under, 2 and 3 at it
    update_expert_biases([block])
    assert torch.equal(block.expert_bias, torch.tensor([0.25, 0.25, -0.5, 1.0]))
    assert torch.equal(block.step_load, torch.zeros(4))


def test_the_grouped_gemm_computes_what_the_per_expert_loop_does_forward_and_backward():
    """bf16 (where torch._grouped_mm runs on CPU), runs of uneven length and an empty one; both
    against each other and against the loop in fp32."""
    from framework.models.moe import grouped_gemm_runs, swiglu_grouped, swiglu_per_expert
    torch.manual_seed(0)
    counts = [5, 0, 9, 2]
    tokens = torch.randn(sum(counts), 32)
    weights = [torch.randn(4, 48, 32) * 0.1, torch.randn(4, 32, 48) * 0.1, torch.randn(4, 48, 32) * 0.1]
    assert grouped_gemm_runs(torch.bfloat16) and not grouped_gemm_runs(torch.float32)
    results = []
    for swiglu in (swiglu_grouped, swiglu_per_expert):
        inputs = [t.bfloat16().requires_grad_() for t in (tokens, *weights)]
        out = swiglu(*inputs, counts)
        out.float().square().sum().backward()
        results.append([out, *(t.grad for t in inputs)])
    for grouped, looped in zip(*results):
        torch.testing.assert_close(grouped, looped)  # (bf16's tolerances)
    # bf16 (8 bits of mantissa) against the fp32 loop: the worst element used 26% of 2e-2 / 1e-2
    torch.testing.assert_close(results[0][0].float(), swiglu_per_expert(tokens, *weights, counts), rtol=6e-2, atol=3e-2)


def test_the_load_balancing_loss_is_transformers_formula_over_every_layer_pooled():
    """transformers' load_balancing_loss_func, written out: the gate logits of every MoE layer
    concatenated, the share of each expert among the top-k choices times its mean probability,
    summed and times the number of experts. The model reports it times the token count."""
    torch.manual_seed(1)
    model = Transformer(vocab_size=32, dim=8, n_layers=3, n_heads=2,
                        moe={"n_experts": 4, "top_k": 2, "hidden_dim": 6, "layers": [0, 2]})
    tokens = torch.randint(0, 32, (2, 5))
    logits = []
    for block in moe_blocks(model):  # the gate logits each MoE layer saw
        block.register_forward_hook(lambda m, args, out: logits.append(m.gate(args[0].reshape(-1, 8))))
    model(tokens)
    assert len(logits) == 2
    probabilities = F.softmax(torch.cat(logits), dim=-1)
    chosen = F.one_hot(probabilities.topk(2, dim=-1).indices, 4).float()
    expected = 4 * (chosen.mean(dim=0) * probabilities.mean(dim=0)).sum()
    torch.testing.assert_close(model.auxiliary_losses["load_balance"] / tokens.numel(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(load_balance_loss(moe_blocks(model)), model.auxiliary_losses["load_balance"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overrides", [
    ["mesh=2x1"],                                          # experts on every rank, routing pooled over DP
    ["mesh=2x1", "parallel.ep_dims=[dp]"],                 # 2 experts per rank, tokens all-to-all
    pytest.param(["mesh=4x1", "parallel.ep_dims=[dp]"], marks=pytest.mark.integration),  # 1 expert per rank
    pytest.param(["mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp]"],   # + attention TP
                 marks=pytest.mark.integration),  # (make test: the same with experts over dp and tp)
    ["mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp,tp]"],  # 1 expert per rank; TP ranks split their tokens
    pytest.param(["mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[tp]"],  # experts over TP, replicated over DP
                 marks=pytest.mark.integration),
    pytest.param(["mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp,tp]", "parallel.dp_strategy=fsdp"],
                 marks=pytest.mark.integration),
    ["mesh=2x1", "parallel.ep_dims=[dp]", "parallel.dp_strategy=fsdp"],  # the rest FSDP-sharded
    pytest.param(["mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp]", "parallel.dp_strategy=fsdp"],
                 marks=pytest.mark.integration),
    pytest.param(["mesh=2x2x1", "parallel.ep_dims=[dp_replicate,dp]", "parallel.dp_strategy=hsdp"],
                 marks=pytest.mark.integration),
    ["mesh=2x2x1", "parallel.ep_dims=[dp]"],          # experts over dp, replicated over dp_replicate
    pytest.param(["mesh=2x2x1", "parallel.ep_dims=[dp]", "parallel.dp_strategy=hsdp"],  # ... and FSDP-sharded
                 marks=pytest.mark.integration),  # over it (make test: its shards and its checkpoint resume)
    pytest.param(["mesh=2x2x1", "parallel.ep_dims=[dp_replicate]", "parallel.dp_strategy=fsdp"],
                 marks=pytest.mark.integration),
    pytest.param(["mesh=2x1x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp,tp]", "parallel.dp_strategy=hsdp"],
                 marks=pytest.mark.integration),
    pytest.param(["mesh=2x1x2", "plan=lm_moe_tp", "parallel.ep_dims=[tp]"],  # over TP, replicated over 2 DP
                 marks=pytest.mark.integration),
    pytest.param(["mesh=2x1", "parallel.ep_dims=[dp]", "trainer.compile=blocks"],  # compiled around the routing
                 marks=pytest.mark.integration),
    pytest.param(["mesh=1x1", "trainer.compile=blocks"], marks=pytest.mark.integration),
], ids=lambda o: " ".join(o))
def test_every_expert_layout_trains_the_one_process_moe_model(overrides, tmp_path):
    reference = reference_training(compose_config([*MOE, "mesh=1x1"]))
    summary = launch_local(compose_config([*MOE, *overrides]), str(tmp_path))
    error = max_relative_error(summary["losses"], reference["losses"])
    print(f"MoE {' '.join(overrides)}: max relative loss error vs one process {error:.2e}")
    assert error < 1e-5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overrides", [
    ["mesh=pp2x1x1"],                                  # one MoE block per stage
    pytest.param(["mesh=pp2x2x1", "parallel.ep_dims=[dp]", "parallel.pp_schedule=1f1b"],  # + experts over DP
                 marks=pytest.mark.integration),
], ids=lambda o: " ".join(o))
@pytest.mark.integration
def test_under_pipeline_parallelism_the_expert_biased_moe_trains_the_one_process_model(overrides, tmp_path):
    """Balanced by DeepSeek-V3's expert bias (the pooled auxiliary loss is refused under pp):
    each stage's blocks move their biases from the global load of the step's 4 micro-batches, as
    the one-process run moves them from its one batch (the reference loop has no bias).
    TensorBoard shows both stages' layers' load, as one process does."""
    biased = [*MOE, "model.moe.aux_loss_coef=0.0", "model.moe.bias_update_rate=0.01", "parallel.pp_microbatches=4",
              "logger.tensorboard=true"]
    reference = reference_training(compose_config([*biased, "mesh=1x1"]))  # routed and biased by hand
    summary = launch_local(compose_config([*biased, *overrides]), str(tmp_path / "pp"))
    error = max_relative_error(summary["losses"], reference["losses"])
    print(f"MoE {' '.join(overrides)}: max relative loss error vs one process {error:.2e}")
    assert error < 1e-5
    events = read_events(tmp_path / "pp" / "tb")
    for layer in (0, 1):
        logged = [e.value for e in events.Scalars(f"moe/layer{layer}_load_max_over_mean")]
        assert len(logged) == 2
        torch.testing.assert_close(torch.tensor(logged), load_max_over_mean(reference["routing"], layer, every=4),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_on_instruction_data_with_activation_checkpointing_experts_over_2_ranks_train_the_one_process_model(
        prepared, tmp_path):
    """Masked targets (only the responses count: one all-reduce of the count) and recomputed
    blocks (whose routing is counted once): the loss curve of one process."""
    sft = ["recipe=lm_files", "data=instructions", f"data.path={prepared['instruction']}", "data.dataset.seq_len=32",
           "data.global_batch_size=8", "trainer.progress_bar=false", *MOE[len(TINY_LM):],
           "model.moe.bias_update_rate=0.01"]
    reference = launch_local(compose_config([*sft, "mesh=1x1"]), str(tmp_path / "1x1"))
    spread = launch_local(compose_config([*sft, "mesh=2x1", "parallel.ep_dims=[dp]",
                                          "model.activation_checkpointing=full"]), str(tmp_path / "ep"))
    assert max_relative_error(spread["losses"], reference["losses"]) < 5e-5  # measured 8.5e-7
    assert max_relative_error(reference["losses"], reference_training(compose_config([*sft, "mesh=1x1",
                              "model.moe.bias_update_rate=null"]))["losses"]) > 1e-4  # (the bias moved the routing)


@pytest.mark.timeout(240)
def test_with_micro_batches_expert_parallelism_trains_what_plain_dp_trains(tmp_path):
    """Micro-batching enters the load-balancing loss (its statistics are each global micro-batch's),
    so EP is compared with DP on the same micro-batch split."""
    micro = [*MOE, "mesh=2x1", "data.micro_batch_size=2"]
    plain = launch_local(compose_config(micro), str(tmp_path / "dp"))
    spread = launch_local(compose_config([*micro, "parallel.ep_dims=[dp]"]), str(tmp_path / "ep"))
    assert max_relative_error(spread["losses"], plain["losses"]) < 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides", [
    ["mesh=4x1", "parallel.ep_dims=[dp]"],                                  # 1 expert per rank
    ["mesh=2x2x1", "parallel.ep_dims=[dp]", "parallel.dp_strategy=hsdp"],   # 2 per EP rank, FSDP halves them
], ids=lambda o: " ".join(o))
def test_each_ep_rank_holds_its_share_of_every_blocks_experts(overrides, tmp_path):
    cfg = compose_config([*MOE, *overrides])
    shapes = spawn_ranks(4, expert_shapes, rank_config(cfg), str(tmp_path), "fully_shard")
    for rank_shapes in shapes.values():  # 4 experts of width 32 on dim 32: 1 per rank
        assert rank_shapes == {f"layers.{i}.feed_forward.experts.{w}": shape for i in (0, 1)
                               for w, shape in (("w1", [1, 32, 32]), ("w2", [1, 32, 32]), ("w3", [1, 32, 32]))}


@pytest.mark.integration  # (15 s; make test keeps the experts' parity and their shards per rank)
@pytest.mark.timeout(300)
def test_a_checkpoint_saved_with_experts_over_2_ranks_resumes_over_4_on_one_and_fsdp_sharded(tmp_path):
    reference = reference_training(compose_config([*MOE, "mesh=1x1"]))
    saved = tmp_path / "ep2"
    launch_local(compose_config([*MOE, "mesh=2x1", "parallel.ep_dims=[dp]", "trainer.max_steps=4",
                                 "checkpoint.every=4"]), str(saved))
    for mesh in (["mesh=4x1", "parallel.ep_dims=[dp]"], ["mesh=1x1"],
                 ["mesh=2x2x1", "parallel.ep_dims=[dp]", "parallel.dp_strategy=hsdp"]):  # experts over 2, FSDP over 2
        resumed = launch_local(compose_config([*MOE, *mesh, f"checkpoint.resume={saved / 'checkpoints' / 'step_4'}"]),
                               str(tmp_path / mesh[0]))
        assert max_relative_error(resumed["losses"], reference["losses"]) < 1e-5, mesh


@pytest.mark.parametrize("overrides,message", [
    (["mesh=2x1", "parallel.ep_dims=[ep]"], r"parallel.ep_dims=\['ep'\]: 'ep' is not a mesh dim; name some of "
                                            r"\['dp', 'tp'\], or null"),
    (["mesh=2x2x1cp", "parallel.ep_dims=[cp]"],
     r"parallel.ep_dims=\['cp'\]: 'cp' is neither a DP dim \['dp'\] nor the tp dim 'tp'; experts spread over those"),
    (["mesh=pp2x2x1", "parallel.ep_dims=[pp]"], r"parallel.ep_dims=\['pp'\]: experts cannot spread over the pp dim"),
    (["mesh=4x1", "parallel.ep_dims=[dp]", "model.moe.n_experts=6"],
     r"parallel.ep_dims=\['dp'\]: the EP size 4 must divide the 6 experts of each block"),
    (["mesh=2x1", "model.moe.top_k=5"], r"model.moe.top_k=5: must be between 1 and model.moe.n_experts=4"),
    (["mesh=2x1", "model=lm_tiny", "parallel.ep_dims=[dp]"],
     r"parallel.ep_dims=\['dp'\]: spreads experts, and Transformer has no mixture-of-experts blocks; set it to null"),
    (["mesh=pp2x2x1"], r"objective.aux_coefficients.load_balance=0.1: Transformer reports this auxiliary loss term, "
                       r"which pipeline parallelism cannot add to the last stage's loss yet; set it to 0 \(a mixture "
                       r"of experts can balance with model.moe.bias_update_rate instead\)"),
    (["mesh=2x1", "model.moe.layers=[0,5]"], r"model.moe.layers=\[0, 5\]: name blocks 0 to 1 \(model.n_layers=2\)"),
    (["mesh=2x1", "+objective.aux_coefficients.load_balancing=0.1"],
     r"objective.aux_coefficients.load_balancing=0.1: the model reports no such term; it reports: load_balance"),
], ids=lambda o: " ".join(o) if isinstance(o, list) else None)
def test_bad_expert_configs_are_refused_before_launch_naming_the_key(overrides, message):
    base = [o for o in MOE if not o.startswith("model")] if "model=lm_tiny" in overrides else MOE
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([*base, *overrides]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_step_with_experts_over_2_ranks_issues_the_all_to_alls_counted_by_hand(micro_batches):
    """Per MoE block and micro-batch, forward: the per-expert counts (one all_to_all_single),
    the token slots out and back (two, autograd's); backward: the two again, reversed. Besides:
    one all-reduce of the routing counts per micro-batch (load_balance_loss) and DataParallel's
    one bucketed gradient all-reduce per step (the experts are not in it)."""
    blocks = 2
    counts = count_collectives([*MOE, "mesh=2x1", "parallel.ep_dims=[dp]",
                                f"data.micro_batch_size={4 // micro_batches}"])
    for rank in (0, 1):
        assert counts[rank] == {"c10d.alltoall_base_": blocks * micro_batches,
                                "c10d_functional.all_to_all_single": 4 * blocks * micro_batches,
                                "c10d.allreduce_": micro_batches + 1}, rank


def test_a_sequence_parallel_plan_reaching_the_experts_is_refused_naming_the_entry():
    cfg = compose_config([*MOE, "mesh=1x2", "plan=lm_tp_sp"])
    with open_dict(cfg):  # lm_tp_sp without its feed-forward entries: only the SP norm reaches the experts
        for name in ("w1", "w2", "w3"):
            del cfg.plan[f"layers.*.feed_forward.{name}"]
    with pytest.raises(ConfigError, match=r"plan.layers.\*.ffn_norm.style='sequence_parallel': would hand the "
                                          r"mixture-of-experts blocks sequence shards, which they do not take yet"):
        validate(cfg)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_aux_loss_free_expert_bias_moves_toward_balance_alike_on_every_layout(tmp_path):
    """DeepSeek-V3's bias (model.moe.bias_update_rate): after each step every expert's bias moved
    by the rate times the sign of the mean load minus its own over the global batch, so the
    biases are multiples of the rate, not all zero, and the same with experts over 2 ranks."""
    # the rate under the declared init's router logits (std ~0.1 here): at 0.01 the bias outweighed
    # them in layer 0, whose loads then took turns until every bias was -0.01 (measured)
    biased = [*MOE, "model.moe.aux_loss_coef=0.0", "model.moe.bias_update_rate=0.001", "trainer.max_steps=3",
              "trainer.log_every=1"]  # an odd number of moves: a bias of 0 would mean it never moved
    runs = {}
    for mesh, ranks in ((("mesh=1x1",), 1), (("mesh=2x1", "parallel.ep_dims=[dp]"), 2)):
        (tmp_path / str(ranks)).mkdir()
        runs[mesh] = spawn_ranks(ranks, expert_biases, rank_config(compose_config([*biased, *mesh])),
                                 str(tmp_path / str(ranks)))
    one, spread = runs[("mesh=1x1",)][0], runs[("mesh=2x1", "parallel.ep_dims=[dp]")]
    by_hand = reference_training(compose_config([*biased, "mesh=1x1"]))["routing"].biases  # tests/reference.py
    assert len(one["biases"]) == len(by_hand) == 2
    for i, bias in enumerate(by_hand):
        name = f"layers.{i}.feed_forward.expert_bias"
        steps = bias / 0.001
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)  # whole steps of the rate
        assert bias.abs().sum() > 0 and bias.max() > bias.min(), name
        # sums of +-0.001 in the same order: equal unless a near-tie routed a token elsewhere (measured equal)
        torch.testing.assert_close(one["biases"][name], bias, rtol=1e-5, atol=1e-6, msg=name)
        for rank in (0, 1):
            torch.testing.assert_close(spread[rank]["biases"][name], bias, rtol=1e-5, atol=1e-6, msg=(name, rank))
    assert max_relative_error(spread[0]["losses"], one["losses"]) < 1e-5


@pytest.mark.timeout(240)
def test_a_run_with_the_expert_bias_saved_with_experts_over_2_ranks_resumes_on_one_process_with_its_bias(tmp_path):
    """The bias is model state: the step-4 checkpoint holds each block's bias as the reference
    moved it in 4 steps, and the run resumed without EP goes on along the uninterrupted curve."""
    biased = [*MOE, "model.moe.aux_loss_coef=0.0", "model.moe.bias_update_rate=0.01"]
    reference = reference_training(compose_config([*biased, "mesh=1x1"]))
    saved = tmp_path / "ep2"
    launch_local(compose_config([*biased, "mesh=2x1", "parallel.ep_dims=[dp]", "trainer.max_steps=4",
                                 "checkpoint.every=4"]), str(saved))
    step_4 = saved / "checkpoints" / "step_4"
    dcp_to_torch_save(step_4, tmp_path / "step_4.pt")
    model = torch.load(tmp_path / "step_4.pt", weights_only=False)["model"]
    history = reference["routing"].bias_history[3]
    assert any(bias.abs().sum() > 0 for bias in history)  # (a block's loads may swing it back to 0 by step 4)
    for i, bias in enumerate(history):
        torch.testing.assert_close(model[f"layers.{i}.feed_forward.expert_bias"], bias, rtol=1e-5, atol=1e-6)
    resumed = launch_local(compose_config([*biased, "mesh=1x1", f"checkpoint.resume={step_4}"]), str(tmp_path / "1x1"))
    assert resumed["resumed_from"] and len(resumed["losses"]) == 8
    assert max_relative_error(resumed["losses"], reference["losses"]) < 1e-5


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_stall_before_a_moe_block_names_the_all_to_all_its_peer_waits_in(tmp_path):
    """Rank 1 blocks before its first MoE block in step 3; rank 0 waits in the per-expert
    counts' all-to-all of expert parallelism's dispatch, and the watchdog says so."""
    result = run_cli([*MOE, "mesh=2x1", "parallel.ep_dims=[dp]", TEST_MODELS,
                      "model._target_=tests.workers.BlockingTransformer", "+model.rank=1", "+model.at=3",
                      "+model.where=layers.0.feed_forward", "trainer.stall_timeout_s=4",
                      f"hydra.run.dir={tmp_path}"], timeout=140)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    rank0 = last.split("; rank 0: ")[1].split("; rank 1: ")[0]
    assert rank0.startswith("step 3: data, forward and backward, collective all_to_all_single ("), rank0
    assert "called from exchange (framework/parallel/expert_parallel.py:" in rank0, rank0


@pytest.mark.timeout(240)
def test_verify_proves_experts_over_dp_and_tp_with_attention_tp_against_one_process():
    ok, verdict, rows = verify(compose_config([*MOE, "mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp,tp]",
                                               "verify.steps=2"]))
    assert ok, verdict
    assert any(row["name"] == "layers.0.feed_forward.experts.w1" and row["what"].startswith("grad") for row in rows)


@pytest.mark.timeout(240)
def test_the_dry_run_of_experts_over_dp_and_tp_matches_real_ranks_and_hand_counts(tmp_path):
    """Experts over all 4 ranks of a 2x2 mesh (attention TP): the dry run's parameter, gradient
    and optimizer bytes are those the real run's ranks record in summary.json, its collectives
    those real gloo ranks issue, and its all-to-all bytes the analytic count under the balanced
    routing it assumes: each TP rank sends its half of the replica's token slots."""
    overrides = [*MOE, "mesh=2x2", "plan=lm_moe_tp", "parallel.ep_dims=[dp,tp]", "optim=adamw", "trainer.max_steps=1"]
    real = on_ranks(collectives_of_one_step, overrides)
    reports = dry_run(compose_config([*overrides, "dryrun.ranks=[0,1,2,3]"]))
    memory = launch_local(compose_config(overrides), str(tmp_path))["memory"]["max_over_ranks"]
    blocks, top_k, dim, seq_len, replica_batch = 2, 2, 32, 32, 8 // 2
    slots_sent = replica_batch * seq_len * top_k // 2  # this TP rank's share of its replica's slots
    for report in reports:
        assert counts_per_op(report) == real[report.rank]
        assert [report.parameter_bytes, report.gradient_bytes, report.optimizer_bytes] == \
            [memory["parameters"], memory["gradients"], memory["optimizer_state"]]
        experts = {name: shape for name, shape, _, placement in report.parameters if ".experts." in name}
        assert experts == {f"layers.{i}.feed_forward.experts.{w}": [1, 32, 32] for i in range(blocks)
                           for w in ("w1", "w2", "w3")}  # 4 experts over 4 ranks
        # per block: the slots out and back, forward and backward: 4 all-to-alls of slots_sent x dim fp32
        assert report.collectives[("c10d_functional.all_to_all_single", "dp_tp")] == \
            [4 * blocks, 4 * blocks * slots_sent * dim * 4]
        # per block: the shares gathered over TP forward, the slots' gradient backward
        assert report.collectives[("c10d.allgather_", "tp")][0] == 2 * blocks


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_expert_count_is_refused_before_launch(tmp_path):
    launch_local(compose_config([*MOE, "mesh=1x1", "trainer.max_steps=2", "checkpoint.every=2"]), str(tmp_path / "four"))
    step = tmp_path / "four" / "checkpoints" / "step_2"
    result = run_cli([*MOE, "mesh=1x1", "model.moe.n_experts=8", f"checkpoint.resume={step}",
                      f"hydra.run.dir={tmp_path / 'eight'}"], timeout=100)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(f"checkpoint {step}: model key 'layers.0.feed_forward.gate.weight' has "
                                          f"shape [4, 32] there but [8, 32] in this model"), result.stderr


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_tensorboard_shows_each_layers_expert_load_and_bias_spread_alike_on_every_layout(tmp_path):
    """At each logging step, per MoE layer: the busiest expert's token slots over the mean since the
    last logging step (over the global batches: the same with experts over 2 ranks as on one
    process, >= 1), and the spread of the expert bias (> 0 where it moved; it can move back)."""
    logged = [*MOE, "logger.tensorboard=true", "model.moe.bias_update_rate=0.001", "trainer.log_every=2"]  # (see above)
    routing = reference_training(compose_config([*logged, "mesh=1x1"]))["routing"]  # tests/reference.py's counts
    events = {}
    for mesh in (["mesh=1x1"], ["mesh=2x1", "parallel.ep_dims=[dp]"]):
        launch_local(compose_config([*logged, *mesh]), str(tmp_path / mesh[0]))
        events[mesh[0]] = read_events(tmp_path / mesh[0] / "tb")
    for layer in (0, 1):
        by_hand = load_max_over_mean(routing, layer, every=2)
        spread = torch.tensor([float(biases[layer].max() - biases[layer].min()) for biases in routing.bias_history[1::2]])
        assert len(by_hand) == 4 and by_hand.max() > 1 and spread.max() > 0
        for mesh, ev in events.items():  # the global batches' counts, pooled alike on both
            torch.testing.assert_close(torch.tensor([e.value for e in ev.Scalars(f"moe/layer{layer}_load_max_over_mean")]),
                                       by_hand, rtol=1e-5, atol=1e-6, msg=mesh)
            torch.testing.assert_close(torch.tensor([e.value for e in ev.Scalars(f"moe/layer{layer}_bias_spread")]),
                                       spread, rtol=1e-5, atol=1e-6, msg=mesh)
