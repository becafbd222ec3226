"""What a new user tries first and gets wrong (issue 70, part 2): each refused before any rank
starts, in one line naming the key and the fix, or handled. Every case is checked in this
process (validate, the command's own function); two go through the command line, exit 2 and no
job dir."""
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate

from framework.checkpoint.manager import SaveFailed, said_in_one_line
from framework.config.errors import ConfigError
from framework.dryrun import main as dryrun_main
from framework.generate import ROPE_POSITIONS, check_room
from framework.validate import validate
from tests.conftest import TINY_LM, compose_config, run_cli
from tests.test_refusals import FILES, MIXED, data_paths, refused_in_one_line, with_paths  # noqa: F401 (fixture)

SOURCE = "{weight: 0.5, dataset: {_target_: framework.data.TokenDataset, path: PACKED}}"
REFUSALS = [
    (["recipe=grpo_lm", "objective.compile_decode=true", "parallel.dp_strategy=fsdp"],
     r"objective.compile_decode=True: the compiled one-token decode step \(one graph\) needs the whole model on the "
     r"rank, and parallel.dp_strategy=fsdp shards it over the DP ranks; use parallel.dp_strategy=replicate without "
     r"TP, or objective.compile_decode=null"),
    (["recipe=grpo_lm", "objective.compile_decode=true", "mesh=1x2", "plan=lm_tp"],
     r"objective.compile_decode=True: .* and tensor parallelism splits it over 2 ranks"),
    ([*TINY_LM, "+objective.foo=1"], r"objective.foo=1: NextTokenCrossEntropy takes no such option"),
    (["recipe=grpo_lm", "+objective.group_sise=4"],
     r"objective.group_sise=4: GroupRelativePolicy takes no such option; did you mean objective.group_size\?"),
    (["recipe=lm_files", "data=mixture"],
     r"data.tokenizer=None: the model's vocabulary \(model.vocab_size\) comes from the prepared data at data.path "
     r"or from data.tokenizer, and neither is given"),
    (["data.dataset.num_samples=-4"], r"data.dataset.num_samples=-4: must be an integer >= 1 \(the dataset's samples\)"),
    (["data=random_tokens", "data.dataset.num_samples=-1"], r"data.dataset.num_samples=-1: must be an integer >= 1"),
    (["data.dataset.seed=-1"], r"data.dataset.seed=-1: must be an integer >= 0 \(the draws' seed\)"),
    (["trainer.seed=-1"], r"trainer.seed=-1: must be an integer >= 0 \(the seed of the model's init"),
    (["sampler.seed=-2"], r"sampler.seed=-2: must be an integer >= 0 \(the seed of the data's order\)"),
    (["trainer.memory_snapshot=2"], r"trainer.memory_snapshot=2: must be true or false"),
    (["recipe=grpo_lm", "objective.compile_decode=2"], r"objective.compile_decode=2: use true, false or null"),
    ([*FILES, "data.num_workers=500"], r"data.num_workers=500: is more than this host's \d+ cores: each worker is a "
                                       r"process of its own for every rank, .* use at most \d+"),
    ([*MIXED, f"+data.dataset.sources.b={SOURCE}"],
     r"data.dataset.sources.b.dataset=.*: is source a's dataset again; give it once, with the weight you mean"),
    ([*TINY_LM, "checkpoint.dir=/proc/nope", "checkpoint.every=1"],
     r"checkpoint.dir='/proc/nope': checkpoints go to /proc/nope, but /proc is not a writable directory; point "
     r"checkpoint.dir at one"),
]
ON_THE_COMMAND_LINE = {"trainer.memory_snapshot=2", "+objective.foo=1"}


def _id(overrides: list) -> str:
    return " ".join(o for o in overrides if o not in TINY_LM and o not in MIXED)


@pytest.mark.parametrize("overrides,line", REFUSALS, ids=[_id(o) for o, _ in REFUSALS])
def test_what_a_new_user_tries_is_refused_before_launch(overrides, line, data_paths, tmp_path):
    """In validate as the launcher calls it (with the job dir, as for the checkpoint's), or, for
    an override Hydra would misread, where the command composes."""
    with pytest.raises(ConfigError) as refused:
        validate(compose_config(with_paths(overrides, data_paths)), out_dir=str(tmp_path / "job"))
    assert re.match("config error: " + line, str(refused.value)), str(refused.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,line", [(o, line) for o, line in REFUSALS if ON_THE_COMMAND_LINE & set(o)],
                         ids=sorted(ON_THE_COMMAND_LINE))
def test_what_a_new_user_tries_is_one_line_on_the_command_line(overrides, line, tmp_path):
    refused_in_one_line(run_cli([*overrides, f"hydra.run.dir={tmp_path / 'job'}"], timeout=110), line)
    assert not (tmp_path / "job").exists()


def test_a_mixture_of_two_sources_of_other_datasets_is_not_taken_for_a_repeat(data_paths, tmp_path):
    other = SOURCE.replace("PACKED", "PACKED, seq_len: 8")
    validate(compose_config(with_paths([*MIXED, f"+data.dataset.sources.b={other}"], data_paths)))


def test_a_checkpoint_dcp_cannot_write_fails_in_one_line_naming_the_cause(tmp_path):
    """DCP's CheckpointException holds every rank's traceback; the run says one line."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    partial = str(blocked / "step_1.partial")
    with pytest.raises(SaveFailed) as failed, pytest.warns(UserWarning, match="single process"):
        with said_in_one_line(partial):
            dcp.save({"w": torch.ones(2)}, checkpoint_id=partial)
    assert str(failed.value) == (f"the checkpoint could not be written to {partial} (ranks [0]): NotADirectoryError: "
                                 f"[Errno 20] Not a directory: '{partial}'; check checkpoint.dir")


@pytest.fixture
def lm_tiny():
    return instantiate(compose_config(TINY_LM).model)


def test_generate_refuses_more_positions_than_rotary_computes_exactly(lm_tiny):
    with pytest.raises(ConfigError, match=re.escape(
            f"--max-new-tokens=100000000: with the prompt's 3 tokens, passes the {ROPE_POSITIONS} positions the "
            f"rotary embedding computes exactly (in float32); use at most {ROPE_POSITIONS - 3}")):
        check_room(lm_tiny, 3, 100_000_000)


def test_generate_refuses_a_cache_larger_than_the_memory_there_is(lm_tiny, monkeypatch):
    """lm_tiny: 2 layers x (keys, values) x 4 KV heads x 8 dims x 4 bytes = 512 bytes a position
    for the cache alone; with 1 MiB available, 4096 positions would need at least 2 MiB."""
    monkeypatch.setattr("framework.generate.available_bytes", lambda device: 1 << 20)
    check_room(lm_tiny, 3, 100)
    with pytest.raises(ConfigError, match=r"--max-new-tokens=4096: with the prompt's 3 tokens, the decoder's cache "
                                          r"would take \d\.\d GiB and the cpu has 0\.0 GiB available; use at most \d+"):
        check_room(lm_tiny, 3, 4096)


def test_the_dry_run_simulates_a_cuda_mesh_on_a_cpu_host(capsys):
    """mesh.device_type=cuda names the devices the ranks will have, not this host's."""
    assert dryrun_main([*TINY_LM, "mesh=1x2", "plan=lm_tp", "mesh.device_type=cuda", "dryrun.ranks=[0]"]) == 0
    assert "output.weight" in capsys.readouterr().out
