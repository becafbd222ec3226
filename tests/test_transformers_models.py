"""Hugging Face causal LMs the native path does not implement, through transformers' own classes
(framework.models.transformers_model), against transformers itself: tiny random models made
with transformers' config classes (tests/hf_models.py's TRANSFORMERS_ARCHITECTURES), fp32."""
import pytest
import torch

from framework.checkpoint.weights import load_hf_weights
from framework.config.errors import ConfigError
from framework.export import export, load_model
from framework.launch.local import launch_local
from framework.models.hf import HF_TARGETS, HFTransformer, materialize
from framework.models.hf_backend import hugging_face_model
from framework.models.transformers_model import TransformersModel
from framework.validate import validate
from tests.conftest import compose_config
from tests.errors import max_relative_error, relative_error
from tests.hf_models import TRANSFORMERS_ARCHITECTURES, make_hf_model, reference
from tests.test_dpo import pairs  # noqa: F401  (a fixture)
from tests.test_grpo import scalars
from tests.test_preference_losses import unpaired  # noqa: F401  (a fixture)
from framework.launch.handoff import rank_config
from framework.launch.local import spawn_ranks
from tests.workers import one_step_gradients
from tests.test_hf import TOKENS, cross_entropy, first_global_batch, hf_config, reference_step, sharded_step_errors

import transformers  # noqa: F401  (the dev extra: a broken install fails, never skips)

IN_MAKE_TEST = "gemma3_text"  # one model per property in make test, the others behind `integration`
# the tp_plan style each of these gives a module, which the framework does not map (TP refused)
UNMAPPED_TP_STYLES = {"llama4_text": ("feed_forward.experts.gate_up_proj", "packed_rowwise"),
                      "deepseek_v3": ("self_attn.kv_a_proj_with_mqa", "mla_kv_a_proj")}


def kinds():
    return [kind if kind == IN_MAKE_TEST else pytest.param(kind, marks=pytest.mark.integration)
            for kind in TRANSFORMERS_ARCHITECTURES]


class ModelDirs(dict):
    """Each kind's model directory, made the first time a test asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, kind: str) -> str:
        self[kind] = make_hf_model(kind, str(self.root / kind))
        return self[kind]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return ModelDirs(tmp_path_factory.mktemp("transformers_models"))


def loaded(path: str, **options) -> torch.nn.Module:
    """One process: model=hf's model on meta, given storage, its weights read by DCP's HF reader."""
    model = hugging_face_model(path, **options)
    materialize(model, "cpu")
    load_hf_weights(model, path)
    return model


def test_auto_takes_the_native_path_where_it_implements_the_model_and_transformers_elsewhere(model_dirs, hf_dirs,
                                                                                            tmp_path):
    assert type(hugging_face_model(hf_dirs["llama"])) is HFTransformer
    assert type(hugging_face_model(model_dirs["gemma3_text"])) is TransformersModel
    assert type(hugging_face_model(hf_dirs["llama"], backend="transformers")) is TransformersModel
    jitter = hugging_face_model(make_hf_model("mixtral", str(tmp_path / "mixtral"), router_jitter_noise=0.1))
    assert type(jitter) is TransformersModel and jitter.chosen_because == (
        "model.backend=auto: config.json sets router_jitter_noise: 0.1 (noise on the experts' input in training), "
        "which this framework does not implement")
    with pytest.raises(ConfigError, match=r"^config error: model.backend='native': config.json's model_type "
                                          r"'gemma3_text' is not supported; supported: llama, .*; use "
                                          r"model.backend=transformers \(or auto\) for transformers' own classes$"):
        hugging_face_model(model_dirs["gemma3_text"], backend="native")
    with pytest.raises(ConfigError, match=r"model.backend='hf': use one of auto, native, transformers"):
        hugging_face_model(hf_dirs["llama"], backend="hf")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no_such_model"}')
    with pytest.raises(ConfigError, match=r"model.path='.*unknown': transformers .* has no causal LM for its "
                                          r"config.json: .*no_such_model"):
        hugging_face_model(str(unknown))
    assert compose_config(["model=hf"]).model._target_ == HF_TARGETS[0] == \
        f"{hugging_face_model.__module__}.{hugging_face_model.__name__}"  # what check_model_path and evaluate read


@pytest.mark.parametrize("kind", kinds())
def test_logits_loss_and_gradients_equal_transformers_on_one_process(kind, model_dirs):
    """The model's logits, and the loss-owned head's (the final hidden states through its
    lm_head), equal transformers' eager model's; one step's loss and gradients too."""
    path = model_dirs[kind]
    ours, theirs = loaded(path), reference(path)
    with torch.no_grad():
        expected = theirs(TOKENS).logits
        error = relative_error(ours(TOKENS), expected)
        head_error = relative_error(ours.output_layer()(ours(TOKENS, skip_output=True)), expected)
    print(f"{kind}: logits relative error {error:.1e}, through the head {head_error:.1e}")
    assert error <= 1e-5 and head_error <= 1e-5  # SDPA against eager: measured up to 7.0e-7 (gemma3_text)
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    loss = cross_entropy(ours(inputs), targets)
    loss.backward()
    ref_loss, ref_grads = reference_step(path, inputs, targets)
    assert relative_error(float(loss), ref_loss) <= 1e-5
    assert {name for name, _ in ours.named_parameters()} == set(ref_grads)  # Hugging Face's names, one to one
    for name, p in ours.named_parameters():
        if ref_grads[name] is not None:
            assert relative_error(p.grad, ref_grads[name]) <= 1e-4, name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh,overrides", [
    ("2x1", ["parallel.dp_strategy=fsdp"]),
    pytest.param("2x1", ["parallel.dp_strategy=replicate"], marks=pytest.mark.integration),
    pytest.param("2x1", ["parallel.dp_strategy=fsdp", "model.activation_checkpointing=full"],
                 marks=pytest.mark.integration),
    pytest.param("2x1", ["parallel.dp_strategy=fsdp", "trainer.loss_chunk_tokens=8"], marks=pytest.mark.integration),
    ("1x2", []),  # TP by the model's own tp_plan (q/k norms, a tied output over a rowwise embedding)
    pytest.param("2x2", ["parallel.dp_strategy=fsdp"], marks=pytest.mark.integration),
])
def test_sharded_loss_and_gradients_equal_transformers(mesh, overrides, model_dirs, tmp_path):
    """FSDP2 by decoder layer (transformers' _no_split_modules) and DP, with activation
    checkpointing and the loss-owned head by chunks of 8 tokens: the first global batch's loss
    and gradients equal transformers' on one process."""
    path = model_dirs[IN_MAKE_TEST]
    logits_error, loss_error, grad_error = sharded_step_errors(path, hf_config(path, f"mesh={mesh}", "plan=none",
                                                                               *overrides), tmp_path, lambda name: name)
    assert logits_error <= 1e-5  # measured 7.0e-7
    assert loss_error <= 1e-5  # measured 8.6e-8
    assert grad_error <= 5e-5  # measured 1.0e-6


@pytest.mark.timeout(240)
def test_a_run_exports_what_transformers_loads_with_equal_logits(model_dirs, tmp_path):
    """Two FSDP2 steps writing their final model (checkpoint.final_hf, each rank its shards),
    and export --format hf of the checkpoint: from_pretrained finds no missing, unexpected or
    mismatched key in either, and both give the same logits, not the untrained model's."""
    path = model_dirs[IN_MAKE_TEST]
    summary = launch_local(hf_config(path, "mesh=2x1", "plan=none", "parallel.dp_strategy=fsdp", "trainer.max_steps=2",
                                     "checkpoint.every=2", "checkpoint.final_hf=true", "logger.tensorboard=false"),
                           str(tmp_path))
    assert len(summary["losses"]) == 2
    export(str(tmp_path / "checkpoints"), str(tmp_path / "exported"), format="hf")
    logits = {}
    for name in ("hf", "exported"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name), output_loading_info=True,
                                                                        attn_implementation="eager")
        assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
        with torch.no_grad():
            logits[name] = model(TOKENS).logits
    with torch.no_grad():
        assert torch.equal(logits["exported"], logits["hf"])  # the same weights, the same ops
        assert relative_error(logits["hf"], reference(path)(TOKENS).logits) > 1e-4  # the steps moved it


@pytest.mark.parametrize("overrides,key,fix", [
    (["mesh=pp2x1x1"], "parallel.pp_dim='pp'", "pipeline parallelism does not split them yet"),
    (["mesh=1x2", "plan=lm_tp"], "plan=", "a TP plan names the native model's modules; use plan=none"),
    (["mesh=1x1", "data.document_masking=true"], "data.document_masking=True", "set data.document_masking=false"),
    (["mesh=1x1", "objective=grpo", "objective.compile_decode=true", "trainer.eval_every=null"], "objective.compile_decode=True",
     "they decode through transformers' own cache: set it to null"),
])
def test_what_the_transformers_path_does_not_do_yet_is_one_line_naming_the_model_type(
        overrides, key, fix, model_dirs):
    cfg = hf_config(model_dirs[IN_MAKE_TEST], "plan=none", *overrides)
    with pytest.raises(ConfigError, match=rf"^config error: {key}.*: gemma3_text runs on transformers' own classes "
                                          rf"\(model.backend=auto: the native path does not implement it\): "
                                          rf".*{fix}"):
        validate(cfg)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_resumed_run_continues_the_uninterrupted_one_bitwise_and_on_another_mesh_within_rounding(model_dirs, tmp_path):
    path = model_dirs[IN_MAKE_TEST]
    run = ["mesh=2x1", "plan=none", "parallel.dp_strategy=fsdp", "checkpoint.every=2", "logger.tensorboard=false",
           "optim=adamw"]
    whole = launch_local(hf_config(path, *run, "trainer.max_steps=4"), str(tmp_path / "whole"))
    launch_local(hf_config(path, *run, "trainer.max_steps=2"), str(tmp_path / "first"))
    resumed = launch_local(hf_config(path, *run, "trainer.max_steps=4",
                                     f"checkpoint.resume={tmp_path / 'first' / 'checkpoints' / 'step_2'}"),
                           str(tmp_path / "resumed"))
    assert resumed["losses"] == whole["losses"]  # (the history from the checkpoint, then steps 3 and 4)
    # on another mesh (TP by the model's own plan, one replica): DCP reshards the model and AdamW's state
    other = launch_local(hf_config(path, *run, "mesh=1x2", "trainer.max_steps=4",
                                   f"checkpoint.resume={tmp_path / 'first' / 'checkpoints' / 'step_2'}"),
                         str(tmp_path / "other_mesh"))
    error = max_relative_error(other["losses"][2:], whole["losses"][2:])
    print(f"resumed on 1x2: losses {error:.1e} relative")
    assert other["losses"][:2] == whole["losses"][:2] and error <= 1e-5  # measured 8.7e-8


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_full_dpo_follows_dpo_computed_by_hand_on_transformers_model(model_dirs, pairs, tmp_path):
    """DPO against a frozen copy (built through the same model lifecycle): the loss curve of
    tests/test_dpo.py's DPO by hand on transformers' own model."""
    from tests.test_dpo import FULL, dpo_by_hand, dpo_overrides

    path = model_dirs[IN_MAKE_TEST]
    cfg = compose_config([*dpo_overrides(path, pairs, steps=3), "mesh=1x1", "plan=none", *FULL])
    summary = launch_local(cfg, str(tmp_path))
    error = max_relative_error(summary["losses"], dpo_by_hand(path, cfg, 3)["losses"])
    print(f"gemma3 DPO: max relative loss error vs by hand {error:.2e}")
    assert error < 1e-4  # measured 1.0e-6


@pytest.mark.timeout(300)
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_a_lora_adapter_loads_in_peft_on_transformers_model_with_equal_logits(adapter, model_dirs, hf_dirs, tmp_path):
    """LoRA on Hugging Face's own layer names (q_proj, v_proj, down_proj): the exported adapter,
    loaded by PEFT onto transformers' model (QLoRA: with those weights' NF4 values, the base
    streamed and quantized one tensor at a time), computes what the checkpoint computes; the
    run's first loss (B is zero: the base alone) is that base's on the first global batch."""
    import peft
    from tests.test_lora import NF4_BLOCKS, QLORA, nf4_rounded

    path = model_dirs[IN_MAKE_TEST]
    cfg = compose_config(["recipe=finetune_hf", f"model.path={path}", f"data.path={hf_dirs['tokens']}", "mesh=1x1",
                          "plan=none", "data.document_masking=false", "data.dataset.seq_len=32",
                          "data.global_batch_size=4", *(QLORA if adapter == "qlora" else ["adapter=lora"]),
                          "adapter.targets=[q_proj,v_proj,down_proj]",
                          "trainer.max_steps=2", "trainer.mixed_precision=null", "optim.lr=0.01",
                          "logger.tensorboard=false", "trainer.progress_bar=false"])
    summary = launch_local(cfg, str(tmp_path))
    export(str(tmp_path / "checkpoints"), str(tmp_path / "adapter"), format="peft")
    base = nf4_rounded(reference(path), *NF4_BLOCKS) if adapter == "qlora" else reference(path)
    inputs, targets = first_global_batch(cfg)
    with torch.no_grad():
        assert relative_error(summary["losses"][0], float(cross_entropy(base(inputs).logits, targets))) <= 1e-5
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))(TOKENS).logits
        ours = load_model(str(tmp_path / "checkpoints"))[0](TOKENS)
        base = reference(path)(TOKENS).logits
    assert relative_error(ours, theirs) <= 1e-5
    assert relative_error(theirs, base) > 1e-4  # the adapters moved


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", [kind for kind in TRANSFORMERS_ARCHITECTURES
                                  if kind != "gemma3_text" and kind not in UNMAPPED_TP_STYLES])
def test_each_model_s_own_tp_plan_trains_what_one_process_trains(kind, model_dirs, tmp_path):
    """1x2 TP by each model's tp_plan (gemma3_text's in make test, above; those with a style the
    framework does not map refused, below): the first global batch's loss and gradients equal transformers' on one process."""
    path = model_dirs[kind]
    errors = sharded_step_errors(path, hf_config(path, "mesh=1x2", "plan=none"), tmp_path, lambda name: name)
    assert errors[0] <= 1e-5 and errors[1] <= 1e-5 and errors[2] <= 5e-5, errors


@pytest.mark.parametrize("kind", UNMAPPED_TP_STYLES)
def test_a_tp_plan_style_the_framework_does_not_map_is_refused_naming_it(kind, model_dirs):
    module, style = UNMAPPED_TP_STYLES[kind]
    with pytest.raises(ConfigError, match=rf"model.path='.*{kind}': {kind}'s tp_plan gives (model\.)?layers.\*.{module} the "
                                          rf"style '{style}', which the framework does not map to a DTensor style"):
        validate(hf_config(model_dirs[kind], "mesh=1x2", "plan=none"))


@pytest.mark.parametrize("kind", kinds())
def test_greedy_generate_equals_transformers_generate_and_the_command_runs(kind, model_dirs, capsys):
    """framework.generate on transformers' classes decodes with the model's own cache: greedy,
    the token ids transformers' eager model gives (do_sample=False), up to the stop id."""
    from framework.generate import generate, main as generate_main

    path = model_dirs[kind]
    prompt = TOKENS[0, :8].tolist()
    ours = generate(loaded(path), prompt, max_new_tokens=24, stop={0})
    output = reference(path).generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=0,
                                      pad_token_id=0)
    theirs = output[0, len(prompt):].tolist()
    assert ours == (theirs[: theirs.index(0) + 1] if 0 in theirs else theirs)
    assert generate_main([path, "--prompt", "hi", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("hi")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,backend", [
    ("deepseek_v3", "auto"),  # experts stored one tensor each, stacked on load
    # Mixtral's block_sparse_moe renamed to mlp, its experts stacked
    pytest.param("mixtral", "transformers", marks=pytest.mark.integration),
])
def test_files_transformers_converts_on_load_train_and_export_as_transformers_reads_and_writes_them(
        kind, backend, tmp_path):
    """Files whose tensors transformers converts on load, read by its own conversion mapping:
    the first global batch's loss and gradients on 2x1 FSDP2 (each rank keeps its part of each
    stacked weight) equal transformers' on one process; export writes them back as the files
    stored them (the same names and shapes, what save_pretrained writes), which from_pretrained
    loads with no missing or unexpected key and the logits of the checkpoint."""
    from safetensors import safe_open

    path = make_hf_model(kind, str(tmp_path / kind))
    run = ["mesh=2x1", "plan=none", "parallel.dp_strategy=fsdp", f"model.backend={backend}"]
    errors = sharded_step_errors(path, hf_config(path, *run), tmp_path, lambda name: name)
    assert errors[0] <= 1e-5 and errors[1] <= 1e-5 and errors[2] <= 5e-5, errors  # measured 2.5e-7, 8.6e-8, 5.9e-7
    launch_local(hf_config(path, *run, "trainer.max_steps=1", "checkpoint.every=1", "logger.tensorboard=false"),
                 str(tmp_path / "run"))
    export(str(tmp_path / "run" / "checkpoints"), str(tmp_path / "exported"), format="hf")

    def shapes(directory):
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys()}

    assert shapes(tmp_path / "exported") == shapes(tmp_path / kind)
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                       output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        ours, theirs = load_model(str(tmp_path / "run" / "checkpoints"))[0](TOKENS), exported(TOKENS).logits
        assert relative_error(ours, theirs) <= 1e-5
        assert relative_error(theirs, reference(path)(TOKENS).logits) > 1e-4  # the step moved it


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,mesh", [("gpt_oss", "1x1"), pytest.param("gpt_oss", "2x1", marks=pytest.mark.integration),
                                       pytest.param("mixtral", "1x1", marks=pytest.mark.integration)])
def test_a_mixture_s_load_balancing_loss_is_transformers_own(kind, mesh, tmp_path):
    """With output_router_logits, transformers' training loss adds router_aux_loss_coef x its
    aux_loss (its load_balancing_loss_func of the forward's router logits): the run's first loss
    and its gradients equal that loss's on one process, written out from transformers' outputs,
    on one process and 2x1 FSDP2 (each replica the term of its own tokens, as DDP under
    transformers' Trainer; with the same tokens a replica the mean of the two)."""
    path = make_hf_model(kind, str(tmp_path / kind), output_router_logits=True, router_aux_loss_coef=0.05)
    cfg = hf_config(path, f"mesh={mesh}", "plan=none", "parallel.dp_strategy=fsdp", "model.backend=transformers")
    assert hugging_face_model(path, backend="transformers").aux_coefficients == {"load_balance": 0.05}
    inputs, targets = first_global_batch(cfg)
    model, replicas = reference(path), cfg.mesh.shape[0]
    losses = []
    for r in range(replicas):  # (the sampler deals the batch's rows out in turn)
        output = model(inputs[r::replicas], output_router_logits=True)
        losses.append(cross_entropy(output.logits, targets[r::replicas]) + 0.05 * output.aux_loss)
        assert float(output.aux_loss) > 0.5  # (top-2 of 4 experts: 1 when balanced)
    loss = torch.stack(losses).mean()
    loss.backward()
    ours = spawn_ranks(replicas, one_step_gradients, rank_config(cfg), str(tmp_path), TOKENS)[0]
    grad_error = max(relative_error(ours["grads"][name], p.grad) for name, p in model.named_parameters())
    print(f"{kind} {mesh}: loss {relative_error(ours['loss'], float(loss)):.1e}, gradients {grad_error:.1e}")
    assert relative_error(ours["loss"], float(loss)) <= 1e-5  # measured 0 on all three
    assert grad_error <= 5e-5  # measured up to 4.6e-7 (mixtral)
    without = cross_entropy(model(inputs).logits, targets)
    assert relative_error(float(without), float(loss)) > 1e-3  # the term weighs


@pytest.mark.parametrize("kind", kinds())
def test_prompts_of_different_lengths_decode_together_as_each_alone_through_the_model_s_own_cache(kind, model_dirs):
    """The framework's decoder sampling through transformers' cache (GRPO's rollouts): left-padded
    side by side, each prompt's rows, greedy and sampled (top-p 0.9, its own generator), are what
    decoding it alone gives; the padding masked, positions counted from each row's first token."""
    from framework.models.decode import generate_groups

    model = loaded(model_dirs[kind]).eval()
    prompts, seeds = [TOKENS[0, :9].tolist(), TOKENS[1, :3].tolist(), TOKENS[0, 4:10].tolist()], [5, 6, 7]
    for temperature in (0.0, 1.0):
        together, lengths = generate_groups(model, prompts, 2, 12, temperature, 0.9,
                                            [torch.Generator().manual_seed(s) for s in seeds], {0}, pad_id=0)
        for p, (prompt, seed) in enumerate(zip(prompts, seeds)):
            alone, alone_lengths = generate_groups(model, [prompt], 2, 12, temperature, 0.9,
                                                   [torch.Generator().manual_seed(seed)], {0}, pad_id=0)
            assert torch.equal(together[2 * p:2 * p + 2], alone) and torch.equal(lengths[2 * p:2 * p + 2],
                                                                                 alone_lengths), (temperature, p)


def grpo_run(path: str, prompts: str, reward_file: str, *overrides: str):
    from tests.test_grpo import grpo_overrides  # (recipe=grpo_lm's, then grpo_hf's over them)

    return compose_config([*grpo_overrides(prompts, reward_file, 3), "recipe=grpo_hf", f"model.path={path}",
                           "data.tokenizer=null", "data.dataset.seq_len=40", "objective.max_new_tokens=8",
                           "objective.group_size=4", "data.global_batch_size=4", "data.micro_batch_size=null",
                           "adapter=none", "optim.lr=0.01", "trainer.mixed_precision=null", "mesh=1x1", *overrides])


@pytest.fixture(scope="module")
def native_grpo(hf_dirs, prepared, tmp_path_factory):
    """3 GRPO steps of the tiny Llama on the native path, one process."""
    from tests.test_grpo import LOWERCASE_SHARE

    out = tmp_path_factory.mktemp("native_grpo")
    (out / "reward.py").write_text(LOWERCASE_SHARE)
    cfg = grpo_run(hf_dirs["llama"], prepared["prompts"], str(out / "reward.py"), "model.backend=native")
    return launch_local(cfg, str(out)), scalars(out / "tb")["reward"], str(out / "reward.py")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [["mesh=1x1"],
                                  pytest.param(["mesh=2x1", "parallel.dp_strategy=fsdp"], marks=pytest.mark.integration)])
def test_grpo_on_transformers_classes_follows_the_native_path_on_the_same_weights(mesh, native_grpo, hf_dirs,
                                                                                 prepared, tmp_path):
    """GRPO generating through transformers' own cache: the same Llama on model.backend=transformers
    draws the completions the native path draws (the same rewards) and learns the same steps."""
    native, native_rewards, reward_file = native_grpo
    summary = launch_local(grpo_run(hf_dirs["llama"], prepared["prompts"], reward_file, "model.backend=transformers",
                                    *mesh), str(tmp_path))
    rewards = scalars(tmp_path / "tb")["reward"]
    error = max_relative_error(summary["grad_norms"], native["grad_norms"])
    print(f"{mesh}: rewards {rewards} vs {native_rewards}, grad norms {error:.1e} relative")
    assert rewards == pytest.approx(native_rewards, abs=1e-6) and len(set(rewards)) > 1  # (rising: it learns)
    assert summary["losses"] == pytest.approx(native["losses"], abs=1e-6)  # (GRPO's loss is ~0 at each step)
    assert error <= 1e-4  # measured 1.1e-7 (1x1), 2.2e-7 (2x1 FSDP2)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_evaluate_scores_a_checkpoint_on_transformers_classes_as_counted_by_hand(model_dirs, hf_dirs, tmp_path,
                                                                                 capsys):
    """framework.evaluate of a gemma3 run's checkpoint (exported, then lm-eval's HFLM on
    transformers' class): next_letter's accuracy is the one counted by hand on the export."""
    from framework.evaluate import main as evaluate
    from tests.test_evaluate import accuracy_by_hand, scored

    path = model_dirs[IN_MAKE_TEST]
    launch_local(hf_config(path, "mesh=1x1", "plan=none", "trainer.max_steps=2", "checkpoint.every=2",
                           "logger.tensorboard=false"), str(tmp_path / "run"))
    ours = scored([str(tmp_path / "run" / "checkpoints"), "--tasks", "next_letter", "--out", str(tmp_path / "eval")],
                  capsys)
    export(str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf"), format="hf")
    assert ours["results"]["next_letter"]["acc,none"] == accuracy_by_hand(str(tmp_path / "hf"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("objective", ["simpo", pytest.param("kto", marks=pytest.mark.integration)])
def test_simpo_and_kto_on_transformers_classes_train_what_the_native_path_trains(objective, hf_dirs, pairs, unpaired,
                                                                                 tmp_path):
    """SimPO and KTO (each TRL's, tests/test_preference_losses.py) on the same Llama through
    transformers' classes: the native path's losses, step by step."""
    from tests.test_dpo import dpo_overrides

    data, extra = ((pairs, ["objective=simpo", "objective.beta=2.0"]) if objective == "simpo" else
                   (unpaired, ["data=kto", "objective.reference=frozen_copy"]))
    run = [*dpo_overrides(hf_dirs["llama"], data, steps=3), "adapter=none", *extra, "optim.lr=0.1", "mesh=1x1",
           "data.global_batch_size=8"]
    native = launch_local(compose_config([*run, "model.backend=native"]), str(tmp_path / "native"))["losses"]
    theirs = launch_local(compose_config([*run, "model.backend=transformers"]), str(tmp_path / "theirs"))["losses"]
    error = max_relative_error(theirs, native)
    print(f"{objective}: losses {theirs} vs native {native}: {error:.1e} relative")
    assert error <= 1e-4 and abs(native[-1] - native[0]) > 1e-2  # (and it learns)
