"""DPO's, KTO's and GRPO's reference (objective.reference): the model training started from,
never trained, of one of three kinds (framework.training.objectives.preference's docstring):
adapters_off, frozen_copy, precomputed (stored beside the prepared data)."""
import hashlib
import json
import logging
import os
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import default_collate

from framework.atomic import atomic_file
from framework.checkpoint.base_model import base_model
from framework.checkpoint.compat import checkpoint_dir
from framework.config.errors import ConfigError
from framework.config.checked import Checked
from framework.data.batch import Batch
from framework.models.lora import adapters_disabled
from framework.models.protocol import offered
from framework.parallel.dtensors import local_bytes, reshard
from framework.training.objectives.head import OutputHead
from framework.training.objectives.logps import sequence_logps

log = logging.getLogger("framework")
REFERENCES = ("adapters_off", "frozen_copy", "precomputed")


class Reference:
    """DPO's and KTO's reference, of objective.reference's kind (the module's docstring)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.model: Optional[nn.Module] = None  # frozen_copy's
        self.head = OutputHead()  # (setup: the policy's; frozen_copy's own output layer)

    def setup(self, context) -> None:
        """frozen_copy's model (the builder's: context.reference_model) and how its forwards meet
        its output layer; precomputed's log-probabilities attached to each split."""
        self.head = context.head
        if self.kind == "frozen_copy":
            self.model = context.reference_model
            self.head = self.head.of(self.model)
        elif self.kind == "precomputed":
            for dataset in filter(None, (context.dataset, context.val_dataset)):
                dataset.reference = precomputed_reference(context, dataset)

    @torch.no_grad()
    def logps(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
              stored: Optional[torch.Tensor], **model_inputs) -> torch.Tensor:
        """The reference's log-probability of each sequence of `inputs` (..., seq_len), in their
        shape: `stored` (precomputed's, as the batch carries them), or a forward of frozen_copy's
        model or of the policy `model` with its adapters off (`model_inputs`: a row's images, as
        the policy's forward takes them)."""
        if self.kind == "precomputed":
            if stored is None:
                raise RuntimeError("objective.reference=precomputed: the batch carries no reference log-probabilities "
                                   "(the objective's setup attaches them to the dataset before training)")
            return stored
        flat, flat_targets = inputs.reshape(-1, inputs.shape[-1]), targets.reshape(-1, targets.shape[-1])
        return sequence_logps(self.logits(model, flat, flat_targets, **model_inputs),
                              flat_targets).view(targets.shape[:-1])

    @torch.no_grad()
    def logits(self, model: nn.Module, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None,
               **model_inputs) -> torch.Tensor:
        """The reference's logits of `inputs` (rows, seq_len): frozen_copy's model's, or the
        policy `model`'s with its adapters off; given `targets`, at the ones that count alone
        where the mesh allows (output_head)."""
        head = self.head if targets is not None else OutputHead()
        if self.kind == "frozen_copy":
            if self.model is None:
                raise RuntimeError("objective.reference=frozen_copy: no reference model (the objective's setup builds "
                                   "it)")
            logits = head(self.model, inputs, targets, per_token=True, **model_inputs)
            reshard(self.model)
            return logits
        with adapters_disabled(model):
            return head(model, inputs, targets, per_token=True, **model_inputs)

    def held_bytes(self) -> int:
        """The reference's parameters (frozen_copy's; the others hold none)."""
        return sum(local_bytes(p) for p in self.model.parameters()) if self.model is not None else 0


def reference_gone(path: str) -> ConfigError:
    return ConfigError("objective.reference", "precomputed", f"{path} is gone, and a resumed full-training run's "
                                                             f"model is no longer its reference; restore it, or use "
                                                             f"objective.reference=frozen_copy")


def check_reference_on_resume(c: Checked) -> None:
    """Before any rank starts: a full-training run resumed with checkpoint.resume cannot make its
    precomputed reference again (its model is no longer the one training started from), so each
    split's stored log-probabilities must still be there."""
    cfg, directory, model = c.cfg, c.checkpoint_dir, c.model
    if cfg.objective.get("reference") != "precomputed" or cfg.adapter.kind != "none" or not cfg.checkpoint.resume \
            or directory is None:
        return
    base = base_model(cfg, directory, offered(model).hf_path)
    for split in ("train", "val") if cfg.trainer.eval_every else ("train",):
        path = reference_path(cfg, instantiate(cfg.data.dataset, split=split), base)
        if not os.path.isfile(path):
            raise reference_gone(path)


def reference_path(cfg, dataset, base: dict) -> str:
    """Where a split's precomputed reference log-probabilities lie: named by what makes them
    (the base model, the adapter's kind and NF4 blocks, the precision, seq_len, padding, split)."""
    adapter = OmegaConf.to_container(cfg.adapter, resolve=True)
    made_of = {"base": base, "adapter": {k: adapter.get(k) for k in ("kind", "block_size", "scaler_block_size")},
               "mixed_precision": cfg.trainer.mixed_precision, "seq_len": dataset.seq_len, "pad_id": dataset.pad_id,
               "val_fraction": dataset.val_fraction}
    digest = hashlib.sha256(json.dumps(made_of, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return os.path.join(dataset.path, "reference_logps", f"{digest}-{dataset.split}.npy")


def precomputed_reference(context, dataset) -> np.ndarray:
    """The split's (samples, 2) reference log-probabilities (a pair's two responses, or an unpaired
    example and its mismatched row): read if a run stored them, else made now by every rank (each
    DP replica its share of the samples, gathered) and stored by rank 0."""
    cfg = context.cfg
    base = base_model(cfg, checkpoint_dir(cfg, context.out_dir), offered(context.module).hf_path)
    path = reference_path(cfg, dataset, base)
    if not os.path.isfile(path):
        if context.resumed and cfg.adapter.kind == "none":  # (an elastic restart's resume)
            raise reference_gone(path)
        values = _reference_logps(context, dataset)
        if context.rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with atomic_file(path, "wb") as f:
                np.save(f, values)
            log.info("objective.reference=precomputed: the reference log-probabilities of %d %s samples, in %s",
                     len(values), dataset.split, path)
        dist.barrier()
    return np.load(path)


@torch.no_grad()
def _reference_logps(context, dataset) -> np.ndarray:
    """Sample i's log-probabilities under the model as training starts, adapters off, on replica
    i mod DP (its TP ranks together), in micro-batches; gathered over DP."""
    cfg, model = context.cfg, context.model
    replicas, replica = context.samples.size, context.samples.rank
    per_replica = -(-len(dataset) // replicas)
    mine = [min(replica + k * replicas, len(dataset) - 1) for k in range(per_replica)]  # (the last repeated)
    size = cfg.data.micro_batch_size or cfg.data.global_batch_size // replicas
    device = torch.device(context.device.type)
    bf16 = cfg.trainer.mixed_precision == "bf16" and cfg.parallel.dp_strategy == "replicate"
    values = []
    model.eval()
    with adapters_disabled(context.module), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        for start in range(0, len(mine), size):
            samples = Batch.of(default_collate([dataset[i] for i in mine[start:start + size]]), device)
            inputs, targets = samples.inputs.flatten(0, 1), samples.targets.flatten(0, 1)
            values.append(sequence_logps(model(inputs), targets).view(-1, 2))
    model.train()
    local = torch.cat(values).double()
    gathered = [torch.empty_like(local) for _ in range(replicas)]
    if replicas > 1:
        dist.all_gather(gathered, local, group=context.replicas.group)
    else:
        gathered = [local]
    gathered = torch.stack(gathered)
    # sample replica + k * replicas is gathered[replica][k]
    return gathered.transpose(0, 1).reshape(-1, 2)[:len(dataset)].float().cpu().numpy()


def check_reference(c: Checked, allowed: Tuple[str, ...] = REFERENCES, used: bool = True,
                    otherwise: str = "") -> None:
    """objective.reference names a reference the objective can make (`allowed`); where it is
    `used` (GRPO: beta > 0), adapters_off needs adapters. `otherwise`: the objective's other fix."""
    objective = c.cfg.objective
    if objective.reference not in allowed:
        raise ConfigError("objective.reference", objective.reference, f"use one of {', '.join(allowed)}")
    if used and objective.reference == "adapters_off" and c.cfg.adapter.kind == "none":
        raise ConfigError("objective.reference", "adapters_off", f"is the base model with the adapters off, and this "
                                                                 f"run has none (adapter=none); use adapter=lora, or "
                                                                 f"objective.reference=frozen_copy for full "
                                                                 f"training{otherwise}")


def check_precomputed(cfg) -> None:
    path = cfg.data.dataset.path
    if cfg.objective.reference == "precomputed" and not os.access(os.path.expanduser(path), os.W_OK):
        raise ConfigError("objective.reference", "precomputed", f"stores the log-probabilities beside the data, and "
                                                                f"{path} is not writable; make it so, or use "
                                                                f"adapters_off / frozen_copy")
