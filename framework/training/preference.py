"""`objective=dpo`: Direct Preference Optimization (Rafailov et al. 2023, TRL's DPOTrainer) on
preference pairs (framework.data.PreferenceDataset: each sample a prompt + chosen and the same
prompt + rejected).

A pair's loss is -log sigmoid(beta * ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))))
(with label_smoothing e, TRL's conservative DPO: (1 - e) times that plus e times the same of
the swapped pair), each log-probability summed over the response's tokens. Its unit is the
pair: the step's loss is the sum over the global batch's pairs over their number, on every mesh
and with micro-batches, as the lm objective's is over tokens.

The reference is the model training started from, never trained:
- `adapters_off` (with adapter=lora / qlora): the policy itself with its adapters skipped, no
  second copy of the weights (TRL's and torchtune's choice);
- `frozen_copy`: a second model built from the same source (the seed, the Hugging Face files or
  checkpoint.init_from) and sharded as the policy (its TP plan, fsdp / hsdp), frozen: no
  gradients and no optimizer state, its parameter bytes again;
- `precomputed`: each pair's reference log-probabilities, computed once before the first step
  (the model as training starts, adapters off) over the train and val splits and stored beside
  the prepared data (`<data.path>/reference_logps/<id>-<split>.npy`, the id naming the base
  model and what changes the numbers); later runs read them, and a step runs no reference.
A logging step shows TRL's metrics (global-batch means): rewards/chosen, rewards/rejected
(beta times each response's log-ratio to the reference), rewards/margins, rewards/accuracies
(the share of pairs whose chosen reward is the larger), logps/chosen, logps/rejected.
"""
import hashlib
import json
import logging
import os
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from framework.atomic import atomic_file
from framework.checkpoint.weights import base_checkpoint, load_base
from framework.config.errors import ConfigError
from framework.config.checked import Checked
from framework.data.tokens import IGNORE, kind_of
from framework.models.lifecycle import allocate
from framework.models.lora import adapters_disabled
from framework.parallel.plan import final_output_layout
from framework.training.objectives import Objective, StepShare
from framework.models.protocol import offered

log = logging.getLogger("framework")
REFERENCES = ("adapters_off", "frozen_copy", "precomputed")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sequence, the sum of its targets' log-probabilities (targets -100 left out)."""
    token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return -token.view(targets.shape).sum(-1)


class DirectPreference(Objective):
    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, reference: str = "adapters_off",
                 aux_coefficients: Optional[Dict[str, float]] = None):
        super().__init__(aux_coefficients)
        self.beta, self.label_smoothing, self.reference = beta, label_smoothing, reference
        self.reference_model: Optional[nn.Module] = None  # frozen_copy's
        self._sums: Dict[str, torch.Tensor] = {}

    def setup(self, run) -> None:
        if self.reference == "frozen_copy":
            self.reference_model = frozen_copy(run)
        elif self.reference == "precomputed":
            datasets = [run.dataset] + ([run.val_dataloader.dataset] if run.val_dataloader is not None else [])
            for dataset in datasets:
                dataset.reference = precomputed_reference(run, dataset)

    def forward(self, model: nn.Module, batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """The policy's logits for every sequence of the pairs (chosen, rejected, ...), and the
        reference's log-probabilities of each pair's two (pairs, 2)."""
        inputs, targets = batch.inputs.flatten(0, 1), batch.targets.flatten(0, 1)
        if self.reference == "precomputed":
            if batch.reference is None:
                raise RuntimeError("objective.reference=precomputed: the batch carries no reference log-probabilities "
                                   "(DirectPreference.setup attaches them to the dataset before training)")
            return model(inputs), batch.reference
        if self.reference == "frozen_copy" and self.reference_model is None:
            raise RuntimeError("objective.reference=frozen_copy: no reference model (DirectPreference.setup builds it)")
        with torch.no_grad():
            if self.reference_model is not None:
                from torch.distributed.fsdp import FSDPModule  # (the launcher imports this module: not at its top)

                reference = self.reference_model(inputs)
                if isinstance(self.reference_model, FSDPModule):  # FSDP2 keeps a root unsharded after
                    self.reference_model.reshard()  # forward, for the backward this model never has
            else:
                with adapters_disabled(model):
                    reference = model(inputs)
            reference = sequence_logps(reference, targets).view(-1, 2)
        return model(inputs), reference

    def loss_sum(self, outputs: Tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        logits, reference = outputs
        policy = sequence_logps(logits, targets.flatten(0, 1)).view(-1, 2)
        chosen, rejected = (self.beta * (policy[:, i] - reference[:, i]) for i in (0, 1))
        margin = chosen - rejected
        e = self.label_smoothing
        losses = -F.logsigmoid(margin) * (1 - e) - F.logsigmoid(-margin) * e
        values = (chosen, rejected, margin, (chosen > rejected).float(), policy[:, 0], policy[:, 1])
        self._sums = {name: value.detach().sum() for name, value in zip(METRICS, values)}
        return losses.sum()

    def __call__(self, outputs, targets, model, step: StepShare):
        """The share of the step's loss (as every objective's), and the pairs' metrics over the same
        units (the step's pairs per replica), so summed over micro-batches and averaged over DP
        they are the global batch's means."""
        total = super().__call__(outputs, targets, model, step)
        if step.tokens is not None:
            for name, value in self._sums.items():
                step.add(name, value / step.units)
        return total

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.shape[0], device=targets.device)

    def fixed_count(self, targets: torch.Tensor) -> int:
        return targets.shape[0]  # every pair counts

    def held_bytes(self) -> Dict[str, int]:
        """The reference's parameters (frozen_copy's; adapters_off holds none)."""
        from framework.training.memory import local_bytes

        model = self.reference_model
        return {"reference": sum(local_bytes(p) for p in model.parameters()) if model is not None else 0}

    def logged_terms(self, model: nn.Module) -> Dict[str, str]:
        return {**super().logged_terms(model), **{name: name for name in METRICS}}


def frozen_copy(run) -> nn.Module:
    """A second model from the policy's base (the seed, the Hugging Face files or
    checkpoint.init_from's weights, never a resumed policy's), through the same parallel stages
    (its TP plan, fsdp / hsdp), without adapters, frozen in eval mode: the module the loop would call."""
    from framework.checkpoint.compat import checkpoint_dir
    from framework.training.builder import build_and_run
    from framework.training.run import Run

    cfg = OmegaConf.merge(run.cfg, {"adapter": {"kind": "none", "init_from": None}})
    copy = Run(cfg=cfg, out_dir=run.out_dir, rank=run.rank, mesh=run.mesh, dp_cp_mesh=run.dp_cp_mesh, dp_cp=run.dp_cp,
               samples=run.samples, tp=run.tp)
    build_and_run(cfg, run.out_dir, start="model", through="fully_shard", run=copy)
    allocate(copy.module, cfg.mesh.device_type, cfg.trainer.seed)
    load_base(copy.module, base_checkpoint(cfg, checkpoint_dir(cfg, run.out_dir)), offered(copy.module).hf_path)
    for param in copy.module.parameters():
        param.requires_grad_(False)
    return copy.module.eval()


def reference_gone(path: str) -> ConfigError:
    return ConfigError("objective.reference", "precomputed", f"{path} is gone, and a resumed full-training run's "
                                                             f"model is no longer its reference; restore it, or use "
                                                             f"objective.reference=frozen_copy")


def check_reference_on_resume(c: Checked) -> None:
    """Before any rank starts: a full-training run resumed with checkpoint.resume cannot make its
    precomputed reference again (its model is no longer the one training started from), so each
    split's stored log-probabilities must still be there."""
    cfg, checkpoint_dir, model = c.cfg, c.checkpoint_dir, c.model
    from hydra.utils import instantiate

    from framework.checkpoint.base_model import base_model

    if cfg.objective.get("reference") != "precomputed" or cfg.adapter.kind != "none" or not cfg.checkpoint.resume \
            or checkpoint_dir is None:
        return
    base = base_model(cfg, checkpoint_dir, offered(model).hf_path)
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


def precomputed_reference(run, dataset) -> np.ndarray:
    """The split's (pairs, 2) reference log-probabilities: read if a run stored them, else made
    now by every rank (each DP replica its share of the pairs, gathered) and stored by rank 0."""
    from framework.checkpoint.base_model import base_model
    from framework.checkpoint.compat import checkpoint_dir

    base = base_model(run.cfg, checkpoint_dir(run.cfg, run.out_dir), offered(run.module).hf_path)
    path = reference_path(run.cfg, dataset, base)
    if not os.path.isfile(path):
        if run.resumed is not None and run.cfg.adapter.kind == "none":  # (an elastic restart's resume)
            raise reference_gone(path)
        values = _reference_logps(run, dataset)
        if run.rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with atomic_file(path, "wb") as f:
                np.save(f, values)
            log.info("objective.reference=precomputed: the reference log-probabilities of %d %s pairs, in %s",
                     len(values), dataset.split, path)
        dist.barrier()
    return np.load(path)


@torch.no_grad()
def _reference_logps(run, dataset) -> np.ndarray:
    """Pair i's log-probabilities under the model as training starts, adapters off, on replica
    i mod DP (its TP ranks together), in micro-batches; gathered over DP."""
    replicas, replica = run.samples["size"], run.samples["rank"]
    per_replica = -(-len(dataset) // replicas)
    mine = [min(replica + k * replicas, len(dataset) - 1) for k in range(per_replica)]  # (the last repeated)
    size = run.cfg.data.micro_batch_size or run.cfg.data.global_batch_size // replicas
    device = torch.device(run.cfg.mesh.device_type)
    bf16 = run.cfg.trainer.mixed_precision == "bf16" and run.cfg.parallel.dp_strategy == "replicate"
    values = []
    run.model.eval()
    with adapters_disabled(run.module), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        for start in range(0, len(mine), size):
            pairs = [dataset[i] for i in mine[start:start + size]]
            inputs = torch.stack([p[0] for p in pairs]).to(device).flatten(0, 1)
            targets = torch.stack([p[1] for p in pairs]).to(device).flatten(0, 1)
            values.append(sequence_logps(run.model(inputs), targets).view(-1, 2))
    run.model.train()
    local = torch.cat(values).double()
    gathered = [torch.empty_like(local) for _ in range(replicas)]
    if replicas > 1:
        dist.all_gather(gathered, local, group=run.dp_cp_group)
    else:
        gathered = [local]
    gathered = torch.stack(gathered)
    # pair replica + k * replicas is gathered[replica][k]
    return gathered.transpose(0, 1).reshape(-1, 2)[:len(dataset)].float().cpu().numpy()


def check_preference(c: Checked) -> None:
    """Before launch: DPO's data holds pairs, its reference exists, and its keys make sense; and
    pairs are trained by DPO alone."""
    cfg, roles = c.cfg, c.roles
    objective, dataset = cfg.objective, cfg.data.dataset
    pairs = kind_of(dataset) == "preference"
    dpo = objective.get("_target_") == f"{__name__}.DirectPreference"
    if pairs and not dpo:
        raise ConfigError("objective", objective.get("_target_"), "preference pairs (data=preferences) train under "
                                                                  "objective=dpo")
    if not dpo:
        return
    if not pairs:
        raise ConfigError("objective", "dpo", f"needs preference pairs, and data.dataset is "
                                              f"{dataset.get('_target_') if dataset else None}; prepare them with "
                                              f"framework.prepare --prompt-field --chosen-field --rejected-field "
                                              f"and use data=preferences")
    if objective.reference not in REFERENCES:
        raise ConfigError("objective.reference", objective.reference, f"use one of {', '.join(REFERENCES)}")
    if objective.reference == "adapters_off" and cfg.adapter.kind == "none":
        raise ConfigError("objective.reference", "adapters_off", "is the base model with the adapters off, and this "
                                                                 "run has none (adapter=none); use adapter=lora, or "
                                                                 "objective.reference=frozen_copy for full training")
    if not objective.beta > 0:
        raise ConfigError("objective.beta", objective.beta, "must be > 0")
    if not 0 <= objective.label_smoothing < 0.5:
        raise ConfigError("objective.label_smoothing", objective.label_smoothing, "must be in [0, 0.5)")
    if objective.reference == "precomputed" and not os.access(os.path.expanduser(dataset.path), os.W_OK):
        raise ConfigError("objective.reference", "precomputed", f"stores the log-probabilities beside the data, and "
                                                                f"{dataset.path} is not writable; make it so, or use "
                                                                f"adapters_off / frozen_copy")
    output = OmegaConf.to_container(cfg.plan, resolve=True).get("output") if cfg.plan else None
    if roles.tp_size > 1 and output and not final_output_layout(output)[1]:
        raise ConfigError("plan.output.use_local_output", False, "DPO sums each sequence's log-probabilities from "
                                                                 "whole logits, not vocabulary shards (loss_parallel); "
                                                                 "use a plan whose output is gathered, e.g. lm_tp_sp")
