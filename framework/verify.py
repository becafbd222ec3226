"""`python -m framework.verify [overrides]`: prove a mesh and plan train the model one process
would, and name the first module that does not.

Takes the same config as framework.train (recipe, mesh, plan, model). Runs verify.steps steps
twice from the same seeded weights and global batches: on the configured mesh, and in this one
process without DP or TP roles (the plan is not applied). It compares, per step, the
global loss, every parameter's full gradient (DTensors gathered; before clipping, which would
spread one wrong gradient over all) and every parameter after the optimizer step; for step 1 also every module's input and output (DP replica 0's share of the
global batch; TP shards reassembled; under pipeline parallelism the last micro-batch's, on the
ranks of the module's stage). The culprit is the first module, in the order modules
finish, whose input matches one process and whose output does not, named with the plan entry
that covers it; for gradients, the first parameter whose gradient differs although its module's
forward matched. Exit 0: everything within verify.rtol / verify.atol; 1: not; 2: a config error.
"""
import json
import math
import sys
import tempfile
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.tensor import DTensor, Placement

from framework.data.batch import Batch
from framework.data.loader import DataPosition, batches
from framework.cli import command_status, compose_config
from framework.config.errors import ConfigError
from framework.validate import check_model_and_plan, validate
from framework.launch.handoff import rank_config
from framework.launch.local import spawn_ranks
from framework.models.moe import Experts
from framework.parallel.context_parallel import chunk_indices
from framework.parallel.mesh import coordinates_on
from framework.parallel.plan import matching_modules
from framework.parallel.roles import MeshRoles
from framework.training.builder import build_and_run
from framework.training.run import Run
from framework.training.trainer import Trainer, local_value, mean_over_dp

USAGE = ("usage: python -m framework.verify [hydra overrides, e.g. recipe=lm_2d model=lm_tiny mesh=1x2]\n"
         "exit 0: the configured run matches one process; 1: it does not; 2: a config error")
Piece = Tuple[torch.Tensor, Optional[Placement]]  # a rank's local tensor and its DTensor placement, if any


def _piece(value: Any) -> Optional[Piece]:
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    if isinstance(value, DTensor):
        return value.to_local().detach().clone(), value.placements[0]
    return (value.detach().clone(), None) if isinstance(value, torch.Tensor) else None


def _keep_input(record: Dict[str, Piece], name: str, module, args) -> None:
    """The last call in step 1 (the hooks go after it): a pipeline stage's first calls infer
    shapes on buffers not yet received, its last is the last micro-batch."""
    record[name] = _piece(args)


def _keep_output(record: Dict[str, Piece], name: str, module, args, output) -> None:
    record[name] = _piece(output)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: DTensors are gathered (a collective every rank runs in the same order)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def build_one_process(cfg: DictConfig, out_dir: str) -> Run:
    """The reference run in this process, with no process group: no DP or TP roles, so the DP
    wrapper syncs nothing, the plan is not applied and nothing is sharded; the same seeded model,
    data and optimizer."""
    cfg.parallel.dp_dim = cfg.parallel.tp_dim = cfg.parallel.pp_dim = cfg.parallel.cp_dim = cfg.parallel.ep_dims = None
    cfg.parallel.dp_strategy = "replicate"
    one = {"size": 1, "rank": 0}
    run = Run(cfg=cfg, out_dir=out_dir, dp_cp=one, samples=one, tp=one)
    return build_and_run(cfg, out_dir, start="model", through="optimizer", run=run)


def record_steps(cfg_container: dict, out_dir: str, one_process: bool = False) -> dict:
    """Runs in every rank (or, for the reference, in this process): build up to the optimizer,
    train verify.steps steps, and return the module inputs and outputs of step 1 (ranks of DP
    replica 0; under PP, of its last micro-batch) and, on the first rank of each pipeline stage
    (rank 0 without PP), each step's global loss, full gradients and full parameters after the
    optimizer step (of the modules it holds)."""
    cfg = OmegaConf.create(cfg_container)
    cfg.data.micro_batch_size = None  # one forward per step for the hooks; accumulation sums the same gradients
    run = build_one_process(cfg, out_dir) if one_process else build_and_run(cfg, out_dir, through="optimizer")
    model = run.module
    inputs_seen: Dict[str, Piece] = {}
    outputs_seen: Dict[str, Piece] = {}
    order: List[str] = []
    hooks = []
    for name, module in model.named_modules():
        # its inputs are the token slots routed to this rank's experts, which depend on the layout:
        # their parameters and gradients are compared, and the MoE block's input and output
        if isinstance(module, Experts):
            continue
        # prepend: the input as it arrives, before a plan's PrepareModuleInput redistributes it
        hooks.append(module.register_forward_pre_hook(partial(_keep_input, inputs_seen, name), prepend=True))
        hooks.append(module.register_forward_hook(partial(_keep_output, outputs_seen, name)))
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: order.append(name)))
    data = batches(run.sampler, run.dataloader, DataPosition(), cfg.data.global_batch_size)
    trainer = Trainer(run)
    steps = []
    for step in range(cfg.verify.steps):
        batch = Batch.of(next(data), "cpu")
        grads: Dict[str, torch.Tensor] = {}
        # before clipping: one wrong gradient changes the global norm, and so every clipped one
        loss, _ = trainer.train_step(batch, measure_norm=False, on_gradients=lambda: grads.update(
            {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}))
        if step == 0:
            for hook in hooks:
                hook.remove()
        params = {name: _full(p) for name, p in model.named_parameters()}
        global_loss = mean_over_dp(run, local_value(loss).reshape(1))[0]
        if run.dp_cp.get("rank", 0) == 0 and run.tp.get("rank", 0) == 0:
            steps.append({"loss": global_loss, "grads": grads, "params": params})
    cp = coordinates_on(run.roles.cp_mesh(run.mesh))
    if dist.is_initialized():
        dist.destroy_process_group()
    first_replica = run.samples["rank"] == 0  # (its CP ranks hold chunks of the same rows)
    return {"tp_rank": run.tp["rank"], "dp_size": run.samples["size"], "cp_rank": cp["rank"], "cp_size": cp["size"],
            "order": order, "steps": steps,
            "pipelined": trainer.pipeline is not None, "microbatches": trainer.microbatches if trainer.pipeline else 1,
            "inputs": inputs_seen if first_replica else {}, "outputs": outputs_seen if first_replica else {}}


def assemble(pieces: List[Optional[Piece]], like: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole tensor from the TP ranks' pieces (in TP rank order): by the DTensor placement,
    or, for a plain local tensor, along the one dim whose size differs from `like`."""
    if any(p is None for p in pieces):
        return None
    local, placement = pieces[0]
    if placement is not None and placement.is_shard():
        return torch.cat([p for p, _ in pieces], dim=placement.dim)
    if placement is not None and placement.is_partial():
        return sum(p for p, _ in pieces)
    if placement is not None or local.shape == like.shape:
        return local
    differing = [d for d in range(min(local.dim(), like.dim())) if local.shape[d] != like.shape[d]]
    return torch.cat([p for p, _ in pieces], dim=differing[0]) if len(differing) == 1 else local


def assemble_sequence(holders: List[dict], key: str, name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
    """A module's whole input or output from the ranks holding it: TP pieces assembled per CP
    rank, then (under context parallelism) each CP rank's chunks put back in their places in
    the sequence (dim 1)."""
    cp = holders[0]["cp_size"]
    by_tp = lambda records: [r[key][name] for r in sorted(records, key=lambda r: r["tp_rank"])]  # noqa: E731
    if cp == 1:
        return assemble(by_tp(holders), like)
    whole = None
    for rank in range(cp):
        index = chunk_indices(like.shape[1], rank, cp)
        part = assemble(by_tp([r for r in holders if r["cp_rank"] == rank]), like[:, index])
        if part is None:
            return None
        whole = part.new_empty(like.shape) if whole is None else whole
        whole[:, index] = part
    return whole


def compare(name: str, what: str, value: Optional[torch.Tensor], reference: torch.Tensor, rtol: float,
            atol: float) -> dict:
    """One table row: max abs error, max error relative to the reference's largest magnitude,
    and ok when every element is within atol + rtol * |reference| (torch.allclose)."""
    if value is None or value.shape != reference.shape:
        shape = None if value is None else list(value.shape)
        return {"name": name, "what": what, "abs": math.inf, "rel": math.inf, "ok": False,
                "note": f"shape {shape} vs {list(reference.shape)}"}
    value, reference = value.double(), reference.double()
    abs_error = (value - reference).abs().max().item() if value.numel() else 0.0
    scale = reference.abs().max().item() if reference.numel() else 0.0
    return {"name": name, "what": what, "abs": abs_error, "rel": abs_error / scale if scale else abs_error,
            "ok": bool(torch.allclose(value, reference, rtol=rtol, atol=atol)), "note": ""}


def plan_entry_for(module_name: str, plan: dict, model: nn.Module) -> str:
    """The plan entry that covers a module (it or its nearest ancestor matches the pattern)."""
    parts = module_name.split(".") if module_name else []
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        for pattern, entry in plan.items():
            if prefix in matching_modules(model, pattern) and (prefix or pattern == "."):
                return f"plan entry {pattern}: {entry['style']}"
    return "not in the plan"


def verify_rows(mesh_records: Dict[int, dict], reference: dict, rtol: float, atol: float) -> List[dict]:
    first_replica = [r for _, r in sorted(mesh_records.items()) if r["inputs"]]
    dp, micro = first_replica[0]["dp_size"], first_replica[0]["microbatches"]
    rows = []
    for name in reference["order"]:
        if name == "" and first_replica[0]["pipelined"]:
            continue  # the stages run in place of the model's own forward; each module is compared
        for what, key in (("input", "inputs"), ("output", "outputs")):
            ref_piece = reference[key].get(name)
            if ref_piece is None:
                continue
            # DP replica 0 holds rows 0, dp, 2dp... of the global batch; a pipeline's hooks saw its last micro-batch
            like = ref_piece[0][0::dp]
            like = like[len(like) - len(like) // micro:]
            holders = [r for r in first_replica if name in r[key]]  # under PP, the ranks of the module's stage
            rows.append(compare(name, what, assemble_sequence(holders, key, name, like) if holders else None,
                                like, rtol, atol))
    ours = _merged_steps(mesh_records)
    for step, (mine, theirs) in enumerate(zip(ours, reference["steps"]), start=1):
        rows.append(compare(f"step {step}", "loss", torch.tensor(mine["loss"]), torch.tensor(theirs["loss"]), rtol, atol))
        for what in ("grads", "params"):
            for name, ref in theirs[what].items():
                rows.append(compare(name, f"{what[:-1]} step {step}", mine[what].get(name), ref, rtol, atol))
    return rows


def _merged_steps(mesh_records: Dict[int, dict]) -> List[dict]:
    """Each step's loss and every parameter's gradient and value, from the ranks that returned
    them (one per pipeline stage; rank 0 alone without PP)."""
    holders = [r["steps"] for _, r in sorted(mesh_records.items()) if r["steps"]]
    return [{"loss": steps[0]["loss"],
             "grads": {k: v for stage in steps for k, v in stage["grads"].items()},
             "params": {k: v for stage in steps for k, v in stage["params"].items()}}
            for steps in zip(*holders)]


def culprits(rows: List[dict], cfg: DictConfig, model: nn.Module) -> List[str]:
    """What to look at first: the module whose input matches but output does not, and the first
    parameter whose gradient differs although its module's forward matched."""
    plan = OmegaConf.to_container(cfg.plan, resolve=True)
    forward = {}
    for row in rows:
        if row["what"] in ("input", "output"):
            forward.setdefault(row["name"], {})[row["what"]] = row["ok"]
    module = next((name for name, ok in forward.items() if ok.get("input", True) and not ok.get("output", True)), None)
    if module is not None:  # every gradient before it differs too: the forward is the place to look
        return [f"first module whose output differs from one process with a matching input: "
                f"{module or '(the model)'} ({plan_entry_for(module, plan, model)})"]
    found = []
    for row in rows:
        if row["what"].startswith("grad") and not row["ok"]:
            owner = row["name"].rsplit(".", 1)[0] if "." in row["name"] else ""
            if forward.get(owner, {}).get("output", True):
                found.append(f"first parameter whose gradient differs although its module's forward matched: "
                             f"{row['name']} ({plan_entry_for(owner, plan, model)})")
                break
    return found


def table(rows: List[dict]) -> str:
    lines = ["| what | name | max abs error | max rel error | |", "|---|---|---|---|---|"]
    for row in rows:
        status = "ok" if row["ok"] else f"FAIL {row['note']}".strip()
        lines.append(f"| {row['what']} | {row['name'] or '(the model)'} | {row['abs']:.3g} | {row['rel']:.3g} | {status} |")
    return "\n".join(lines)


def verify(cfg: DictConfig) -> Tuple[bool, str, List[dict]]:
    """Both runs, the comparison table's rows and the verdict line; writes verify.report."""
    validate(cfg)
    if cfg.verify.steps < 1:
        raise ConfigError("verify.steps", cfg.verify.steps, "must be >= 1")
    if MeshRoles.from_config(cfg).cp_size > 1 and cfg.model.get("moe"):
        raise ConfigError("parallel.cp_dim", cfg.parallel.cp_dim,
                          "verify puts each CP rank's chunks of a module's input and output back in sequence "
                          "order, and a mixture of experts' routing sees its tokens flattened (not supported "
                          "yet); verify the mesh without its cp dim (tests/test_long_context.py proves the parity)")
    if cfg.trainer.mixed_precision is not None and cfg.parallel.dp_strategy != "replicate":
        raise ConfigError("trainer.mixed_precision", cfg.trainer.mixed_precision,
                          "verify's one-process reference casts with torch.autocast, and parallel.dp_strategy "
                          "fsdp / hsdp with FSDP2's MixedPrecisionPolicy (every op in bf16), so their modules "
                          "would differ with no bug behind it; verify the plan with trainer.mixed_precision=null")
    with tempfile.TemporaryDirectory(prefix="framework-verify-") as out_dir:
        mesh_records = spawn_ranks(math.prod(cfg.mesh.shape), record_steps, rank_config(cfg), out_dir)
        reference = record_steps(rank_config(cfg), out_dir, one_process=True)
    rows = verify_rows(mesh_records, reference, cfg.verify.rtol, cfg.verify.atol)
    failed = [row for row in rows if not row["ok"]]
    where = f"mesh {'x'.join(map(str, cfg.mesh.shape))}, {cfg.verify.steps} steps, rtol={cfg.verify.rtol} " \
            f"atol={cfg.verify.atol}"
    if not failed:
        verdict = f"verify: OK: the configured run matches one process ({where}; {len(rows)} comparisons)"
    else:
        model = check_model_and_plan(cfg)
        hints = "; ".join(culprits(rows, cfg, model)) or f"first difference: {failed[0]['what']} {failed[0]['name']}"
        verdict = f"verify: FAIL: {len(failed)} of {len(rows)} comparisons differ from one process ({where}); {hints}"
    if cfg.verify.report:
        with open(cfg.verify.report, "w") as f:
            f.write(f"{table(rows)}\n\n{verdict}\n")
        with open(f"{cfg.verify.report}.json", "w") as f:
            json.dump({"verdict": verdict, "ok": not failed, "rows": rows}, f, indent=1)
    return not failed, verdict, rows


def main(argv: List[str]) -> int:
    def report() -> int:
        ok, verdict, rows = verify(compose_config(argv))
        print(table(rows))
        print(verdict)
        return 0 if ok else 1

    return command_status(report, "verify failed to run", argv, USAGE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
