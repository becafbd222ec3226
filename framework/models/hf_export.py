"""Write a model in Hugging Face's layout: config.json and the tokenizer files carried over from
the directory it was loaded from, the weights as safetensors under Hugging Face's names, split
into shards with an index file past `max_shard_bytes` (as save_pretrained does). Written under
OUT.partial-<pid> and renamed at the end: a failure leaves no half-written model."""
import json
import os
import shutil
from contextlib import contextmanager
from typing import Dict, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from framework.config.errors import ConfigError
from framework.models.hf import SIDE_FILES, check_hf_out, model_state_dict
from framework.models.adapter_names import adapter_layers
from framework.models.lora import merged_state_dict, peft_adapter
from framework.models.protocol import from_hugging_face, offered

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _sizes(state: Dict[str, torch.Tensor]) -> Dict[str, int]:
    """Each tensor's bytes (a DTensor's whole tensor's)."""
    return {name: tensor.numel() * tensor.element_size() for name, tensor in state.items()}


def _model_order(name: str) -> tuple:
    """Hugging Face's order of a decoder's tensors: the embedding, the layers by index, the rest."""
    parts = name.split(".")
    if "layers" in parts:
        return 1, int(parts[parts.index("layers") + 1])
    return (0, 0) if "embed" in name else (2, 0)


def _whole_model_sizes(state: Dict[str, torch.Tensor]) -> Dict[str, int]:
    """Every tensor's bytes, whichever rank holds it (each pipeline stage holds its own), in the
    model's order: the same on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _sizes(state))
    merged = {name: size for sizes in gathered for name, size in sizes.items()}
    return {name: merged[name] for name in sorted(merged, key=_model_order)}


def _file_numbers(sizes: Dict[str, int], max_bytes: int) -> Dict[str, int]:
    """Each tensor's file (1, 2, ...), in order, a new file when the next tensor would pass max_bytes."""
    numbers, number, size = {}, 1, 0
    for name, nbytes in sizes.items():
        if size and size + nbytes > max_bytes:
            number, size = number + 1, 0
        numbers[name] = number
        size += nbytes
    return numbers


def _carry_side_files(model: nn.Module, out: str, dtype: torch.dtype) -> None:
    for name in SIDE_FILES:
        if os.path.isfile(os.path.join(model.hf_path, name)):
            shutil.copy2(os.path.join(model.hf_path, name), os.path.join(out, name))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    # the weights' dtype as written (transformers 5 reads `dtype`, 4.x `torch_dtype`)
    config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = str(dtype).split(".")[1]
    if model.max_positions is not None:  # config.json's, or +model.max_positions when a run went past it
        config["max_position_embeddings"] = model.max_positions
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_hf_sharded(module: nn.Module, out: str, rank: int, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """`module` (sharded by TP / FSDP, split into pipeline stages) to `out`, with no rank
    gathering the model: each rank writes its own slices (DCP's HuggingFaceStorageWriter), then
    rank 0 joins them tensor by tensor into Hugging Face's files (DCP's consolidation) and
    publishes the directory."""
    state = model_state_dict(module, get_model_state_dict(module))
    file_of = _file_numbers(_whole_model_sizes(state), max_shard_bytes)  # the same on every rank
    partial = f"{out.rstrip(os.sep)}.partial"
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(partial, fqn_to_index_mapping=file_of,
                                                            save_distributed=True, enable_consolidation=True))
    if rank == 0:
        shutil.rmtree(os.path.join(partial, "sharded"))
        if max(file_of.values()) == 1:  # one file: the name from_pretrained looks for without an index
            os.rename(os.path.join(partial, "model-00001-of-00001.safetensors"), os.path.join(partial, "model.safetensors"))
            os.remove(os.path.join(partial, "model.safetensors.index.json"))
        _carry_side_files(module, partial, next(iter(state.values())).dtype)
        os.rename(partial, out)
    dist.barrier()


@contextmanager
def _published(out: str) -> Iterator[str]:
    """`with _published(out) as partial:` the files written under `partial` (OUT.partial-<pid>)
    appear at `out` (absent or empty: check_hf_out) together when the block ends; a block that
    raises leaves no directory behind."""
    partial = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        yield partial
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked before
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def save_peft(model: nn.Module, adapter, out: str) -> None:
    """The model's LoRA adapters as PEFT writes them (`PeftModel.from_pretrained(base, out)`):
    adapter_model.safetensors and adapter_config.json, under OUT.partial-<pid> renamed at the end."""
    from safetensors.torch import save_file

    if next(adapter_layers(model), None) is None:
        raise ConfigError("--format", "peft", "needs a checkpoint of a run with adapters (adapter=lora); this one "
                                              "has none: export it with --format pt or hf")
    check_hf_out(out)
    tensors, config = peft_adapter(model, adapter)
    with _published(out) as partial:
        save_file(tensors, os.path.join(partial, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(partial, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)


def save_hf(model: nn.Module, out: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """`model` (an HFTransformer whose weights are whole tensors on this process) to `out`."""
    from safetensors.torch import save_file

    if not from_hugging_face(model):
        raise ConfigError("--format", "hf", f"needs a model loaded from a Hugging Face directory (model=hf); this "
                                            f"one is a {type(model).__name__}: export it with --format pt")
    check_hf_out(out)
    # (adapters, if any, merged into their weights; what transformers converts on load stored as its files are)
    state = offered(model).stored_state(model_state_dict(model, merged_state_dict(model)))
    numbers = _file_numbers(_sizes(state), max_shard_bytes)
    shards = [{k: t.contiguous() for k, t in state.items() if numbers[k] == n} for n in range(1, max(numbers.values()) + 1)]
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    with _published(out) as partial:
        for name, shard in zip(names, shards):
            save_file(shard, os.path.join(partial, name), metadata={"format": "pt"})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
            with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        _carry_side_files(model, partial, next(iter(state.values())).dtype)
