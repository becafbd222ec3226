"""Where a model's weights come from, decided here for every command that builds one: the
run's starting point (a checkpoint to resume, checkpoint.init_from's weights, or a fresh start),
and the base weights under it (init_from's, a Hugging Face model's files, or those trainer.seed
drew as the model was built). The builder's `weights` stage, export, generate and DPO's frozen
copy load them through `load_base` (framework.models.lifecycle gives the model its storage)."""
import ctypes
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from framework.checkpoint.layout import newest_checkpoint, read_meta, resolve
from framework.checkpoint.safe_load import load_checkpoint
from framework.models.adapter_names import is_adapter
from framework.models.hf import EXPERT, hf_name, model_state_dict
from framework.models.stored_tensors import StoredTensors
from framework.models.protocol import offered
from framework.parallel.dtensors import place_whole


def restart_count() -> int:
    """How often the elastic agent (self-launched or torchrun) restarted this job's ranks."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@dataclass(frozen=True)
class Start:
    """What a run starts from: `resume` (every part from `path`), `init` (`path`'s model
    weights, the rest fresh) or `fresh`."""
    kind: str = "fresh"
    path: Optional[str] = None

    def replaces_base(self) -> bool:
        """A resume of a checkpoint that holds the whole model (not a LoRA run's adapters alone):
        its weights replace the base, which is then not read at all."""
        return self.kind == "resume" and "base" not in read_meta(self.path)


def base_checkpoint(cfg: DictConfig, directory: str) -> Optional[str]:
    """checkpoint.init_from's step dir (None without one): the weights under the run's, whether
    it starts from them or resumes the adapters trained on them (and DPO's reference's)."""
    return resolve(cfg.checkpoint.init_from, directory) if cfg.checkpoint.init_from else None


def starting_point(cfg: DictConfig, directory: str, rank: int) -> Start:
    """Decided by rank 0 and shared: after an elastic restart the newest complete checkpoint in
    `directory`; else checkpoint.resume, else checkpoint.init_from."""
    choice = [Start()]
    if rank == 0:
        c = cfg.checkpoint
        newest = newest_checkpoint(directory) if restart_count() else None
        resume = newest or (resolve(c.resume, directory) if c.resume else None)
        if resume:
            choice = [Start("resume", resume)]
        elif c.init_from:
            choice = [Start("init", base_checkpoint(cfg, directory))]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def load_base(module: nn.Module, init_from: Optional[str], hf_path: Optional[str]) -> str:
    """The base weights into `module`'s parameters in place (each rank its own shards; LoRA
    adapters untouched): `init_from`'s checkpoint, else the Hugging Face files in `hf_path`,
    else none (the seed's stay). What to say of them."""
    with warnings.catch_warnings():  # DCP's note when it reads in one process (export, generate)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if init_from:
            read_meta(init_from)
            state = {k: v for k, v in get_model_state_dict(module).items() if not is_adapter(k)}
            load_checkpoint({"model": state}, init_from, no_dist=not dist.is_initialized())
            set_model_state_dict(module, state, options=StateDictOptions(strict=False))
            return f"model weights from {init_from}; optimizer, schedule and data start fresh"
        if hf_path:
            load_hf_weights(module, hf_path)
            return f"model weights from the Hugging Face model in {hf_path}"
    return "fresh start"


@torch.no_grad()
def stream_hf_weights(module: nn.Module, path: str, device: str,
                      convert: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """A model still on meta, before any parallel stage, given its Hugging Face weights one
    parameter at a time: each read from the files, passed through `convert` (QLoRA's: an adapted
    layer's weight to NF4) and stored before the next is read, so the model is never whole in the
    files' precision on the rank (load_hf_weights' DCP reader needs every parameter's storage
    first). Buffers first get storage and their values (ModelProtocol.init_buffers: transformers'
    rotary frequencies, say), the parameters still on meta; adapters get storage, drawn by the
    caller."""
    stored, declared = StoredTensors(path), offered(module)
    layout = declared.stored_layout(stored.shapes()) if declared.hf_names else None
    for name, buffer in list(module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    declared.init_buffers()
    for name, param in list(module.named_parameters()):  # (a tied output is the embedding's: named once)
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        if not is_adapter(name):
            if layout is not None:  # (a tensor transformers converts on load: its group made whole)
                value.copy_(layout.make(layout.group_of(name), stored.__getitem__)[name] if name in layout.made
                            else stored[layout.renamed[name]])
            elif EXPERT in hf_name(name, declared.model_type):  # a stacked expert weight, one expert per tensor
                for e in range(len(value)):
                    value[e].copy_(stored[hf_name(name, declared.model_type).replace(EXPERT, str(e))])
            else:
                value.copy_(stored[hf_name(name, declared.model_type)])
            value = convert(name, value)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=param.requires_grad))
        _return_freed_memory()
    module.tie_weights()


def _return_freed_memory() -> None:
    """glibc keeps the memory of freed tensors below its (growing) mmap threshold in the heap,
    where what the next tensor leaves in the way pins it: the rank's resident memory then grows
    as if every tensor read were held. malloc_trim hands the free pages back (measured: a
    streamed 8-layer QLoRA load held 387 MB after it without, 47 MB with). Elsewhere: nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_hf_weights(module: nn.Module, path: str) -> None:
    """Each rank reads its own slices of the safetensors into its (DTensor) parameters. The
    state dict's tensors are the parameters' own storage (shards under TP / FSDP), so DCP's load
    writes them in place: no second copy of the model. A tensor transformers converts on load
    (experts stored one tensor each, stacked into one weight) is made whole by its operations,
    one group at a time, and each rank keeps its part."""
    hf_state = model_state_dict(module, get_model_state_dict(module))  # an expert's entry: its slice of the stack
    declared = offered(module)
    if declared.hf_names:
        stored = StoredTensors(path)
        layout = declared.stored_layout(stored.shapes())
        for group in layout.converted:
            for name, full in layout.make(group, stored.__getitem__).items():
                if name in hf_state:
                    place_whole(hf_state.pop(name), full)
            _return_freed_memory()
        hf_state = {layout.renamed[name]: tensor for name, tensor in hf_state.items()}
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(path))
