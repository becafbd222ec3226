"""Bad input of the newer features (LoRA, MoE, CP, DPO, torchft, HF MoE, the planner), refused
as a user meets it: through the command line, exit 2, one line naming the key and the fix,
before any rank starts or any job dir is made. Every case is also checked in this process
(validate, the planner's main), which takes a fraction of a second where a command takes four:
the command line runs a few cases in make test (LoRA, MoE, DPO, the planner) and the rest in
make test-integration."""
import re

import pytest

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.planner.__main__ import main as planner_main
from tests.conftest import TINY_LM, compose_config, run_cli
from tests.hf_models import make_hf_model

LORA = [*TINY_LM, "plan=none", "mesh=1x1", "adapter=lora"]
MOE = ["recipe=lm_moe", "model=lm_moe_tiny", "data.dataset.max_bytes=65536", "data.dataset.seq_len=32"]
PLANNER = [*TINY_LM, "planner.world=2", "planner.device=h100"]  # a published profile: nothing is calibrated
NOT_A_CALIBRATION = '{"host": "this'

TRAIN_REFUSALS = [
    ([*LORA, "adapter.targets=[]"], r"adapter.targets=\[\]: names no layer; name the linear layers to adapt, "
                                    r"e.g. \[wq, wv\]"),
    ([*LORA, "adapter.alpha=0"], r"adapter.alpha=0.0: must be > 0: the update is scaled by alpha / rank"),
    ([*LORA, "adapter.alpha=-16"], r"adapter.alpha=-16.0: must be > 0"),
    ([*LORA, "adapter.dropout=1.0"], r"adapter.dropout=1.0: must be in \[0, 1\): the probability of zeroing an input"),
    ([*LORA, "adapter.dropout=-0.1"], r"adapter.dropout=-0.1: must be in \[0, 1\)"),
    ([*LORA, "adapter.dropout=0.1", "mesh=1x2", "plan=lm_tp"],
     r"adapter.dropout=0.1: not yet with tensor parallelism \(parallel.tp_dim\): each TP rank would draw its own "
     r"mask of the adapter's input; use adapter.dropout=0 or a mesh without TP"),
    ([*MOE, "model.moe.top_k=0"], r"model.moe.top_k=0: must be between 1 and model.moe.n_experts=4"),
    ([*MOE, "model.moe.n_experts=0"], r"model.moe.n_experts=0: must be >= 1 \(for a dense block, leave the block "
                                      r"out of model.moe.layers\)"),
    ([*MOE, "model.moe.bias_update_rate=-0.001"],
     r"model.moe.bias_update_rate=-0.001: must be > 0 \(the bias's step toward the mean load\), or null for no bias"),
    ([*MOE, "model.moe.aux_loss_coef=-0.01"], r"model.moe.aux_loss_coef=-0.01: must be >= 0"),
    ([*MOE, "model.moe.layers=[]"], r"model.moe.layers=\[\]: names no block, so the model would be dense; name some "
                                    r"blocks, null for all, or model.moe=null"),
    ([*MOE, "parallel.ep_dims=[dp,dp]"], r"parallel.ep_dims=\['dp', 'dp'\]: names a dim twice; name each dim once"),
    ([*TINY_LM, "mesh=1x2x1cp", "plan=none", "parallel.cp_dim=dp"],
     r"parallel.cp_dim='dp': CP needs a mesh dim of its own, apart from DP's, TP's and PP's"),
    (["model=lm_tiny", "mesh=1x2x1cp", "plan=none", "data=synthetic_regression"],
     r"parallel.cp_dim='cp': context parallelism splits token sequences; this data has no data.dataset.seq_len"),
    ([*TINY_LM, "mesh=1x2x1cp", "plan=none", "data.dataset.seq_len=30"],
     r"data.dataset.seq_len=30: must divide into 2 x cp = 4 equal chunks"),
    ([*TINY_LM, "mesh=4x1", "plan=none", "launcher.fault_tolerance=torchft", "parallel.dp_strategy=fsdp"],
     r"launcher.fault_tolerance='torchft': not yet with parallel.dp_strategy=fsdp / hsdp: FSDP2's reduce-scatter "
     r"has no torchft hook here; use parallel.dp_strategy=replicate"),
    ([*TINY_LM, "mesh=1x2", "launcher.fault_tolerance=torchft"],
     r"mesh.shape=\[1, 2\]: fault_tolerance=torchft needs at least 2 DP replicas"),
]


def short(overrides: list) -> str:
    return " ".join(overrides[len(TINY_LM):] if overrides[:len(TINY_LM)] == TINY_LM else overrides)


ON_THE_COMMAND_LINE = {"adapter.targets=[]", "model.moe.layers=[]"}  # (and DPO and the planner below)


def one_per_feature(cases: list, first: set) -> list:
    """The cases, those not in `first` marked integration (their command-line runs)."""
    return [pytest.param(*case, id=short(case[0]),
                         marks=() if first & set(case[0]) else pytest.mark.integration) for case in cases]


@pytest.mark.parametrize("overrides,line", TRAIN_REFUSALS, ids=[short(o) for o, _ in TRAIN_REFUSALS])
def test_a_bad_config_of_a_new_feature_is_refused_by_validation(overrides, line):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config(overrides))
    assert re.match("config error: " + line, str(refused.value)), str(refused.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,line", one_per_feature(TRAIN_REFUSALS, ON_THE_COMMAND_LINE))
def test_a_bad_config_of_a_new_feature_is_refused_in_one_line_before_launch(overrides, line, tmp_path):
    refused_in_one_line(run_cli([*overrides, f"hydra.run.dir={tmp_path / 'job'}"], timeout=110), line)
    assert not (tmp_path / "job").exists()  # no job dir, so no rank started


def refused_in_one_line(result, line: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.match("config error: " + line, lines[0]), lines[0]
    assert "DeviceMesh" not in result.stdout


@pytest.mark.timeout(120)
def test_dpo_under_pipeline_parallelism_is_refused_as_not_yet(hf_dirs, prepared, tmp_path):
    result = run_cli(["recipe=dpo_hf", f"model.path={hf_dirs['llama']}", f"data.path={prepared['preference']}",
                      "data.tokenizer=null", "data.dataset.seq_len=24", "data.global_batch_size=4", "mesh=pp2x1x1",
                      f"hydra.run.dir={tmp_path / 'job'}"], timeout=110)
    refused_in_one_line(result, r"objective='dpo': not yet with pipeline parallelism \(parallel.pp_dim\)")


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend,line", [
    ("native", r"model.backend='native': config.json sets router_jitter_noise: 0.1 \(noise on the experts' input in "
               r"training\), which this framework does not implement; use model.backend=transformers"),
    # auto falls back to transformers' classes, which refuse the recipe's document masking: both reasons
    ("auto", r"data.document_masking=True: mixtral runs on transformers' own classes \(model.backend=auto: "
             r"config.json sets router_jitter_noise: 0.1 .*\): .*; set data.document_masking=false$")])
def test_a_hugging_face_mixture_with_router_noise_is_refused_naming_its_config_key(hf_dirs, tmp_path, backend, line):
    path = make_hf_model("mixtral", str(tmp_path / "mixtral"), router_jitter_noise=0.1)
    result = run_cli(["recipe=finetune_hf", f"model.path={path}", f"model.backend={backend}",
                      f"data.path={hf_dirs['tokens']}", "data.tokenizer=null", "data.dataset.seq_len=24",
                      "data.global_batch_size=4", "mesh=1x1", f"hydra.run.dir={tmp_path / 'job'}"], timeout=110)
    refused_in_one_line(result, line)
    if backend == "auto":  # without it the recipe trains there, its TP plan unused on one TP rank, and says where
        result = run_cli(["recipe=finetune_hf", f"model.path={path}", "data.document_masking=false",
                          f"data.path={hf_dirs['tokens']}", "data.tokenizer=null", "data.dataset.seq_len=24",
                          "data.global_batch_size=4", "mesh=1x1", "trainer.max_steps=2",
                          f"hydra.run.dir={tmp_path / 'trains'}"], timeout=110)
        assert result.returncode == 0, result.stderr[-3000:]
        assert re.search(r"model weights from the Hugging Face model in .*mixtral into transformers' "
                         r"MixtralForCausalLM \(model.backend=auto: config.json sets router_jitter_noise: 0.1",
                         result.stdout + result.stderr)


PLANNER_REFUSALS = [
    (["planner.world=0"], r"planner.world=0: give the number of ranks to plan for, e.g. planner.world=8"),
    (["planner.dims=[pp,tp]"], r"planner.dims=\['pp', 'tp'\]: lacks dp; the planner factorizes dp and any of "
                               r"pp, cp, tp"),
    (["planner.strategies=[]"], r"planner.strategies=\[\]: weighs any of replicate, fsdp, hsdp"),
    (["--confirm", "0"], r"--confirm='0': give how many of the top layouts to run for real, e.g. --confirm 3"),
    (["--confirm", "x"], r"--confirm='x': give how many of the top layouts"),
    (["--confirm", "2"], r"planner.device='h100': --confirm runs the layouts here, on this host's CPU; plan for "
                         r"planner.device=cpu to confirm"),
    (["planner.device=cpu", "planner.calibration=CALIBRATION"],
     r"planner.calibration='.*calibration.json': is not a calibration file \(.*\); re-calibrate \(--calibrate\)"),
    (["optim.lr=-1"], r"planner.world=2: validation refuses every layout; the first, .*, with: optim.lr=-1: AdamW "
                      r"refuses it: Invalid learning rate: -1"),
]


def planner_arguments(arguments: list, tmp_path) -> list:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(NOT_A_CALIBRATION)
    return [*PLANNER, *(a.replace("CALIBRATION", str(calibration)) for a in arguments)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("arguments,line", PLANNER_REFUSALS, ids=[" ".join(a) for a, _ in PLANNER_REFUSALS])
def test_a_bad_planner_command_is_refused_by_its_main(arguments, line, tmp_path, capsys):
    assert planner_main(planner_arguments(arguments, tmp_path)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.match("config error: " + line, lines[0]), lines


@pytest.mark.timeout(150)
@pytest.mark.parametrize("arguments,line", one_per_feature(PLANNER_REFUSALS, {"planner.world=0"}))
def test_a_bad_planner_command_is_refused_in_one_line(arguments, line, tmp_path):
    refused_in_one_line(run_cli(planner_arguments(arguments, tmp_path), module="framework.planner", timeout=140), line)


# Data, loggers and their keys (issue 63): PACKED, PROMPTS and JSONL stand for prepared token data,
# prepared prompts and a JSONL file of prompt / response records (made in the test).
FILES = ["recipe=lm_files", "model=lm_tiny", "plan=none", "mesh=1x1", "data.global_batch_size=4",
         "data.dataset.seq_len=16", "data.path=PACKED"]
MIXED = [*FILES, "data=mixture", "data.tokenizer=bytes",
         "+data.dataset.sources.a={weight: 0.5, dataset: {_target_: framework.data.TokenDataset, path: PACKED}}"]
GRPO = ["recipe=grpo_lm", "data.path=PROMPTS", "mesh=1x1", "data.dataset.seq_len=64", "objective.max_new_tokens=8"]
HF = [*FILES, "data=hf_instructions", "data.path=JSONL", "data.tokenizer=bytes"]
DATA_REFUSALS = [
    ([*MIXED, "data.dataset.num_samples=-5"], r"data.dataset.num_samples=-5: must be an integer >= 1 \(samples per "
                                              r"epoch of the mixture\), or null for the sources' samples summed"),
    ([*MIXED, "data.dataset.num_samples=0"], r"data.dataset.num_samples=0: must be an integer >= 1"),
    ([*MIXED, "data.dataset.seed=-1"], r"data.dataset.seed=-1: must be an integer >= 0 \(the draws' seed\)"),
    ([*MIXED[:-1], MIXED[-1].replace("0.5", "nan")],
     r"data.dataset.sources.a.weight=nan: give each source a finite weight >= 0"),
    ([*MIXED[:-1], MIXED[-1].replace("0.5", "inf")], r"data.dataset.sources.a.weight=inf: give each source a finite"),
    ([*MIXED, "data.dataset.seq_len=0"], r"data.dataset.seq_len=0: must be an integer >= 1 \(tokens per sample\)"),
    ([*FILES, "data.dataset.seq_len=-3"], r"data.dataset.seq_len=-3: must be an integer >= 1"),
    ([*FILES, "data.dataset.val_fraction=1.0"], r"data.dataset.val_fraction=1.0: must be in \[0, 1\): the share of "
                                                r"the data held out"),
    ([*FILES, "data.dataset.val_fraction=nan"], r"data.dataset.val_fraction=nan: must be in \[0, 1\)"),
    ([*FILES, "data.num_workers=-1"], r"data.num_workers=-1: must be >= 0"),
    ([*FILES, "logger=[tensorboard,tensorboard]"], r"logger=\['tensorboard', 'tensorboard'\]: names tensorboard "
                                                   r"twice; name each logger once"),
    ([*FILES, "logger=[tensorboard,wandbx]"], r"logger=\['tensorboard', 'wandbx'\]: wandbx is no logger config; the "
                                              r"logger configs are: mlflow, tensorboard, wandb"),
    ([*GRPO, "data.dataset.pad_id=-1"], r"data.dataset.pad_id=-1: must be a token id of bytes \(0 to 255\), or null "
                                        r"for its EOS"),
    ([*GRPO, "data.dataset.pad_id=256"], r"data.dataset.pad_id=256: must be a token id of bytes \(0 to 255\)"),
    ([*HF, "data.dataset.prompt_field=response"],
     r"data.dataset.prompt_field='response': is also data.dataset.response_field: a record's parts come from "
     r"different columns; name each its own"),
]
DATA_ON_THE_COMMAND_LINE = {"data.dataset.num_samples=-5", "logger=[tensorboard,tensorboard]"}


@pytest.fixture
def data_paths(prepared, tmp_path) -> dict:
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(f'{{"prompt": "q{i}?", "response": "a{i}"}}\n' for i in range(64)))
    return {"PACKED": prepared["packed"], "PROMPTS": prepared["prompts"], "JSONL": str(jsonl)}


def with_paths(overrides: list, paths: dict) -> list:
    for name, path in paths.items():
        overrides = [o.replace(name, path) for o in overrides]
    return overrides


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,line", DATA_REFUSALS, ids=[o[-1] for o, _ in DATA_REFUSALS])
def test_bad_data_and_logger_keys_are_refused_by_validation(overrides, line, data_paths):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config(with_paths(overrides, data_paths)))
    assert re.match("config error: " + line, str(refused.value)), str(refused.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,line", [
    pytest.param(o, line, id=o[-1], marks=() if DATA_ON_THE_COMMAND_LINE & set(o) else pytest.mark.integration)
    for o, line in DATA_REFUSALS])
def test_bad_data_and_logger_keys_are_refused_in_one_line_before_launch(overrides, line, data_paths, tmp_path):
    """Before: num_samples=-5 ended in a 13-line traceback, a NaN weight in Hydra's instantiation
    error, a logger named twice trained with it merged."""
    result = run_cli([*with_paths(overrides, data_paths), f"hydra.run.dir={tmp_path / 'job'}"], timeout=110)
    refused_in_one_line(result, line)
    assert not (tmp_path / "job").exists()
