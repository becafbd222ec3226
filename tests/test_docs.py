"""The README and docs/ as a new user reads them: every link lands, every page starts with its
commands, and every command still runs as written: the configs of framework.train, dryrun,
verify, inspect and planner compose and pass validation (with the docs' placeholder paths
standing for test data), and every flag of the other commands is one their --help lists."""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from framework.validate import check_known_keys, validate
from tests.conftest import ROOT, compose_config
from tests.hf_models import colour_pairs, colour_records, hf_records, make_hf_model, make_vlm

PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
CONFIG_COMMANDS = {"framework.train", "framework.dryrun", "framework.verify", "framework.inspect", "framework.planner"}
PROGRAM = re.compile(r"^(\$ )?(\.venv/bin/)?(python|torchrun)\b")


def text(page: str) -> str:
    return (Path(ROOT) / page).read_text()


def anchors(page: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", text(page), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def commands(page: str) -> List[List[str]]:
    """Each command line of the page's code blocks as its words, continuation lines joined and
    trailing comments dropped; `...` (the previous command's arguments) filled in."""
    found = []
    fenced = re.findall(r"```[a-z]*\n(.*?)\n```", text(page), re.S)
    # and Markdown's indented blocks: lines of four spaces after a blank line (docs/training.md's)
    indented = re.findall(r"(?:^|\n\n)((?: {4}.*(?:\n|$))+)", re.sub(r"```.*?```", "", text(page), flags=re.S))
    for block in fenced + indented:
        first = None
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if not PROGRAM.match(line.strip()):
                continue
            words = shlex.split(line.strip().removeprefix("$ "), comments=True)
            if "-m" not in words:  # a script (bench/...), not a command of the package
                continue
            if "..." in words:
                at = words.index("...")
                words = words[:at] + [w for w in first if w not in words] + words[at + 1:]
            elif first is None or words[:3] != first[:3]:
                first = words
            found.append(words)
    return found


def module_and_arguments(words: List[str]) -> tuple:
    at = words.index("-m")
    return words[at + 1], words[at + 2:]


ALL = [(page, words) for page in PAGES for words in commands(page)]


def test_every_link_of_the_readme_and_the_docs_lands_on_a_file_and_heading():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)]+)\)", text(page)):
            if target.startswith("http"):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert (Path(ROOT) / resolved).exists(), f"{page}: {target} names no file"
            if anchor:
                assert anchor in anchors(resolved), f"{page}: {target}: no such heading in {resolved}"


def test_each_docs_page_starts_with_its_commands_and_the_readme_maps_every_page():
    for page in PAGES[1:]:
        lines = [line for line in text(page).splitlines() if line.strip()]
        assert lines[0].startswith("# ") and lines[1].startswith("```"), f"{page} does not start with commands"
        assert f"]({page})" in text("README.md"), f"README.md does not link {page}"
    assert len(text("README.md").splitlines()) < 150  # a page


@pytest.fixture(scope="module")
def placeholders(hf_dirs, prepared, tmp_path_factory) -> Dict[str, str]:
    """What the docs' example paths stand for here: a tiny HF Llama and data prepared for it."""
    from framework.prepare import main as prepare

    root = tmp_path_factory.mktemp("docs")
    (root / "my_texts").mkdir()
    (root / "my_texts" / "a.py").write_text("print('the mesh trains one model')\n" * 2000)
    # a Llama of Qwen2.5-0.5B's context (the recipes' 512-token windows fit) and width enough for
    # QLoRA's default NF4 blocks (64 x 256 values)
    model = make_hf_model("llama", str(root / "model"), max_position_embeddings=32768, hidden_size=256,
                          intermediate_size=256)
    pairs = os.path.join(os.path.dirname(prepared["preference"]), "pairs.jsonl")
    assert prepare([pairs, "--prompt-field", "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected",
                    "--tokenizer", model, "--out", str(root / "prefs")]) == 0
    (root / "text.txt").write_text("".join(f"line {i}: the mesh trains one model\n" for i in range(8000)))
    assert prepare([str(root / "text.txt"), "--tokenizer", model, "--out", str(root / "qwen_tokens")]) == 0
    (root / "my_docs").mkdir()  # data=hf: a folder of JSONL records with a text field
    (root / "my_docs" / "part-0.jsonl").write_text("".join(json.dumps({"text": f"record {i}: the mesh trains one "
                                                                               f"model on its data " * 4}) + "\n"
                                                           for i in range(600)))
    shutil.copy(os.path.join(os.path.dirname(prepared["instruction"]), "chat.jsonl"), root / "chats.jsonl")
    prompts = os.path.join(os.path.dirname(prepared["prompts"]), "prompts.jsonl")
    assert prepare([prompts, "--prompt-field", "prompt", "--answer-field", "answer", "--tokenizer", model, "--out",
                    str(root / "prompts")]) == 0
    unpaired = os.path.join(os.path.dirname(prepared["unpaired"]), "unpaired.jsonl")
    assert prepare([unpaired, "--prompt-field", "prompt", "--response-field", "completion", "--label-field", "label",
                    "--tokenizer", model, "--out", str(root / "kto")]) == 0
    (root / "my_rewards.py").write_text("def score(prompt, completion, answer):\n    return float(answer in completion)\n")
    (root / "my_env.py").write_text("class MyEnv:\n    marker = '='\n\n    def __init__(self, prompt, answer):\n"
                                    "        pass\n\n    def respond(self, completion):\n        return '1'\n")
    gemma = make_hf_model("gemma3_text", str(root / "gemma"), max_position_embeddings=32768)  # (transformers' classes)
    assert prepare([str(root / "text.txt"), "--tokenizer", gemma, "--out", str(root / "gemma_tokens")]) == 0
    vlm = make_vlm(str(root / "vlm"))  # docs/vision-language.md's Gemma 3 and its colour records
    colours = colour_records(str(root / "colours"), 256)
    vqa = hf_records([json.loads(line) for line in open(colours)], root / "colours", root / "my_vqa", as_list=False)
    return {"/models/gemma-3-4b-it": vlm, "data/colours/train.jsonl": colours, "data/my_vqa": vqa,
            "data/colours/pairs.jsonl": colour_pairs(str(root / "colours"), 256),
            "/models/gemma-3-1b-pt": gemma, "data/gemma_tokens": str(root / "gemma_tokens"),
            "/models/Qwen2.5-0.5B": model, "data/qwen_tokens": str(root / "qwen_tokens"),
            "my_docs/": str(root / "my_docs"), "chats.jsonl": str(root / "chats.jsonl"),
            "data/my_tokens": prepared["packed"], "data/my_sft": prepared["instruction"],
            "data/prefs": str(root / "prefs"), "$HOME/my_texts": str(root / "my_texts"),
            "data/prompts": str(root / "prompts"), "data/kto": str(root / "kto"), "my_rewards.py": str(root / "my_rewards.py"),
            "my_env.py": str(root / "my_env.py")}


def overrides_of(module: str, arguments: List[str], placeholders: Dict[str, str]) -> List[str]:
    """The Hydra overrides of a config command: inspect's subcommand, the planner's flags and a
    sweep's other points dropped; example paths replaced by test data."""
    if module == "framework.inspect":
        arguments = arguments[1:]
    arguments = [a for a in arguments if not a.startswith("--") and not a.isdigit()]
    if "-m" in arguments:  # a sweep: its first point (commas outside brackets separate the points)
        arguments = [re.split(r",(?![^\[]*\])", a)[0] for a in arguments if a != "-m"]
    for placeholder, path in placeholders.items():
        arguments = [a.replace(placeholder, path) for a in arguments]
    return arguments


# Validation needs what the command names to exist: a run to resume, a torchrun world, a
# lighthouse, Slurm, a planner's choice. These compose (keys and values checked) and stop there.
NEEDS_A_PLACE = re.compile(r"DATE/TIME|HOST|mesh=auto|submitit_slurm|outputs/lm")


@pytest.mark.timeout(600)
def test_every_documented_config_command_composes_and_passes_validation(placeholders):
    checked = 0
    for page, words in ALL:
        module, arguments = module_and_arguments(words)
        if module not in CONFIG_COMMANDS:
            continue
        overrides = overrides_of(module, arguments, placeholders)
        try:
            cfg = compose_config(overrides)
            check_known_keys(cfg)
            if not NEEDS_A_PLACE.search(" ".join(words)):
                validate(cfg, world_size=4 if words[0].endswith("torchrun") else None)
        except Exception as error:
            pytest.fail(f"{page}: {' '.join(words)}: {error}")
        checked += 1
    assert checked >= 50


@pytest.mark.parametrize("module", sorted({module_and_arguments(w)[0] for _, w in ALL} - CONFIG_COMMANDS))
def test_every_flag_the_docs_give_another_command_is_one_its_help_lists(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for page, words in ALL:
        if module_and_arguments(words)[0] == module:
            for flag in (w for w in module_and_arguments(words)[1] if w.startswith("--")):
                assert flag in result.stdout, f"{page}: {' '.join(words)}: {flag} is not in {module} --help"


def test_the_docs_list_every_pair_of_features_that_does_not_compose_yet():
    from framework.not_yet import NOT_YET

    page = text("docs/checks-and-trust.md")
    rows = [line for line in page.split("## Features that do not compose yet")[1].splitlines() if line.startswith("| `")]
    assert rows == [f"| `{p.key}{'=' + p.shown if p.shown else ''}` | {p.other} | {p.why} |" for p in NOT_YET]
