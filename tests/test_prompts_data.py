"""Prompts data for online RL: prepare --prompt-field [--answer-field] writes kind "prompts", and
framework.data.PromptDataset gives each prompt's ids (the tokenizer's own encoding, nothing
added), its answer's and its index in the whole set; bad flags and records are refused in one
line; the instruction data's checks leave prompts data alone."""
import dataclasses
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from framework.validate import checked_config
from framework.config.errors import ConfigError
from framework.config.schema import DataConfig
from framework.data import InstructionDataset, PromptDataset
from framework.data.batch import IGNORE
from framework.data.checks import check_responses
from framework.data.dataset_config import kind_of
from framework.data.datasets import without_response
from framework.training.objectives.preference import check_preference
from tests.conftest import CONF, QUIET, compose_config
from tests.test_data import prepare, sentence, tokenizer_file, word_tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)
RECORDS = 20


def ids(tokenizer: Tokenizer, text: str) -> list:
    return tokenizer.encode(text, add_special_tokens=False).ids


def padded(values: list, length: int) -> list:
    return (values + [IGNORE] * length)[:length]


@pytest.fixture(scope="module")
def records() -> list:
    rng = random.Random(3)
    return [{"prompt": sentence(rng, rng.randint(1, 12)), "answer": sentence(rng, rng.randint(0, 6)), "id": i}
            for i in range(RECORDS)]


@pytest.fixture(scope="module")
def prompts_dirs(tmp_path_factory, tokenizer_file, records) -> dict:  # noqa: F811
    """The records prepared with their answers and without."""
    root = tmp_path_factory.mktemp("prompts")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dirs = {"answers": root / "answers", "bare": root / "bare"}
    for name, extra in {"answers": ["--answer-field", "answer"], "bare": []}.items():
        assert prepare([root / "prompts.jsonl", "--prompt-field", "prompt", *extra, "--tokenizer", tokenizer_file,
                        "--out", dirs[name]])[0] == 0
    return {name: str(path) for name, path in dirs.items()}


@pytest.mark.parametrize("seq_len", [64, 5])  # 5 cuts most prompts and answers
def test_samples_are_the_tokenizers_prompt_and_answer_and_the_index_in_the_whole_set(prompts_dirs, records,
                                                                                     tokenizer_file, seq_len):  # noqa: F811
    reference = Tokenizer.from_file(tokenizer_file)
    eos = reference.token_to_id("<|endoftext|>")
    meta = json.loads(open(f"{prompts_dirs['answers']}/meta.json").read())
    assert meta["kind"] == "prompts" and meta["documents"] == RECORDS
    cut = int(RECORDS * 0.8)
    for split, first, count in (("train", 0, cut), ("val", cut, RECORDS - cut)):
        data = PromptDataset(prompts_dirs["answers"], seq_len=seq_len, split=split, val_fraction=0.2)
        assert len(data) == count and data.first == first and data.kind == "prompts" and data.masked_targets
        assert data.pad_id == eos == data.documents.tokenizer["eos_id"]
        prompts = [ids(reference, r["prompt"]) for r in records[first:first + count]]
        for i, (prompt, record) in enumerate(zip(prompts, records[first:first + count])):
            sample = data[i]
            assert sorted(sample) == ["index", "inputs", "targets"]
            assert all(t.dtype == torch.int64 for t in sample.values()) and sample["index"].dim() == 0
            assert sample["inputs"].tolist() == padded(prompt, seq_len)
            assert sample["targets"].tolist() == padded(ids(reference, record["answer"]), seq_len)
            assert sample["index"].item() == first + i == record["id"]
        assert data.longest_prompt() == max(map(len, prompts))


def test_without_an_answer_field_the_targets_are_all_ignored_and_the_loader_batches_the_dict(prompts_dirs, records,
                                                                                             tokenizer_file):  # noqa: F811
    reference = Tokenizer.from_file(tokenizer_file)
    data = PromptDataset(prompts_dirs["bare"], seq_len=16, val_fraction=0.0)
    assert len(data) == RECORDS
    for i, record in enumerate(records):
        assert data[i]["inputs"].tolist() == padded(ids(reference, record["prompt"]), 16)
        assert data[i]["targets"].tolist() == [IGNORE] * 16
    batch = next(iter(DataLoader(data, batch_size=4)))
    assert batch["inputs"].shape == batch["targets"].shape == (4, 16) and batch["index"].tolist() == [0, 1, 2, 3]


def test_no_bos_or_eos_is_added_to_a_prompt_even_where_the_tokenizer_names_a_bos(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", ["<|bos|>", "<|eos|>"])
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>",
                                                                        "eos_token": "<|eos|>"}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"q": "hello world"}) + "\n")
    assert prepare([tmp_path / "p.jsonl", "--prompt-field", "q", "--tokenizer", tokenizer, "--out",
                    tmp_path / "out"])[0] == 0
    data = PromptDataset(str(tmp_path / "out"), seq_len=4, val_fraction=0.0)
    assert data.documents.tokenizer["bos_id"] is not None
    assert data[0]["inputs"].tolist() == [1, 2, IGNORE, IGNORE] and data.longest_prompt() == 2  # hello, world


def test_instruction_checks_leave_prompts_data_alone_and_the_kinds_do_not_mix(prompts_dirs, capsys):
    node = {"_target_": "framework.data.PromptDataset", "path": prompts_dirs["bare"]}
    assert kind_of(OmegaConf.create(node)) == "prompts"
    # no answers, and prompts longer than seq_len: instruction data's check would warn or refuse here
    bare = PromptDataset(prompts_dirs["bare"], seq_len=2)
    assert without_response(bare.documents, bare.first, bare.end, bare.seq_len).any()
    cfg = compose_config(["recipe=lm_files", "data=instructions", "model=lm_tiny", "data.dataset.seq_len=2",
                          "data.dataset._target_=framework.data.PromptDataset", f"data.path={prompts_dirs['bare']}",
                          "trainer.eval_every=1", *QUIET])
    check_responses(checked_config(cfg))
    check_preference(checked_config(cfg))
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"holds prompts data; this dataset reads instruction data"):
        InstructionDataset(prompts_dirs["bare"])


def test_the_data_config_uses_only_schema_keys_and_builds_a_prompt_dataset(prompts_dirs):
    conf = OmegaConf.load(CONF / "data" / "prompts.yaml")
    assert set(conf) - {"defaults"} <= {f.name for f in dataclasses.fields(DataConfig)}
    assert list(conf.defaults) == [{"override /objective@_global_.objective": "grpo"}]
    assert conf.global_batch_size == 8 and conf.micro_batch_size is None and conf.dataset.seq_len == 128
    conf.path = prompts_dirs["answers"]
    node = OmegaConf.to_container(OmegaConf.create({"data": conf}), resolve=True)["data"]["dataset"]  # ${data.path}
    assert node.pop("_target_") == "framework.data.PromptDataset"
    data = PromptDataset(**node)
    assert len(data) == int(RECORDS * 0.95) and data.pad_id == data.documents.tokenizer["eos_id"]


def test_bad_flags_and_bad_records_are_refused_in_one_line(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "p", "answer": "a", "response": "r", "chosen": "c", "rejected": "x"}) + "\n")
    answer_alone = "input error: --prompt-field / --answer-field: give --answer-field with --prompt-field alone, " \
                   "for prompts data (no --response-field, --chosen-field or --rejected-field)"
    flags = [
        (["--answer-field", "answer"], answer_alone),
        (["--prompt-field", "prompt", "--answer-field", "answer", "--response-field", "response"], answer_alone),
        (["--prompt-field", "prompt", "--answer-field", "answer", "--chosen-field", "chosen", "--rejected-field",
          "rejected"], answer_alone),
        (["--response-field", "response"], "input error: --prompt-field / --response-field: give both for "
                                           "instruction data (--prompt-field alone is prompts data)"),
    ]
    for extra, message in flags:
        assert prepare([good, *extra, "--out", tmp_path / "out"], capsys) == (2, message)
    fix = "; fix it, or pass --skip-bad-lines to skip and count such lines"
    cases = [({"answer": "a"}, ["--answer-field", "answer"], "has no field 'prompt'"),
             ({"prompt": "q"}, ["--answer-field", "answer"], "has no field 'answer'"),
             ({"prompt": ["q"]}, [], "its 'prompt' is not a string"),
             ({"prompt": "q", "answer": None}, ["--answer-field", "answer"], "its 'answer' is not a string"),
             ({"prompt": "", "answer": "a"}, ["--answer-field", "answer"], "its 'prompt' is empty")]
    bad = tmp_path / "bad.jsonl"
    for record, extra, problem in cases:
        bad.write_text(json.dumps({"prompt": "q", "answer": "a"}) + "\n" + json.dumps(record) + "\n")
        assert prepare([bad, "--prompt-field", "prompt", *extra, "--out", tmp_path / "out"], capsys) == (
            2, f"input error: {bad}:2: {problem}{fix}")
    pq.write_table(pa.table({"prompt": ["q", ""]}), tmp_path / "empty.parquet")
    assert prepare([tmp_path / "empty.parquet", "--prompt-field", "prompt", "--out", tmp_path / "out"], capsys) == (
        2, f"input error: {tmp_path / 'empty.parquet'}: row 1: its 'prompt' is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.parquet", "good.jsonl"]
    assert prepare([bad, "--prompt-field", "prompt", "--answer-field", "answer", "--skip-bad-lines", "--out",
                    tmp_path / "out"], capsys)[0] == 0  # the empty prompt skipped and counted
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["skipped_lines"] == 1
