"""Long context: document-masked packing (framework.models.documents) against each document run
alone, by the framework's LM and by transformers; context parallelism
(framework.parallel.context_parallel) against one process on every layout it composes with."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.data.datasets import TokenDataset
from framework.inspect import count_collectives
from framework.launch.handoff import rank_config
from framework.launch.local import launch_local, spawn_ranks
from framework.models.transformer import Transformer
from framework.parallel.context_parallel import chunk_indices
from framework.verify import verify
from tests.conftest import TEST_MODELS, compose_config
from tests.errors import max_relative_error, relative_error
from tests.reference import reference_training
from tests.workers import one_step_gradients

# The tiny LM on the packed prepared text, documents masked; SGD at a constant rate, no clipping,
# so any gradient error shows in the loss.
PACKED = ["recipe=lm_files", "model=lm_tiny", "model.vocab_size=256", "plan=none", "data.dataset.seq_len=32",
          "data.global_batch_size=8", "trainer.progress_bar=false", "logger.tensorboard=false", "optim=sgd",
          "~optim.betas", "optim.lr=0.5", "trainer.warmup_steps=0", "trainer.lr_decay=constant",
          "trainer.grad_clip=null", "trainer.eval_every=null", "trainer.max_steps=8", "trainer.log_every=4"]
LONGER = pytest.mark.integration  # more layouts of what the default suite proves: make test-integration


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> str:
    """Packed byte tokens of 600 documents of 12 to 60 tokens (a line each): a window of 32
    holds one to three documents, and most windows cut one."""
    from framework.prepare import main as prepare

    root = tmp_path_factory.mktemp("documents")
    (root / "lines.txt").write_text("".join(f"doc {i}: {'the mesh trains ' * (i % 4)}one model\n" for i in range(600)))
    assert prepare([str(root / "lines.txt"), "--txt-lines", "--out", str(root / "packed")]) == 0
    return str(root / "packed")


@pytest.fixture(scope="module")
def hf_documents(hf_dirs, documents) -> str:
    """The same lines prepared with the Hugging Face test models' tokenizer."""
    from framework.prepare import main as prepare

    out = os.path.join(os.path.dirname(documents), "hf_packed")
    lines = os.path.join(os.path.dirname(documents), "lines.txt")
    assert prepare([lines, "--txt-lines", "--tokenizer", hf_dirs["llama"], "--out", out]) == 0
    return out


def documents_of(row_positions: torch.Tensor):
    """(start, end) of each document in a window, from its tokens' positions."""
    starts = (row_positions == 0).nonzero().flatten().tolist()
    return list(zip(starts, starts[1:] + [len(row_positions)]))


def logits_document_by_document(model_logits, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each window's logits made by running each of its documents alone, as its own sequence."""
    rows = []
    for row, row_positions in zip(inputs, positions):
        rows.append(torch.cat([model_logits(row[None, a:b])[0] for a, b in documents_of(row_positions)]))
    return torch.stack(rows)


def test_a_packed_window_of_three_documents_is_the_three_documents_run_one_by_one():
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)
    lengths = [5, 7, 4]
    window = torch.randint(0, 64, (1, 17))
    inputs, targets = window[:, :-1], window[:, 1:]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(inputs, positions=positions)
    F.cross_entropy(packed.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone = logits_document_by_document(model, inputs, positions)
    F.cross_entropy(alone.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    # a masked window against each document alone: the worst element used 21% of 1e-5 / 1e-6
    torch.testing.assert_close(packed, alone, rtol=5e-5, atol=5e-6)
    for name, p in model.named_parameters():  # (12% of it)
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=5e-5, atol=5e-6, msg=name)
    assert (model(inputs) - alone).abs().max() > 1e-2  # plain causal attention sees across documents


def test_flex_attentions_block_mask_computes_what_the_dense_mask_does():
    """The CUDA path (FlexAttention) against the CPU one, forward only: FlexAttention has no CPU
    backward in torch 2.13, eager or compiled (asserted below, so a torch that adds one fails
    here and its backward gets compared too), and no GPU has run it yet."""
    from framework.models.documents import attention_layout

    torch.manual_seed(0)
    model = Transformer(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)
    tokens = torch.randint(0, 64, (2, 32))
    positions = torch.stack([torch.cat([torch.arange(11), torch.arange(21)]),
                             torch.cat([torch.arange(5), torch.arange(20), torch.arange(7)])])
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
        freqs = model.rope.freqs(model.head_dim, "cpu")
        dense, flex = (model.run_blocks(model.layers, h, attention_layout(freqs, positions, h, flex=f))
                       for f in (False, True))
    torch.testing.assert_close(flex, dense, rtol=5e-5, atol=5e-6)  # (13% of 1e-5 / 1e-6 used)
    h = model.tok_embeddings(tokens)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        model.run_blocks(model.layers, h, attention_layout(freqs, positions, h, flex=True)).sum().backward()


def test_a_tokens_loss_does_not_change_when_the_document_before_it_does():
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    window = torch.randint(0, 64, (1, 16))
    other = window.clone()
    other[0, :6] = torch.randint(0, 64, (6,))  # the first document, other text of the same length
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
    with torch.no_grad():
        first, second = model(window, positions=positions), model(other, positions=positions)
    torch.testing.assert_close(first[:, 6:], second[:, 6:], rtol=1e-5, atol=1e-6)
    assert (first[:, :6] - second[:, :6]).abs().max() > 1e-3


def test_packed_samples_carry_their_tokens_positions_in_their_documents(documents):
    data = TokenDataset(documents, seq_len=32, document_masking=True)
    starts = np.load(f"{documents}/doc_offsets.npy")
    for index in (0, 1, 7):
        inputs, targets, positions = data[index]
        begin = index * 32
        for i, position in enumerate(positions.tolist()):
            first = max(begin, int(starts[starts <= begin + i].max()))  # its document's first token in the window
            assert position == begin + i - first
        assert torch.equal(targets[:-1], inputs[1:])
    assert sum(int((data[i][2] == 0).sum()) for i in range(10)) > 15  # windows hold several documents
    assert len(TokenDataset(documents, seq_len=32)[0]) == 2  # without masking: inputs and targets


def test_hf_llama_on_a_packed_window_equals_transformers_on_each_document_alone(hf_dirs):
    from framework.models.hf import hf_name
    from tests.hf_models import reference
    from tests.test_hf import loaded

    path = hf_dirs["llama"]
    ours, theirs = loaded(path), reference(path)
    torch.manual_seed(0)
    window = torch.randint(0, 256, (2, 25))
    inputs, targets = window[:, :-1], window[:, 1:]
    positions = torch.stack([torch.cat([torch.arange(9), torch.arange(15)]),
                             torch.cat([torch.arange(4), torch.arange(12), torch.arange(8)])])
    loss = F.cross_entropy(ours(inputs, positions=positions).flatten(0, 1), targets.flatten())
    loss.backward()
    ref_loss = F.cross_entropy(logits_document_by_document(lambda t: theirs(t).logits, inputs, positions).flatten(0, 1),
                               targets.flatten())
    ref_loss.backward()
    assert relative_error(loss.item(), ref_loss.item()) <= 1e-5
    ref_grads = {name: p.grad for name, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        ref = ref_grads[hf_name(name)]
        assert relative_error(p.grad, ref) <= 1e-5, name


def test_each_cp_rank_holds_a_head_and_a_tail_chunk():
    assert chunk_indices(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_indices(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_indices(32, r, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides", [
    pytest.param(["mesh=2x1"], marks=LONGER),                            # DP
    ["mesh=1x2", "plan=lm_tp_sp"],                                       # TP + SP
    pytest.param(["mesh=2x1", "parallel.dp_strategy=fsdp"], marks=LONGER),   # FSDP
    ["mesh=pp2x1x1"],                                                    # PP: positions to every stage
    ["mesh=1x2x1cp"],                                                    # CP
    pytest.param(["mesh=1x4x1cp"], marks=LONGER),
    pytest.param(["mesh=1x2x2cp", "plan=lm_tp_sp"], marks=LONGER),      # CP x TP + SP (make test: verify proves it)
    pytest.param(["mesh=2x2x1cp", "parallel.dp_strategy=fsdp"], marks=LONGER),  # CP ranks join FSDP's shards
    pytest.param(["mesh=pp2x1x2x1cp"], marks=LONGER),                    # PP x CP
    pytest.param(["mesh=1x2x1cp", "data.micro_batch_size=2", "model.activation_checkpointing=full"], marks=LONGER),
    pytest.param(["mesh=1x2x1cp", "trainer.compile=blocks"], marks=LONGER),   # the mask and gathers compiled
    pytest.param(["mesh.shape=[2,1,2,1]", "mesh.dim_names=[dp_replicate,dp,cp,tp]", "parallel.dp_strategy=hsdp"],
                 marks=LONGER),                                          # cp joins hsdp's shard dim
], ids=lambda o: " ".join(o))
def test_every_layout_trains_the_one_process_model_on_document_masked_data(overrides, documents, tmp_path):
    reference = reference_training(compose_config([*PACKED, f"data.path={documents}", "mesh=1x1"]))
    summary = launch_local(compose_config([*PACKED, f"data.path={documents}", *overrides]), str(tmp_path))
    error = max_relative_error(summary["losses"], reference["losses"])
    print(f"document masking, {' '.join(overrides)}: max relative loss error vs one process {error:.2e}")
    assert error < 1e-5


def test_document_masking_changes_what_the_model_learns_from_the_same_windows(documents):
    """So the layout tests above would see a mesh that dropped the positions. The first loss,
    by hand: the initial model run on each document alone (masked) or on the whole window (plain)."""
    from tests.test_hf import first_global_batch

    cfgs = {on: compose_config([*PACKED, f"data.path={documents}", "mesh=1x1", f"data.document_masking={on}",
                                "trainer.max_steps=24"])
            for on in (True, False)}
    masked, plain = (reference_training(cfgs[on]) for on in (True, False))
    torch.manual_seed(cfgs[True].trainer.seed)
    model = instantiate(cfgs[True].model)
    inputs, targets, positions = first_global_batch(cfgs[True])
    with torch.no_grad():
        alone = F.cross_entropy(logits_document_by_document(model, inputs, positions).flatten(0, 1), targets.flatten())
        window = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    # each document alone against the window's block mask: other shapes (measured equal here)
    assert relative_error(masked["losses"][0], alone) <= 1e-5
    assert relative_error(plain["losses"][0], window) <= 1e-5
    # the declared init starts every logit near 0, so the first losses hardly tell the masks apart
    # (measured 3.6e-5 since then, 2.1e-3 before); what the model then learns in 24 steps does
    # (measured 2.5e-2; 1.0e-3 in the first 8). The first loss's 3.6e-5 is still far above the
    # rounding of one loss computed two ways (1e-7 in fp32): required above a tenth of it
    assert relative_error(alone, window) > 3.6e-6
    assert max_relative_error(masked["losses"][1:], plain["losses"][1:]) > 1e-3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh", ["1x2x1cp", pytest.param("2x2x1cp", marks=LONGER)])
def test_a_mixture_of_experts_under_cp_pools_its_routing_over_dp_and_cp_as_one_process(mesh, tmp_path):
    """The load-balancing loss and the expert bias see the whole global batch: each CP rank's
    per-expert counts join the DP ranks' in one all-reduce."""
    from tests.test_moe import MOE

    moe = [*MOE, "model.moe.bias_update_rate=0.01"]
    reference = launch_local(compose_config([*moe, "mesh=1x1"]), str(tmp_path / "one"))
    summary = launch_local(compose_config([*moe, f"mesh={mesh}"]), str(tmp_path / mesh))
    assert max_relative_error(summary["losses"], reference["losses"]) < 1e-5


@pytest.mark.timeout(240)
def test_verify_proves_cp_with_tp_and_names_an_attention_that_rotates_by_its_chunks_places(documents):
    base = [*PACKED, f"data.path={documents}", "verify.steps=2"]
    ok, verdict, _ = verify(compose_config([*base, "mesh=1x2x2cp", "plan=lm_tp_sp"]))
    assert ok, verdict
    ok, verdict, _ = verify(compose_config([*base, "mesh=1x2x1cp", "data.document_masking=false", TEST_MODELS,
                                            "model._target_=tests.workers.WindowRotaryTransformer"]))
    assert not ok
    assert verdict.endswith("first module whose output differs from one process with a matching input: "
                            "layers.0.attention (not in the plan)"), verdict


def gradients_against_transformers_by_document(path: str, result: dict, cfg) -> float:
    """The largest relative gradient error of a sharded run's first step against transformers run
    on each document of the first global batch alone; asserts the loss."""
    from framework.models.hf import hf_name
    from tests.hf_models import reference
    from tests.test_hf import first_global_batch

    inputs, targets, positions = first_global_batch(cfg)
    theirs = reference(path)
    logits = logits_document_by_document(lambda t: theirs(t).logits, inputs, positions)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    assert relative_error(result["loss"], float(loss)) <= 1e-5
    grads = {name: p.grad for name, p in theirs.named_parameters()}
    return max(relative_error(g, grads[hf_name(n)])
               for n, g in result["grads"].items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,overrides", [pytest.param("1x1", [], marks=LONGER), ("1x2x1cp", []),
                                            pytest.param("1x2x2cp", ["plan=lm_tp_sp"], marks=LONGER)])
def test_hf_llama_under_context_parallelism_equals_transformers_on_each_document(mesh, overrides, hf_dirs, hf_documents,
                                                                              tmp_path):
    path = hf_dirs["llama"]
    cfg = compose_config(["recipe=finetune_hf", f"model.path={path}", f"data.path={hf_documents}",
                          "data.dataset.seq_len=32", "data.global_batch_size=4", "trainer.mixed_precision=null",
                          "parallel.dp_strategy=replicate", f"mesh={mesh}", *overrides])
    validate(cfg)
    result = spawn_ranks(int(np.prod(cfg.mesh.shape)), one_step_gradients, rank_config(cfg), str(tmp_path))[0]
    error = gradients_against_transformers_by_document(path, result, cfg)
    print(f"llama {mesh} {overrides}: gradients {error:.1e}")
    assert error <= 1e-5


@pytest.fixture(scope="module")
def saved_on_two_cp_ranks(documents, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp2")
    launch_local(compose_config([*PACKED, f"data.path={documents}", "mesh=1x2x1cp", "trainer.max_steps=4",
                                 "checkpoint.every=4"]), str(out))
    return out / "checkpoints" / "step_4"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [["mesh=1x1"], pytest.param(["mesh=1x4x1cp"], marks=LONGER),
                                  pytest.param(["mesh=1x2x2cp", "plan=lm_tp_sp"], marks=LONGER)], ids=" ".join)
def test_a_checkpoint_saved_on_two_cp_ranks_resumes_on_one_on_four_and_with_tp(mesh, documents, saved_on_two_cp_ranks,
                                                                               tmp_path):
    base = [*PACKED, f"data.path={documents}"]
    reference = reference_training(compose_config([*base, "mesh=1x1"]))
    resumed = launch_local(compose_config([*base, *mesh, f"checkpoint.resume={saved_on_two_cp_ranks}"]), str(tmp_path))
    assert resumed["resumed_from"] and max_relative_error(resumed["losses"], reference["losses"]) < 1e-5


@pytest.mark.timeout(240)
def test_a_cp_step_gathers_keys_and_values_once_per_layer_and_scatters_their_gradients_back(documents):
    """Per step on a 2-layer model: forward gathers each layer's keys and values (2 x 2) and the
    tokens' document starts once (1); backward reduce-scatters the key and value gradients (2 x 2);
    DataParallel all-reduces the gradients over the 2 CP ranks in one bucket (1)."""
    counts = count_collectives([*PACKED, f"data.path={documents}", "mesh=1x2x1cp"])
    for rank_counts in counts.values():
        gathers = sum(n for op, n in rank_counts.items() if "all_gather" in op)
        scatters = sum(n for op, n in rank_counts.items() if "reduce_scatter" in op)
        assert (gathers, scatters) == (5, 4), rank_counts


@pytest.mark.parametrize("overrides,message", [
    (["mesh=1x2x1cp", "data.dataset.seq_len=30"],
     r"data.dataset.seq_len=30: must divide into 2 x cp = 4 equal chunks .*; use a multiple of 4"),
    (["mesh=1x2x2cp", "plan=lm_tp_sp", "data.dataset.seq_len=36"],
     r"data.dataset.seq_len=36: must divide into 2 x cp = 4 equal chunks \(context parallelism's head-tail "
     r"layout, each rank's two a multiple of the TP size 2\); use a multiple of 8"),
    (["mesh=1x2x1cp", "mesh.dim_names=[cp,dp,tp]"], r"mesh.dim_names=\['cp', 'dp', 'tp'\]: the CP dim 'cp' goes "
                                                    r"inside the DP and PP dims"),
    (["data=byte_corpus", "data.document_masking=true"],
     r"data.document_masking=True: framework.data.ByteCorpus has no document boundaries"),
    (["mesh=2x2x1cp", "model=lm_moe_tiny", "plan=none", "parallel.ep_dims=[dp]"],
     r"parallel.ep_dims=\['dp'\]: not yet with context parallelism \(parallel.cp_dim\): the all-to-all would "
     r"route each CP rank's chunks apart; use parallel.ep_dims=null"),
])
def test_bad_long_context_configs_are_refused_naming_the_key(overrides, message, documents):
    cfg = compose_config([*PACKED, f"data.path={documents}", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_a_cp_dim_with_a_model_without_attention_is_refused():
    cfg = compose_config(["recipe=seed_ddp_tp", "mesh=1x2x1cp", "plan=none"])
    with pytest.raises(ConfigError, match=r"parallel.cp_dim='cp': context parallelism splits the sequences of a "
                                          r"model with attention \(framework.models.Transformer\); SeedMLP has none"):
        validate(cfg)


@pytest.mark.timeout(120)
def test_the_dry_run_counts_a_cp_steps_gathers_and_their_bytes_by_hand(documents):
    """lm_tiny (4 heads of 8, 2 layers), 8 sequences of 32 tokens, cp=2: each rank's keys and
    values are 8 x 16 x 4 x 8 fp32 per layer, gathered twice per layer, and the document starts
    8 x 16 int64 once; each rank keeps about half the activations one process keeps."""
    from framework.dryrun import dry_run

    base = [*PACKED, f"data.path={documents}", "dryrun.ranks=[0,1]"]
    whole = dry_run(compose_config([*base, "mesh=1x1", "dryrun.ranks=[0]"]))[0]
    for report in dry_run(compose_config([*base, "mesh=1x2x1cp"])):
        gathers = {key: value for key, value in report.collectives.items() if "all_gather" in key[0]}
        assert sum(count for count, _ in gathers.values()) == 5
        assert sum(size for _, size in gathers.values()) == 2 * 2 * (8 * 16 * 4 * 8 * 4) + 8 * 16 * 8
        assert sum(count for (op, _), (count, _) in report.collectives.items() if "reduce_scatter" in op) == 4
        assert report.parameter_bytes == whole.parameter_bytes  # cp shards no weights
        assert 0.4 < report.activation_bytes / whole.activation_bytes < 0.75, report.activation_bytes
