"""Real data: prepare (tokenizer.json or bytes; .txt, .jsonl, .parquet; workers), the packed and
instruction datasets, training and resuming on them, the masked loss across meshes, and every
bad input refused in one line with nothing left behind."""
import json
import math
import os
import random
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from framework.validate import checked_config
from framework.data.batch import IGNORE
from framework.data.checks import check_responses
from framework.data.datasets import InstructionDataset, TokenDataset
from framework.launch.local import spawn_ranks
from framework.prepare import main as prepare_main
from tests.conftest import QUIET, compose_config, run_cli
from tests.workers import one_step_gradients

pytestmark = pytest.mark.timeout(300)
WORDS = "the mesh trains a model on data and every rank agrees with one process".split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    """A small BPE tokenizer trained here (no download), with <|endoftext|> as its EOS."""
    rng = random.Random(0)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([sentence(rng, 12) for _ in range(500)], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def prepare(args, capsys=None) -> tuple:
    """framework.prepare in this process: (exit status, stderr)."""
    code = prepare_main([str(a) for a in args])
    return code, capsys.readouterr().err.strip() if capsys else ""


def write_inputs(root, rng: random.Random) -> list:
    """A .txt, a .jsonl and a .parquet, each with documents of varied length."""
    docs = {"a.txt": [sentence(rng, 40)], "b.jsonl": [sentence(rng, rng.randint(3, 30)) for _ in range(20)],
            "c.parquet": [sentence(rng, rng.randint(3, 30)) for _ in range(20)]}
    (root / "a.txt").write_text(docs["a.txt"][0])
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs["b.jsonl"])))
    pq.write_table(pa.table({"text": docs["c.parquet"]}), root / "c.parquet")
    return docs["a.txt"] + docs["b.jsonl"] + docs["c.parquet"]


def test_prepare_writes_each_document_and_eos_in_input_order_the_same_with_two_workers(tmp_path, tokenizer_file,
                                                                                         capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    docs = write_inputs(inputs, random.Random(1))
    reference = Tokenizer.from_file(tokenizer_file)
    eos = reference.token_to_id("<|endoftext|>")
    expected = [t for doc in docs for t in reference.encode(doc, add_special_tokens=False).ids + [eos]]
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        assert prepare([inputs, "--tokenizer", tokenizer_file, "--out", out, "--workers", workers], capsys)[0] == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["dtype"] == "uint16" and meta["documents"] == len(docs) == 41
        assert meta["tokenizer"]["vocab_size"] == reference.get_vocab_size() and meta["tokenizer"]["eos_id"] == eos
        assert np.fromfile(out / "tokens.bin", dtype=np.uint16).tolist() == expected
        lengths = np.diff(np.load(out / "doc_offsets.npy"))
        assert lengths.tolist() == [len(reference.encode(d, add_special_tokens=False).ids) + 1 for d in docs]
    assert (tmp_path / "w1" / "tokens.bin").read_bytes() == (tmp_path / "w2" / "tokens.bin").read_bytes()


def test_packed_windows_are_the_token_stream_and_the_tail_is_held_out(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("abcdefghij" * 10)
    assert prepare([tmp_path / "doc.txt", "--out", tmp_path / "bytes"], capsys)[0] == 0  # byte-level: EOS is 0
    stream = list(b"abcdefghij" * 10) + [0]
    train = TokenDataset(str(tmp_path / "bytes"), seq_len=8, val_fraction=0.2)
    val = TokenDataset(str(tmp_path / "bytes"), seq_len=8, split="val", val_fraction=0.2)
    cut = int(len(stream) * 0.8)
    assert len(train) == (cut - 1) // 8 and len(val) == (len(stream) - cut - 1) // 8
    inputs, targets = train[2]
    assert inputs.tolist() == stream[16:24] and targets.tolist() == stream[17:25]
    assert val[0][0].tolist() == stream[cut:cut + 8]


def test_instruction_examples_mask_the_prompt_and_the_padding(tmp_path, capsys):
    rows = [{"q": "abc", "a": "xy"}, {"q": "hello", "a": "a long answer cut at seq_len"}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prepare([tmp_path / "sft.jsonl", "--out", tmp_path / "sft", "--prompt-field", "q",
                    "--response-field", "a"], capsys)[0] == 0
    data = InstructionDataset(str(tmp_path / "sft"), seq_len=8, val_fraction=0.0)
    inputs, targets = data[0]  # tokens a b c x y EOS: learn x, y and EOS (predicted from c, x, y)
    assert inputs.tolist() == list(b"abcxy") + [0, 0, 0]  # padded with EOS (0 for bytes)
    assert targets.tolist() == [IGNORE, IGNORE, ord("x"), ord("y"), 0, IGNORE, IGNORE, IGNORE]
    inputs, targets = data[1]  # 5 prompt bytes, then 4 of the response fit in seq_len + 1 = 9
    assert inputs.tolist() == list(b"helloa l")
    assert targets.tolist() == [IGNORE] * 4 + list(b"a lo")


def test_bad_inputs_are_one_line_and_leave_nothing(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n" + json.dumps({"body": "x"}) + "\n")
    (tmp_path / "broken.json").write_text("{")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"text": "caf"}).encode()[:-2] + b"\xe9\"}\n")
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["fine", None]}), nulls)
    inputs = ["bad.jsonl", "broken.json", "good.jsonl", "latin1.jsonl", "nulls.parquet"]
    out = tmp_path / "out"
    cases = [
        ([tmp_path / "missing"], f"input error: {tmp_path / 'missing'}: no such file or directory"),
        ([good, bad], f"input error: {bad}:2: not JSON; fix it, or pass --skip-bad-lines to skip and count such lines"),
        ([good, bad, "--tokenizer", tmp_path / "broken.json"], "config error: tokenizer="),
        ([good, "--tokenizer", tmp_path / "nope.json"], f"config error: tokenizer='{tmp_path / 'nope.json'}': no such file"),
        ([latin1], f"input error: {latin1}:1: not UTF-8; fix it, or pass --skip-bad-lines"),
        ([nulls], f"input error: {nulls}: row 1: its 'text' is not a string (None)"),
    ]
    for args, message in cases:
        code, err = prepare([*args, "--out", out], capsys)
        assert code == 2 and err.startswith(message) and "\n" not in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == inputs
    code, _ = prepare([good, bad, "--out", out, "--skip-bad-lines"], capsys)
    meta = json.loads((out / "meta.json").read_text())
    assert code == 0 and meta["skipped_lines"] == 2 and meta["documents"] == 2
    assert prepare([good, "--out", out], capsys) == (2, f"input error: {out}: already exists; remove it or choose "
                                                        "another --out")


def word_tokenizer(path, specials, words=("hello", "world")) -> str:
    """A word-level tokenizer.json under `path` with `specials` as its special tokens (and no
    tokenizer_config.json beside it); `words` are plain vocabulary pieces."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials))
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path / "tokenizer.json")


def test_a_special_token_named_as_an_end_of_text_ends_documents_without_a_flag(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("hello world hello")
    eos_only_by_name = word_tokenizer(tmp_path / "bos_eos", ["<|bos|>", "<|eos|>"])
    assert prepare([tmp_path / "doc.txt", "--tokenizer", eos_only_by_name, "--out", tmp_path / "out"], capsys)[0] == 0
    eos = Tokenizer.from_file(eos_only_by_name).token_to_id("<|eos|>")
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["tokenizer"]["eos_id"] == eos
    assert np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16).tolist() == [1, 2, 1, eos]
    # a document's end before a chat turn's, whatever order the tokenizer defines them in
    chat = word_tokenizer(tmp_path / "chat", ["<|im_end|>", "<|eos|>", "<|endoftext|>"])
    assert prepare([tmp_path / "doc.txt", "--tokenizer", chat, "--out", tmp_path / "chat_out"], capsys)[0] == 0
    assert json.loads((tmp_path / "chat_out" / "meta.json").read_text())["tokenizer"]["eos_id"] == \
        Tokenizer.from_file(chat).token_to_id("<|endoftext|>")
    plain = word_tokenizer(tmp_path / "plain", ["<|bos|>"], words=("hello", "</s>"))  # </s> is no special token
    assert prepare([tmp_path / "doc.txt", "--tokenizer", plain, "--out", tmp_path / "none"], capsys) == (
        2, f"input error: {plain}: defines no end-of-text token to separate documents (no eos_token in a "
           "tokenizer_config.json beside it, no special token named <|end_of_text|>, <|endoftext|>, </s>, <eos>, "
           "<|eos|>, <|im_end|>); name one with --eos-token")


def test_a_txt_that_is_not_utf8_is_refused_naming_the_byte_and_newlines_read_as_before(tmp_path, capsys):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"good line\ncaf\xe9\n")  # the bad byte is the 14th: offset 10 + 3
    for mode in ([], ["--txt-lines"]):
        assert prepare([latin1, *mode, "--out", tmp_path / "out"], capsys) == (
            2, f"input error: {latin1}: byte 13: not UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 "
               "-t utf-8)")
        assert not (tmp_path / "out").exists()
    (tmp_path / "newlines.txt").write_bytes("a\r\nb\rc\u00e9\n\n".encode())  # text mode's \r\n and \r are \n
    assert prepare([tmp_path / "newlines.txt", "--out", tmp_path / "whole"], capsys)[0] == 0
    assert prepare([tmp_path / "newlines.txt", "--txt-lines", "--out", tmp_path / "lines"], capsys)[0] == 0
    assert np.fromfile(tmp_path / "whole" / "tokens.bin", dtype=np.uint16).tolist() == [
        *"a\nb\nc\u00e9\n\n".encode(), 0]
    assert np.fromfile(tmp_path / "lines" / "tokens.bin", dtype=np.uint16).tolist() == [
        *b"a", 0, *b"b", 0, *"c\u00e9".encode(), 0]


def test_files_of_other_kinds_in_a_directory_are_named_in_one_line_and_the_rest_prepared(tmp_path, capsys):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    for name in ("a.txt", "data.csv", "notes.md", "readme", "sub/x.json"):
        (tmp_path / "in" / name).write_text("hello")
    code, err = prepare([tmp_path / "in", "--out", tmp_path / "out"], capsys)
    assert code == 0 and err == f"skipped 4 files in {tmp_path / 'in'} (not .txt, .jsonl, .parquet): data.csv, " \
                                "notes.md, readme, ..."
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["documents"] == 1
    for name in ("data.csv", "notes.md", "readme"):
        (tmp_path / "in" / name).unlink()
    assert prepare([tmp_path / "in", "--out", tmp_path / "again"], capsys) == (
        0, f"skipped 1 file in {tmp_path / 'in'} (not .txt, .jsonl, .parquet): sub/x.json")


def test_a_bad_instruction_line_names_only_the_fields_at_fault(tmp_path, capsys):
    fields = ["--prompt-field", "prompt", "--response-field", "response"]
    fix = "; fix it, or pass --skip-bad-lines to skip and count such lines"
    cases = [({"prompt": "q"}, "has no field 'response'"), ({"answer": "a"}, "has no field 'prompt' / 'response'"),
             ({"prompt": 1, "response": "r"}, "its 'prompt' is not a string")]
    for record, problem in cases:
        (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "q", "response": "r"}) + "\n" + json.dumps(record))
        assert prepare([tmp_path / "sft.jsonl", *fields, "--out", tmp_path / "out"], capsys) == (
            2, f"input error: {tmp_path / 'sft.jsonl'}:2: {problem}{fix}")


def prepare_instructions(tmp_path, prompt_lengths) -> str:
    """Byte-level instruction data: a prompt of each length (its tokens) and the response "ok"."""
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": "p" * n, "response": "ok"}) + "\n"
                                                for n in prompt_lengths))
    assert prepare_main([str(tmp_path / "sft.jsonl"), "--out", str(tmp_path / "sft"), "--prompt-field", "prompt",
                         "--response-field", "response"]) == 0
    return str(tmp_path / "sft")


SFT_RUN = ["recipe=lm_files", "data=instructions", "model=lm_tiny", "data.dataset.seq_len=8",
           "data.global_batch_size=8", "trainer.eval_every=null", "trainer.max_steps=2", *QUIET]


def test_instruction_data_whose_seq_len_cuts_off_every_response_is_refused_before_launch(tmp_path):
    prompts = [9 + i for i in range(20)]  # all longer than seq_len=8: no response token is ever a target
    data = prepare_instructions(tmp_path, prompts)
    train = prompts[:int(20 * 0.95)]  # the train split: all but the last 5%
    result = run_cli([*SFT_RUN, f"data.path={data}", f"hydra.run.dir={tmp_path / 'run'}"], timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"config error: data.dataset.seq_len=8: {len(train)} of the {len(train)} train examples in {data} keep no "
        f"response token within seq_len+1=9 tokens (their prompts fill it), so the loss would be 0 at every step; "
        f"raise it to at least {max(train)} (the longest prompt, in tokens) or shorten the prompts"), result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_instruction_examples_that_lose_their_response_are_counted_in_a_warning(tmp_path, capsys):
    prompts = [3, 8, 9, 12] * 5  # with seq_len=8, a prompt of 8 keeps one response target, of 9 none
    data = prepare_instructions(tmp_path, prompts)
    check_responses(checked_config(compose_config([*SFT_RUN, f"data.path={data}"])))
    train = InstructionDataset(data, seq_len=8)
    lost = sum(bool((targets == IGNORE).all()) for _, targets in (train[i] for i in range(len(train))))
    assert lost == sum(n > 8 for n in prompts[:len(train)]) == 9
    assert capsys.readouterr().err.strip() == (
        f"warning: data.dataset.seq_len=8: {lost} of the {len(train)} train examples in {data} keep no response "
        f"token within seq_len+1=9 tokens (their prompts fill it) and add nothing to the loss; raise it to at least "
        f"12 (the longest prompt, in tokens) or shorten the prompts")
    check_responses(checked_config(compose_config([*SFT_RUN, f"data.path={data}", "data.dataset.seq_len=12"])))
    assert capsys.readouterr().err == ""


def make_packed(tmp_path, name="data", repeat=60) -> str:
    rng = random.Random(2)
    (tmp_path / "corpus.txt").write_text("\n".join(sentence(rng, 20) for _ in range(repeat)))
    code = prepare_main([str(tmp_path / "corpus.txt"), "--out", str(tmp_path / name), "--txt-lines"])
    assert code == 0
    return str(tmp_path / name)


LM_ON_TOKENS = ["recipe=lm_files", "model=lm_tiny", "data.dataset.seq_len=32", "data.global_batch_size=8",
                "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=null", "trainer.warmup_steps=0",
                *QUIET]


@pytest.mark.integration  # (tests/test_long_context.py's layouts train prepared tokens in make test)
def test_training_on_prepared_tokens_resumes_exactly_and_agrees_across_meshes(tmp_path):
    data = make_packed(tmp_path)
    runs = {}
    for name, extra in {"2x1": ["mesh=2x1", "checkpoint.every=3"], "1x2": ["mesh=1x2"]}.items():
        result = run_cli([*LM_ON_TOKENS, f"data.path={data}", *extra, f"hydra.run.dir={tmp_path / name}"])
        assert result.returncode == 0, result.stderr[-2000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())["losses"]
    resumed = run_cli([*LM_ON_TOKENS, f"data.path={data}", "mesh=2x1", f"hydra.run.dir={tmp_path / 'resumed'}",
                       f"checkpoint.resume={tmp_path / '2x1' / 'checkpoints' / 'step_3'}"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["losses"] == runs["2x1"]  # bitwise
    torch.testing.assert_close(torch.tensor(runs["1x2"]), torch.tensor(runs["2x1"]), rtol=1e-5, atol=1e-6)
    other_mesh = run_cli([*LM_ON_TOKENS, f"data.path={data}", "mesh=1x2", f"hydra.run.dir={tmp_path / 'other'}",
                          f"checkpoint.resume={tmp_path / '2x1' / 'checkpoints' / 'step_3'}"])
    assert other_mesh.returncode == 0, other_mesh.stderr[-2000:]
    losses = json.loads((tmp_path / "other" / "summary.json").read_text())["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["2x1"]), rtol=1e-5, atol=1e-6)


def test_token_data_that_does_not_fit_the_run_is_refused_before_launch(tmp_path, tokenizer_file):
    data = make_packed(tmp_path)
    small = make_packed(tmp_path, "small", repeat=1)
    cases = [
        ([f"data.path={data}", "model.vocab_size=200"],
         f"config error: model.vocab_size=200: the token data in {data} holds ids up to 121 (its tokenizer's vocabulary is 256); use at least 256"),
        ([f"data.path={data}", f"data.tokenizer={tokenizer_file}"],
         f"config error: data.tokenizer='{tokenizer_file}': the token data in {data} comes from another tokenizer than data.tokenizer (bytes"),
        ([f"data.path={small}"], "config error: data.global_batch_size=8: the dataset's train split has only 3 samples; lower the batch "),
        ([f"data.path={tmp_path / 'nothing'}"], f"config error: data.path='{tmp_path / 'nothing'}': no meta.json there"),
    ]
    for overrides, message in cases:
        result = run_cli([*LM_ON_TOKENS, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], timeout=60)
        assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
        assert not (tmp_path / "run" / "logs").exists()


def instruction_rows(rng: random.Random) -> list:
    """Responses from 1 to 20 bytes: replicas and micro-batches hold very different counts of
    response tokens, so a mean of per-replica means differs visibly from the global mean."""
    return [{"prompt": sentence(rng, rng.randint(1, 4)), "response": "r" * rng.choice([1, 2, 20])} for _ in range(64)]


def test_the_masked_loss_is_the_mean_over_the_global_batchs_response_tokens_on_every_mesh(tmp_path):
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in instruction_rows(random.Random(3))))
    assert prepare_main([str(tmp_path / "sft.jsonl"), "--out", str(tmp_path / "sft")]) == 2  # no "text" field
    assert prepare_main([str(tmp_path / "sft.jsonl"), "--out", str(tmp_path / "sft"), "--prompt-field", "prompt",
                         "--response-field", "response"]) == 0
    base = ["recipe=lm_files", "data=instructions", f"data.path={tmp_path / 'sft'}", "model=lm_tiny",
            "data.dataset.seq_len=32", "data.global_batch_size=8", "sampler.shuffle=false", *QUIET]
    results = {}
    for name, extra in {"1x1": ["mesh=1x1"], "2x1": ["mesh=2x1"], "2x2": ["mesh=2x2", "plan=lm_tp_sp_loss_parallel"],
                        "2x1 micro": ["mesh=2x1", "data.micro_batch_size=1"],
                        "fsdp 2x1": ["mesh=2x1", "parallel.dp_strategy=fsdp"],
                        "pp 2x2x1": ["mesh=pp2x2x1", "plan=none"]}.items():  # rank 0: stage 0's gradients
        cfg = OmegaConf.to_container(compose_config([*base, *extra]), resolve=True)
        world = math.prod(cfg["mesh"]["shape"])
        results[name] = spawn_ranks(world, one_step_gradients, cfg, str(tmp_path / name))[0]
    reference = results["1x1"]
    for name, result in results.items():
        torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=1e-6, msg=name)
        assert set(result["grads"]) == set(reference["grads"]) or name.startswith("pp")
        for param, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][param], rtol=1e-5, atol=1e-6, msg=f"{name} {param}")
    # the by-hand global mean, and how far the mean of per-replica means would be from it
    data = InstructionDataset(str(tmp_path / "sft"), seq_len=32)
    _, targets = zip(*(data[i] for i in range(8)))
    counts = [int((t != IGNORE).sum()) for t in targets]
    assert reference["response_tokens"] == sum(counts)
    print(f"masked-loss parity: {json.dumps({k: v['loss'] for k, v in results.items()})}; per-replica response "
          f"tokens {sum(counts[0::2])} vs {sum(counts[1::2])}; mean of replica means "
          f"{reference['mean_of_halves']:.6f} vs global mean {reference['loss']:.6f}", file=sys.stderr)
    assert abs(reference["mean_of_halves"] - reference["loss"]) > 1e-2  # the wrong mean is visibly wrong


def test_the_prepare_command_runs_as_a_module(tmp_path):
    (tmp_path / "doc.txt").write_text("hello")
    result = run_cli([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out")], module="framework.prepare",
                     timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == (
        f"prepared 1 documents, 6 tokens (packed, uint16) into {tmp_path / 'out'}")
    assert sorted(os.listdir(tmp_path / "out")) == ["doc_offsets.npy", "meta.json", "tokens.bin"]


def test_random_tokens_are_made_per_window_from_the_seed_within_the_vocabulary():
    from framework.data import RandomTokens

    train, again = RandomTokens(vocab_size=1000, seq_len=16, num_samples=10**9), RandomTokens(1000, 16, 10**9)
    inputs, targets = train[123_456_789]
    assert inputs.shape == targets.shape == (16,) and len(train) == 10**9
    assert torch.equal(inputs[1:], targets[:-1])  # next-token targets
    assert torch.equal(inputs, again[123_456_789][0]) and not torch.equal(inputs, train[0][0])
    assert 0 <= int(inputs.min()) and int(inputs.max()) < 1000
    assert not torch.equal(inputs, RandomTokens(1000, 16, 10**9, split="val")[123_456_789][0])


@pytest.mark.timeout(120)
def test_prepare_counts_what_the_user_gave_pairs_examples_or_prompts(tmp_path):
    """Before: 200 preference pairs were reported as "prepared 400 documents" (each pair is two)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"p": f"q{i}", "c": "yes", "r": "no", "l": i % 2 == 0}) + "\n"
                            for i in range(200)))
    kinds = {"pairs": ["--prompt-field", "p", "--chosen-field", "c", "--rejected-field", "r"],
             "examples": ["--prompt-field", "p", "--response-field", "c", "--label-field", "l"],
             "prompts": ["--prompt-field", "p"]}
    for unit, flags in kinds.items():
        result = run_cli([str(rows), "--out", str(tmp_path / unit), *flags], module="framework.prepare", timeout=60)
        assert result.returncode == 0 and result.stdout.startswith(f"prepared 200 {unit}, "), result.stdout
    assert json.loads((tmp_path / "pairs" / "meta.json").read_text())["documents"] == 400  # the format's count


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,flag", [(["--text-field", "body"], "--text-field"),
                                        (["--prompt-field", "p", "--response-field", "resp"], "--response-field")])
def test_a_field_no_record_holds_after_skip_bad_lines_names_the_flag_that_fixes_it(tmp_path, flags, flag):
    """Before: "holds no document", which says neither the field nor the flag."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"p": f"q{i}", "text": "t", "response": "r"}) + "\n" for i in range(5)))
    result = run_cli([str(rows), "--out", str(tmp_path / "out"), "--skip-bad-lines", *flags],
                     module="framework.prepare", timeout=60)
    field = flags[-1]
    assert result.returncode == 2 and result.stderr.strip() == (
        f"input error: {rows}: --skip-bad-lines skipped every line (5; the first: {rows}:1 has no field {field!r}); "
        f"name the field your records hold with {flag}"), result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_kto_on_data_prepared_without_labels_names_the_label_flag(tmp_path, prepared):
    result = run_cli(["recipe=lm_files", "model=lm_tiny", "plan=none", "mesh=1x1", "data=kto", "adapter=lora",
                      f"data.path={prepared['instruction']}", "data.dataset.seq_len=32", "data.global_batch_size=4",
                      f"hydra.run.dir={tmp_path / 'job'}"], timeout=110)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"config error: data.path='{prepared['instruction']}': holds instruction data; this dataset reads unpaired "
        f"data: prepare it again with python -m framework.prepare --prompt-field P --response-field R --label-field L "
        f"(then data=kto), or read it as it is with data=instructions"), result.stderr
    assert not (tmp_path / "job").exists()
