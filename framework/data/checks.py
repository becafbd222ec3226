"""The data's checks before launch, from meta.json (or data=hf's tokenizer) and the config:
tokenizers and vocabularies agree, sample sizes, pad ids, document masking, responses kept."""
import inspect
import json
import sys

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import IterableDataset

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.data.dataset_config import kind_of, tokenizer_of
from framework.data.datasets import InstructionDataset
from framework.data.mixture import source_nodes
from framework.data.tokenizer import described, load_tokenizer


def check_token_data(cfg) -> None:
    """Before launch, from meta.json (or data=hf's tokenizer) alone: every source's tokens come
    from data.tokenizer (when one is named) and from one tokenizer, and fit model.vocab_size.
    (That each split holds a global batch is framework.validate's check_dataset.)"""
    check_sample_sizes(cfg.data.dataset, source_nodes(cfg.data.dataset))
    check_distinct_sources(source_nodes(cfg.data.dataset))
    if cfg.data.get("streaming") and not issubclass(get_class(cfg.data.dataset._target_), IterableDataset):
        raise ConfigError("data.streaming", True, f"{cfg.data.dataset._target_} is read indexed: streaming reads text "
                                                  f"records (data=hf) only; set data.streaming=false")
    named = None
    if cfg.data.get("tokenizer"):
        named = described(load_tokenizer(cfg.data.tokenizer))
    found = {name: tokenizer_of(node) for name, node in source_nodes(cfg.data.dataset).items()}
    found = {name: tokenizer for name, tokenizer in found.items() if tokenizer is not None}
    for name, tokenizer in found.items():
        check_pad_id(source_nodes(cfg.data.dataset)[name], tokenizer, name)
        key = f"data.dataset.sources.{name}" if name else "data.tokenizer"
        if named is not None and tokenizer["identity"] != named["identity"]:
            raise ConfigError(key, tokenizer["path"] if name else cfg.data.tokenizer,
                              f"{tokenizer['source']} comes from another tokenizer than data.tokenizer "
                              f"({tokenizer['path']}, vocabulary {tokenizer['vocab_size']}); prepare the data again "
                              f"with {cfg.data.tokenizer}, or name that one")
        first = next(iter(found.values()))
        if tokenizer["identity"] != first["identity"]:
            raise ConfigError(key, tokenizer["path"], f"{tokenizer['source']} and {first['source']} come from different "
                                         f"tokenizers; a model reads one: use the same tokenizer for every source")
        vocab = cfg.model.get("vocab_size")
        if vocab is not None and max(tokenizer["max_token_id"] + 1, tokenizer["vocab_size"]) > vocab:
            raise ConfigError("model.vocab_size", vocab,
                              f"{tokenizer['source']} holds ids up to {tokenizer['max_token_id']} (its tokenizer's "
                              f"vocabulary is {tokenizer['vocab_size']}); use at least {tokenizer['vocab_size']}, e.g. "
                              "${tokens_vocab:${data.path},${data.tokenizer}} as recipes/lm_files.yaml does")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sample_sizes(dataset, sources: dict) -> None:
    """A sample's length, the held-out share, the data's seed and its number of samples, for
    every dataset and every source of a mixture, before a dataset divides by them or seeds a
    generator with them (a seq_len of 0 ended in a ZeroDivisionError inside Hydra's
    instantiation, num_samples=-4 in torch's, a seed of -1 in numpy's, in a rank)."""
    nodes = {"data.dataset": dataset, **{f"data.dataset.sources.{name}.dataset": node
                                         for name, node in sources.items() if name}}
    mixture = "" not in sources
    for key, node in nodes.items():
        seq_len, fraction = node.get("seq_len"), node.get("val_fraction")
        if seq_len is not None and (not _count(seq_len) or seq_len < 1):
            raise ConfigError(f"{key}.seq_len", seq_len, "must be an integer >= 1 (tokens per sample)")
        seed, samples = node.get("seed"), node.get("num_samples")
        if seed is not None and (not _count(seed) or seed < 0):
            raise ConfigError(f"{key}.seed", seed, "must be an integer >= 0 (the draws' seed)")
        if samples is not None and (not _count(samples) or samples < 1):
            whole = key == "data.dataset" and mixture
            raise ConfigError(f"{key}.num_samples", samples,
                              "must be an integer >= 1 (samples per epoch of the mixture), or null for the sources' "
                              "samples summed" if whole else "must be an integer >= 1 (the dataset's samples)")
        if fraction is not None and (isinstance(fraction, bool) or not 0 <= fraction < 1):
            raise ConfigError(f"{key}.val_fraction", fraction, "must be in [0, 1): the share of the data held out")


def check_distinct_sources(sources: dict) -> None:
    """No mixture source is another's dataset again under a second name: its weight would be
    the two weights summed, drawn as two sources."""
    seen = {}
    for name, node in sources.items():
        if not isinstance(node, DictConfig):
            continue  # (the mixture refuses a source that is no dataset config)
        same = seen.setdefault(json.dumps(OmegaConf.to_container(node), sort_keys=True), name)
        if same != name:
            raise ConfigError(f"data.dataset.sources.{name}.dataset", node.get("path", node.get("_target_")),
                              f"is source {same}'s dataset again; give it once, with the weight you mean")


def check_pad_id(node, tokenizer: dict, source: str) -> None:
    """A pad id the tokenizer has (completions and examples are padded with it)."""
    pad_id, vocab = node.get("pad_id"), tokenizer["vocab_size"]
    if pad_id is not None and (not isinstance(pad_id, int) or isinstance(pad_id, bool) or not 0 <= pad_id < vocab):
        key = f"data.dataset.sources.{source}.dataset.pad_id" if source else "data.dataset.pad_id"
        raise ConfigError(key, pad_id, f"must be a token id of {tokenizer['path']} (0 to {vocab - 1}), or null "
                                       f"for its EOS")


def check_document_masking(c: Checked) -> None:
    """data.document_masking needs packed token data, which has the documents' boundaries, and a
    model whose forward takes the tokens' positions in their documents."""
    cfg, model = c.cfg, c.model
    dataset = cfg.data.dataset
    masking = bool(cfg.data.get("document_masking")) or bool(dataset.get("document_masking"))
    if not masking:
        return
    for node in source_nodes(dataset).values():
        if kind_of(node) != "packed":
            raise ConfigError("data.document_masking", True, f"{node.get('_target_')} has no document boundaries "
                                                             f"(only packed token data, data=tokens or data=hf, has); "
                                                             f"set data.document_masking=false")
    if "positions" not in inspect.signature(type(model).forward).parameters:
        raise ConfigError("data.document_masking", True, f"{type(model).__name__} takes no document positions "
                                                         f"(framework.models.Transformer does); set "
                                                         f"data.document_masking=false")


def check_responses(c: Checked) -> None:
    """Before launch, for instruction data: the examples cut to seq_len keep a response token.
    A split where none does would train (or evaluate) on a loss of 0 at every step: refused.
    Some that do not only add nothing to the loss: one warning line with their count."""
    cfg = c.cfg
    if kind_of(cfg.data.dataset) not in ("instruction", "preference", "unpaired"):
        return
    for split in ("train", "val") if cfg.trainer.eval_every else ("train",):
        data = instantiate(cfg.data.dataset, split=split)
        cut = int(data.without_response().sum())
        if cut:
            _report_cut(data, split, cut)


def _report_cut(data: InstructionDataset, split: str, cut: int) -> None:
    seq_len = data.seq_len
    what = (f"{cut} of the {len(data)} {split} examples in {data.path} keep no response token within "
            f"seq_len+1={seq_len + 1} tokens (their prompts fill it)")
    fix = f"raise it to at least {data.longest_prompt()} (the longest prompt, in tokens) or shorten the prompts"
    if cut == len(data):
        raise ConfigError("data.dataset.seq_len", seq_len, f"{what}, so the loss would be 0 at every step; {fix}")
    print(f"warning: data.dataset.seq_len={seq_len}: {what} and add nothing to the loss; {fix}", file=sys.stderr)
