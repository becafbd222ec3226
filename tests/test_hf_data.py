"""Data as users have it: Hugging Face datasets read and tokenized as samples are read (data=hf,
hf_instructions, hf_preferences) against framework.prepare + the prepared datasets; weighted
mixtures (data=mixture) against draws counted by hand, the same on every mesh, resumed exactly;
every bad source refused in one line before launch."""
import json
import math
import random

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from framework.data import (HFInstructionDataset, HFPreferenceDataset, HFTokenDataset, HFTokenStream,
                            InstructionDataset,
                            Mixture, PreferenceDataset, TokenDataset)
from framework.data.loader import build_dataloader, build_sampler
from framework.prepare import main as prepare_main
from framework.config.errors import ConfigError
from framework.validate import validate
from tests.conftest import QUIET, compose_config, run_cli
from tests.test_data import sentence, tokenizer_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)


def records(count: int = 240, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [{"text": sentence(rng, rng.randint(1, 30)), "prompt": sentence(rng, rng.randint(1, 8)),
             "response": sentence(rng, rng.randint(1, 8)), "chosen": sentence(rng, rng.randint(1, 4)),
             "rejected": sentence(rng, rng.randint(1, 4)), "id": i} for i in range(count)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer_file) -> dict:  # noqa: F811
    """The same records three ways (JSONL, a folder of two Parquet files, a save_to_disk
    DatasetDict), and framework.prepare's three kinds of them, with the BPE tokenizer."""
    root, rows = tmp_path_factory.mktemp("hfdata"), records()
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "parquet").mkdir()
    for part, chunk in enumerate((rows[:100], rows[100:])):
        pq.write_table(pa.Table.from_pylist(chunk), root / "parquet" / f"part-{part}.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(root / "saved"))
    fields = {"packed": [], "instruction": ["--prompt-field", "prompt", "--response-field", "response"],
              "preference": ["--prompt-field", "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected"]}
    for kind, args in fields.items():
        assert prepare_main([str(root / "rows.jsonl"), "--tokenizer", tokenizer_file, "--out", str(root / kind),
                             *args]) == 0
    return {"jsonl": str(root / "rows.jsonl"), "parquet": str(root / "parquet"), "saved": str(root / "saved"),
            **{kind: str(root / kind) for kind in fields}}


def same_samples(ours, reference) -> None:
    assert len(ours) == len(reference) > 0
    for index in range(len(reference)):
        for mine, theirs in zip(ours[index], reference[index], strict=True):
            assert torch.equal(mine, theirs), index


def test_an_hf_dataset_gives_the_samples_of_prepare_then_the_prepared_datasets(sources, tokenizer_file):  # noqa: F811
    for split in ("train", "val"):
        packed = TokenDataset(sources["packed"], seq_len=16, split=split, document_masking=True)
        instruction = InstructionDataset(sources["instruction"], seq_len=12, split=split)
        preference = PreferenceDataset(sources["preference"], seq_len=10, split=split)
        for where in ("jsonl", "parquet", "saved"):
            path = sources[where]
            same_samples(HFTokenDataset(path, tokenizer_file, seq_len=16, split=split, document_masking=True), packed)
            ours = HFInstructionDataset(path, tokenizer_file, seq_len=12, split=split)
            same_samples(ours, instruction)
            assert ours.without_response().tolist() == instruction.without_response().tolist()
            assert ours.longest_prompt() == instruction.longest_prompt()
            ours = HFPreferenceDataset(path, tokenizer_file, seq_len=10, split=split)
            same_samples(ours, preference)
            assert ours.without_response().tolist() == preference.without_response().tolist()


LM = ["recipe=lm_files", "model=lm_tiny", "plan=none", "data.dataset.seq_len=16", "data.global_batch_size=8",
      "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_batches=2",
      "trainer.warmup_steps=0", *QUIET]


def losses(run_dir) -> tuple:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["losses"], summary["val_losses"]


@pytest.mark.integration  # (make test: the samples against prepare + the prepared datasets, bitwise)
@pytest.mark.parametrize("mesh", ["1x1", "2x1"])
def test_training_on_an_hf_dataset_is_training_on_its_prepared_tokens(tmp_path, sources, tokenizer_file, mesh):  # noqa: F811
    """Bitwise: the same windows in the same order, whatever reads them; on 2x1 each DP rank's
    two loader workers tokenize its samples."""
    runs = {}
    for name, data in {"prepared": [f"data.path={sources['packed']}"],
                       "hf": ["data=hf", f"data.path={sources['parquet']}", "data.num_workers=2"]}.items():
        result = run_cli([*LM, *data, f"data.tokenizer={tokenizer_file}", f"mesh={mesh}",
                          f"hydra.run.dir={tmp_path / name}"])
        assert result.returncode == 0, result.stderr[-2000:]
        runs[name] = losses(tmp_path / name)
    assert runs["hf"] == runs["prepared"]


def mixture_node(sources: dict, tokenizer: str, weights=(0.75, 0.25), small: int = 40) -> dict:
    """Two packed sources: the prepared tokens and the first `small` records through data=hf."""
    return {"_target_": "framework.data.Mixture", "_recursive_": False, "seq_len": 16, "document_masking": True,
            "seed": 3, "num_samples": 1200, "sources": {
                "prepared": {"weight": weights[0], "dataset": {"_target_": "framework.data.TokenDataset",
                                                               "path": sources["packed"]}},
                "small": {"weight": weights[1], "dataset": {"_target_": "framework.data.HFTokenDataset",
                                                            "path": small_path(sources, small),
                                                            "tokenizer": tokenizer}}}}


def small_path(sources: dict, small: int) -> str:
    return sources["jsonl"].replace(".jsonl", f"_{small}.jsonl")


@pytest.fixture(scope="module")
def small_source(sources) -> str:
    """The first 40 records as their own JSONL: a source whose epoch ends inside the mixture's."""
    path = small_path(sources, 40)
    with open(sources["jsonl"]) as full, open(path, "w") as small:
        small.writelines(line for _, line in zip(range(40), full))
    return path


def test_a_mixture_draws_each_source_by_its_weight_and_reads_each_in_turn(sources, tokenizer_file, small_source):  # noqa: F811
    node = OmegaConf.create(mixture_node(sources, tokenizer_file))
    mixture = Mixture(**{k: v for k, v in node.items() if not k.startswith("_")})
    prepared, small = mixture.sources
    located = [mixture.locate(index) for index in range(len(mixture))]
    drawn = np.array([source for source, _ in located])
    # each source's share of the first 1000 samples within 3 standard deviations of its weight
    for source, weight in enumerate(mixture.weights):
        share, sigma = (drawn[:1000] == source).mean(), math.sqrt(weight * (1 - weight) / 1000)
        assert abs(share - weight) < 3 * sigma, (source, share, weight)
    # the j-th draw of a source reads its sample j mod its length: the small one starts over
    for source, data in enumerate((prepared, small)):
        assert [sample for s, sample in located if s == source] == [j % len(data) for j in range((drawn == source).sum())]
    assert (drawn == 1).sum() > 2 * len(small)  # its epoch ended inside the mixture's, twice
    index = int(np.flatnonzero(drawn == 1)[len(small) + 3])  # a sample of the small source's second pass
    for mine, theirs in zip(list(mixture[index].values())[:3], small[3], strict=True):
        assert torch.equal(mine, theirs)
    assert int(mixture[index]["source"]) == 1
    # the sequence is a function of the index: a mixture built again (another process, a resume) agrees
    again = Mixture(**{k: v for k, v in node.items() if not k.startswith("_")})
    assert [again.locate(index) for index in range(0, len(mixture), 7)] == located[::7]
    # the union of the DP replicas' batches is the same global batch for any DP size
    for dp in (1, 2, 4):
        samplers = [build_sampler(mixture, dp, rank, shuffle=True, seed=0, drop_last=True) for rank in range(dp)]
        orders = [list(sampler) for sampler in samplers]
        merged = [orders[i % dp][i // dp] for i in range(dp * len(orders[0]))]
        if dp == 1:
            reference = merged
        assert merged == reference[:len(merged)]


MIX = [*LM, "data=mixture", "trainer.max_steps=6", "checkpoint.every=3", "trainer.eval_every=null",
       "logger.tensorboard=true"]


def mixture_overrides(sources, tokenizer) -> list:
    node = mixture_node(sources, tokenizer)
    return [f"data.tokenizer={tokenizer}", f"data.dataset.seed={node['seed']}", f"data.dataset.num_samples={node['num_samples']}",
            *source_overrides(node["sources"])]


def source_overrides(sources: dict) -> list:
    """A mixture's sources as a user adds them on the command line."""
    return [f"+data.dataset.sources.{name}={hydra_value(source)}" for name, source in sources.items()]


def hydra_value(value) -> str:
    """`value` in Hydra's override grammar (a dict's keys bare, strings quoted)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {hydra_value(item)}" for key, item in value.items()) + "}"
    return repr(value) if isinstance(value, str) else json.dumps(value)


@pytest.mark.integration  # (make test: the draws against counts by hand, the DP split for 1, 2 and 4 replicas)
def test_a_mixture_trains_the_same_on_every_mesh_resumes_exactly_and_logs_each_sources_share(
        tmp_path, sources, tokenizer_file, small_source):  # noqa: F811
    base = [*MIX, *mixture_overrides(sources, tokenizer_file)]
    runs = {}
    for mesh in ("1x1", "2x1"):
        result = run_cli([*base, f"mesh={mesh}", f"hydra.run.dir={tmp_path / mesh}"])
        assert result.returncode == 0, result.stderr[-2000:]
        runs[mesh] = losses(tmp_path / mesh)[0]
    torch.testing.assert_close(torch.tensor(runs["2x1"]), torch.tensor(runs["1x1"]), rtol=1e-5, atol=1e-6)
    step_3 = tmp_path / "2x1" / "checkpoints" / "step_3"
    for mesh in ("2x1", "1x1"):  # the same mesh bitwise, another within float rounding
        result = run_cli([*base, f"mesh={mesh}", f"checkpoint.resume={step_3}", f"hydra.run.dir={tmp_path / ('r' + mesh)}"])
        assert result.returncode == 0, result.stderr[-2000:]
        resumed = losses(tmp_path / ("r" + mesh))[0]
        if mesh == "2x1":
            assert resumed == runs["2x1"]
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(runs["2x1"]), rtol=1e-5, atol=1e-6)
    # TensorBoard's share of each step's tokens against the draws of that step's global batch by hand
    node = OmegaConf.create(mixture_node(sources, tokenizer_file))
    mixture = Mixture(**{k: v for k, v in node.items() if not k.startswith("_")})
    order = list(build_sampler(mixture, 1, 0, shuffle=True, seed=0, drop_last=True))
    trained = [mixture.draw(i) for i in order[:48]]
    assert any(source == 1 and j >= len(mixture.sources[1]) for source, j in trained[24:])  # after the resume: the
    # small source's samples of a later pass than its first (its epoch ended inside the mixture's)
    events = EventAccumulator(str(tmp_path / "1x1" / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for name, source in (("prepared", 0), ("small", 1)):
        logged = [event.value for event in events.Scalars(f"data/share/{name}")]
        by_hand = [np.mean([mixture.locate(i)[0] == source for i in order[8 * step: 8 * step + 8]]) for step in range(6)]
        assert len(set(by_hand)) > 1
        # float32 counts and one division: the same ratio up to rounding (bitwise measured here)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(by_hand, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_bad_hf_and_mixture_data_is_refused_in_one_line_before_launch(tmp_path, sources, tokenizer_file):  # noqa: F811
    jsonl, missing = sources["jsonl"], tmp_path / "nowhere"
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "a"}\n')
    pq.write_table(pa.table({"text": ["b"]}), tmp_path / "mixed" / "b.parquet")
    node = mixture_node(sources, tokenizer_file)
    negative = {**node["sources"], "small": {**node["sources"]["small"], "weight": -1}}
    zero = {name: {**source, "weight": 0} for name, source in node["sources"].items()}
    other = {**node["sources"], "small": {**node["sources"]["small"], "dataset": {
        "_target_": "framework.data.HFTokenDataset", "path": jsonl, "tokenizer": "bytes"}}}
    streamed = {**node["sources"], "small": {**node["sources"]["small"], "dataset": {
        "_target_": "framework.data.HFTokenStream", "path": jsonl, "tokenizer": tokenizer_file}}}
    hf = ["data=hf", f"data.tokenizer={tokenizer_file}"]
    cases = [
        ([*hf, f"data.path={missing}"], f"config error: data.path='{missing}': no such file or directory"),
        ([*hf, f"data.path={tmp_path / 'mixed'}"], f"config error: data.path='{tmp_path / 'mixed'}': holds files of "
                                                   f"several formats (json, parquet); give a folder of one"),
        ([*hf, f"data.path={jsonl}", "data.dataset.text_field=body"],
         f"config error: data.dataset.text_field='body': is not a column of {jsonl}; its columns are "
         "['text', 'prompt', 'response', 'chosen', 'rejected', 'id']"),
        ([*hf, f"data.path={jsonl}", "data.dataset.text_field=id"],
         f"config error: data.dataset.text_field='id': is a column of int64 in {jsonl}, not of text"),
        (["data=hf", f"data.path={jsonl}"], "config error: data.tokenizer=None: data=hf tokenizes as it reads"),
        ([*hf, f"data.path={sources['saved']}", "data.split=test"],
         "config error: data.split='test': " + sources["saved"] + " holds the splits ['train']; name one of them"),
        (["data=mixture", f"data.tokenizer={tokenizer_file}", *source_overrides(negative)],
         "config error: data.dataset.sources.small.weight=-1: give each source a finite weight >= 0"),
        (["data=mixture", f"data.tokenizer={tokenizer_file}", *source_overrides(zero)],
         "config error: data.dataset.sources=[0.0, 0.0]: the weights are all 0; give a source a positive weight"),
        (["data=hf_instructions", f"data.tokenizer={tokenizer_file}", f"data.path={jsonl}", "data.streaming=true"],
         "config error: data.streaming=True: framework.data.HFInstructionDataset is read indexed: streaming reads "
         "text records (data=hf) only; set data.streaming=false"),
        (["data=mixture", f"data.tokenizer={tokenizer_file}", *source_overrides(streamed)],
         "config error: data.dataset.sources.small.dataset='HFTokenStream': a streamed source has no sample j to draw"),
        (["data=mixture", "model.vocab_size=512", *source_overrides(other)],
         "config error: data.dataset.sources.small='bytes': the tokenizer bytes and the token data in "
         f"{sources['packed']} come from different tokenizers"),
    ]
    for overrides, message in cases:  # what the launcher checks before it starts a rank
        with pytest.raises(ConfigError) as refused:
            validate(compose_config([*LM, *overrides]))
        assert str(refused.value).startswith(message), (message, str(refused.value))
    # on the command line: that one line, exit 2, and no rank started
    result = run_cli([*LM, *cases[0][0], f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2 and result.stderr.strip().startswith(cases[0][1]), result.stderr[-1500:]
    assert not (tmp_path / "run" / "logs").exists()


def test_each_dp_replica_streams_its_own_records_packed_as_the_indexed_dataset_packs_them(
        tmp_path, sources, tokenizer_file):  # noqa: F811
    """Replica r of 2 reads records r, r+2, ... (one shard: split_dataset_by_node's stride),
    and packs them as data=hf packs a file of just those records (held out: none)."""
    rows = [json.loads(line) for line in open(sources["jsonl"])]
    for rank in range(2):
        mine = tmp_path / f"replica{rank}.jsonl"
        mine.write_text("".join(json.dumps(row) + "\n" for row in rows[rank::2]))
        stream = HFTokenStream(sources["jsonl"], tokenizer_file, seq_len=16, document_masking=True)
        stream.for_replica(rank, 2)
        indexed = HFTokenDataset(str(mine), tokenizer_file, seq_len=16, val_fraction=0.0, document_masking=True)
        same_samples(list(stream), indexed)


def test_a_streams_loader_resumed_from_its_state_continues_with_the_batches_it_would_have_given(
        sources, tokenizer_file):  # noqa: F811
    """torchdata's loader state over the stream (2 workers, one replica of 2): a new loader given
    the state after 5 batches yields the uninterrupted loader's batches 6 on, bitwise."""
    def loader(state=None):
        stream = HFTokenStream(sources["jsonl"], tokenizer_file, seq_len=16, document_masking=True)
        sampler = build_sampler(stream, 2, 1, shuffle=True, seed=0, drop_last=True)
        built = build_dataloader(stream, sampler, 4, 2)
        if state is not None:
            built.load_state_dict(state)
        return built

    whole = list(loader())
    first = loader()
    batches = iter(first)
    for _ in range(5):
        next(batches)
    resumed = list(loader(json.loads(json.dumps(first.state_dict()))))  # as the checkpoint stores it
    assert len(whole) > 10 and len(resumed) == len(whole) - 5
    for mine, theirs in zip(resumed, whole[5:]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


STREAM = [*LM, "data=hf", "data.streaming=true", "trainer.eval_every=null", "checkpoint.every=3"]


@pytest.mark.integration  # (make test: the loader's state resumed in-process, each replica's records)
def test_a_stream_trains_as_the_indexed_dataset_on_one_replica_and_resumes_exactly_across_its_end(
        tmp_path, sources, tokenizer_file, small_source):  # noqa: F811
    one = ["mesh=1x1", "data.num_workers=0", "sampler.shuffle=false", f"data.path={sources['jsonl']}"]
    runs = {}
    for name, extra in {"indexed": ["data.streaming=false", "+data.dataset.val_fraction=0"], "stream": []}.items():
        result = run_cli([*STREAM, *one, *extra, f"data.tokenizer={tokenizer_file}", f"hydra.run.dir={tmp_path / name}"])
        assert result.returncode == 0, result.stderr[-2000:]
        runs[name] = losses(tmp_path / name)[0]
    assert runs["stream"] == runs["indexed"]  # the same windows in the same order, bitwise
    # 2 replicas x 2 loader workers on the 40-record source: 28 windows a replica, an epoch of 7
    # steps; resumed at step 6, the run crosses the stream's end as the uninterrupted one did
    two = [*STREAM, "mesh=2x1", "data.num_workers=2", f"data.path={small_source}", f"data.tokenizer={tokenizer_file}",
           "trainer.max_steps=10"]
    result = run_cli([*two, f"hydra.run.dir={tmp_path / 'two'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    step_6 = tmp_path / "two" / "checkpoints" / "step_6"
    final = json.loads((tmp_path / "two" / "checkpoints" / "step_10" / "framework.json").read_text())["data"]
    assert (final["epoch"], final["samples"]) == (1, 24)  # 7 steps of 8 in the first epoch, 3 in the next
    result = run_cli([*two, f"checkpoint.resume={step_6}", f"hydra.run.dir={tmp_path / 'resumed'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert losses(tmp_path / "resumed")[0] == losses(tmp_path / "two")[0]
    result = run_cli([*two, "mesh=1x1", f"checkpoint.resume={step_6}", f"hydra.run.dir={tmp_path / 'other'}"])
    assert result.returncode == 2 and result.stderr.strip() == (
        f"config error: mesh.shape=[1, 1]: checkpoint {step_6} holds each rank's place in a stream (data.streaming) "
        f"for the mesh [2, 1]; resume it on that mesh, or set checkpoint.reset_data=true to start the stream again")
