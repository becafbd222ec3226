"""Every config file composes against the schema, and every shipped combination validates."""
import os
import shutil

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from framework.cli import hydra_error_line
from framework.config.errors import ConfigError
from framework.config.schema import register_schema

from framework.validate import validate
from framework.launch.handoff import rank_config
from tests.conftest import CONF, ROOT, compose_config

GROUPS = ["mesh", "model", "plan", "sampler", "data", "optim", "trainer", "logger"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
# Group files that only make sense together with another group's choice.
PAIRED = {("model", "seed_linear"): ["plan=seed_linear_colwise"],
          ("model", "seed_sequential"): ["plan=seed_sequential_rowwise_colwise"],
          ("plan", "seed_linear_colwise"): ["model=seed_linear"],
          ("plan", "seed_sequential_rowwise_colwise"): ["model=seed_sequential"],
          **{(group, name): ["recipe=lm_2d", f"{group}={name}"]
             for group, name in [("model", "lm_tiny"), ("model", "lm_small"), ("model", "lm_bench"), ("plan", "lm_tp"),
                                 ("plan", "lm_tp_sp"),
                                 ("plan", "lm_tp_sp_loss_parallel"), ("data", "byte_corpus")]},
          ("model", "lm_moe_tiny"): ["recipe=lm_moe", "model=lm_moe_tiny"], ("model", "lm_moe_small"): ["recipe=lm_moe"],
          ("plan", "lm_moe_tp"): ["recipe=lm_moe"],
          ("plan", "qk_norm_moe_tp"): ["recipe=lm_moe", "+model.qk_norm=true", "parallel.ep_dims=[dp,tp]"],
          ("adapter", "lora"): ["recipe=lm_2d", "mesh=2x1", "plan=none"],
          ("adapter", "qlora"): ["recipe=lm_2d", "mesh=2x1", "plan=none"],
          ("data", "preferences"): ["recipe=lm_files", "data=preferences", "adapter=lora"],
          ("objective", "dpo"): ["recipe=lm_files", "data=preferences", "adapter=lora"],
          ("data", "kto"): ["recipe=lm_files", "data=kto", "adapter=lora"],
          **{key: ["recipe=lm_files", "data=prompts", "reward=exact_match", "mesh=2x1", "plan=none",
                   "trainer.eval_every=null", "objective.max_new_tokens=8"]
             for key in [("data", "prompts"), ("objective", "grpo")]},
          **{("mesh", name): ["recipe=lm_3d", f"mesh={name}"] for name in ("pp2x1x1", "pp2x2x1", "pp2x1x2", "pp2x2x2",
                                                                             "pp2x1x2x1cp")},
          **{("mesh", name): ["recipe=lm_2d", f"mesh={name}"] for name in ("1x2x1cp", "1x4x1cp", "1x2x2cp", "2x2x1cp")},
          ("data", "tokens"): ["recipe=lm_files"], ("data", "instructions"): ["recipe=lm_files", "data=instructions"],
          ("data", "random_tokens"): ["recipe=lm_2d", "data=random_tokens"],
          ("data", "hf"): ["recipe=lm_files", "data=hf", "data.tokenizer=bytes", "data.path={root}/chat.jsonl",
                           "data.dataset.text_field=response", "data.dataset.seq_len=16",
                           "+data.dataset.val_fraction=0.2"],
          ("data", "hf_instructions"): ["recipe=lm_files", "data=hf_instructions", "data.tokenizer=bytes",
                                        "data.path={root}/chat.jsonl"],
          ("data", "hf_preferences"): ["recipe=lm_files", "data=hf_preferences", "adapter=lora", "data.tokenizer=bytes",
                                       "data.path={root}/pairs.jsonl"],
          ("data", "mixture"): ["recipe=lm_files", "data=mixture", "data.tokenizer=bytes", "data.dataset.seq_len=16",
                                "+data.dataset.sources.text={{weight: 1, dataset: {{_target_: framework.data.TokenDataset, "
                                "path: '{packed}'}}}}",
                                "+data.dataset.sources.chat={{weight: 1, dataset: {{_target_: framework.data.HFTokenDataset, "
                                "path: '{root}/chat.jsonl', tokenizer: bytes, text_field: prompt}}}}"],
          **{("model", name): ["recipe=lm_2d", f"model={name}", "data=random_tokens", "trainer.eval_every=null"]
             for name in ("llama3_8b", "llama3_70b")}}
# Configs that read prepared token data: which kind (the `prepared` fixture's).
PREPARED = {("data", "tokens"): "packed", ("data", "instructions"): "instruction", ("recipe", "lm_files"): "packed",
            ("data", "preferences"): "preference", ("objective", "dpo"): "preference", ("data", "prompts"): "prompts",
            ("data", "kto"): "unpaired",
            ("objective", "grpo"): "prompts", ("recipe", "grpo_lm"): "prompts"}
# Configs of a Hugging Face model: the `hf_dirs` fixture's keys they need, as overrides.
HF = {("model", "hf"): ["recipe=lm_2d", "model.path={llama}"],
      ("plan", "qk_norm_tp_sp"): ["recipe=lm_2d", "model=hf", "model.path={qwen3}"],
      ("recipe", "finetune_hf"): ["model.path={llama}", "data.path={tokens}", "data.dataset.seq_len=64"],
      ("recipe", "lora_hf"): ["model.path={llama}", "data.path={tokens}", "data.dataset.seq_len=64"],
      ("recipe", "dpo_hf"): ["model.path={llama}", "data.path={preference}", "data.tokenizer=null",
                             "data.dataset.seq_len=64"],
      ("data", "vision"): ["model=hf", "model.path={vlm}", "plan=none", "mesh=1x1", "data.path={colours}"],
      ("data", "vision_preferences"): ["model=hf", "model.path={vlm}", "plan=none", "mesh=1x1",
                                       "data.path={colour_pairs}", "objective.reference=frozen_copy"],
      ("data", "hf_vision"): ["model=hf", "model.path={vlm}", "plan=none", "mesh=1x1", "data.path={vqa}",
                              "data.dataset.prompt_field=question", "data.dataset.response_field=answer"],
      ("recipe", "vlm_sft"): ["model.path={vlm}", "data.path={colours}"],
      ("recipe", "grpo_hf"): ["model.path={llama}", "data.path={prompts}", "data.tokenizer=null",
                              "data.dataset.seq_len=64", "objective.max_new_tokens=16", "data.micro_batch_size=null"]}


def data_path(group: str, option: str, request) -> list:
    """The overrides that point a config at the data or model the fixtures made."""
    if (group, option) in HF:
        paths = {**request.getfixturevalue("hf_dirs"), **request.getfixturevalue("prepared")}
        return [o.format(**paths) for o in HF[group, option]]
    prepared = request.getfixturevalue("prepared")
    return [f"data.path={prepared[PREPARED[group, option]]}"] if (group, option) in PREPARED else []


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_validates(group, option, request):
    prepared = request.getfixturevalue("prepared")
    paired = [o.format(root=os.path.dirname(prepared["packed"]), **prepared) for o in PAIRED.get((group, option), [])]
    cfg = compose_config([f"{group}={option}", *paired, *data_path(group, option, request)])
    if (group, option) == ("mesh", "auto"):  # chosen by framework.train alone (tests/test_planner.py)
        with pytest.raises(ConfigError, match=r"mesh='auto': is chosen by framework.train, self-launched or under torchrun"):
            validate(cfg)
        return
    validate(cfg)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe, request):
    cfg = compose_config([f"recipe={recipe}", *data_path("recipe", recipe, request)])
    validate(cfg)


def test_recipe_overrides_defaults_and_cli_overrides_recipe():
    cfg = compose_config(["recipe=seed_ddp_tp", "trainer.max_steps=7"])
    assert list(cfg.mesh.shape) == [3, 2]
    assert cfg.trainer.max_steps == 7


def test_seed_tp_recipe_also_runs_the_sequential_example():
    cfg = compose_config(["recipe=seed_tp", "model=seed_sequential", "plan=seed_sequential_rowwise_colwise"])
    validate(cfg)
    assert list(cfg.plan) == ["0", "2"]


def test_a_recipe_that_does_not_exist_fails_at_compose_time_naming_the_recipes():
    with pytest.raises(MissingConfigException) as info:
        compose_config(["recipe=lm2d"])
    assert info.value.options == RECIPES
    assert hydra_error_line(info.value) == f"config error: recipe=lm2d: no such recipe config; the recipe configs " \
                                           f"are: {', '.join(RECIPES)}"


def test_open_sections_take_new_keys_and_the_ranks_config_its_overrides():
    # A plan's module names (like a model's constructor arguments) are checked where they are used.
    validate(compose_config(["plan=none", "+plan.net1.style=colwise", "+plan.net2.style=rowwise"]))
    validate(OmegaConf.create(rank_config(compose_config())), deep=False)  # the ranks' config adds `overrides`


def test_unknown_key_on_the_command_line_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["trainer.max_step=5"])
    assert "max_step" in str(info.value.__cause__ or info.value)


def test_unknown_key_in_a_config_file_fails_at_compose_time(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf, symlinks=True)
    (conf / "trainer" / "typo.yaml").write_text("max_step: 5\n")
    register_schema()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as info:
            compose(config_name="config", overrides=["trainer=typo"])
    assert "max_step" in str(info.value.__cause__ or info.value)


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["trainer.max_steps=many"])
    assert "max_steps" in str(info.value.__cause__ or info.value)


def test_device_type_is_checked_by_schema():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["mesh.device_type=tpu"])
    assert "tpu" in str(info.value.__cause__ or info.value)
