"""optim=muon: Muon for the hidden matrices, AdamW for the rest, on any mesh.

The update is torch.optim.Muon's (Nesterov momentum, Newton-Schulz with its coefficients,
adjust_lr_fn original / match_rms_adamw, decoupled weight decay), each stacked expert weight
[E, out, in] taken as E matrices. torch's Muon takes plain 2-D tensors: on an FSDP2 DTensor
its Newton-Schulz gathers the matrix at every op. Here the momentum stays on each rank's shard
(elementwise), and each matrix is orthogonalized whole exactly once a step, on one owner rank
(framework.parallel.whole_on_owners: one all_to_all_single each way a bucket). Replicas outside
the DTensor mesh (parallel.dp_strategy=replicate) compute their own identical copy.

Which parameter gets what (`muon_split`): AdamW for embeddings, the output layer, routers,
LoRA's adapters (as the peers do: their A and B are thin, Muon's RMS matching is made for
full matrices) and anything 1-D (norms, biases); Muon for every other 2-D or 3-D weight;
`to_muon` / `to_adamw` name patterns move parameters either way. The AdamW side is
torch.optim.AdamW itself over its groups, sharing this optimizer's state, so one state_dict
(DCP's) holds both: momentum buffers and AdamW's moments reshard alike.
"""
import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from hydra.utils import get_class
from torch import nn

from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.adapter_names import is_adapter
from framework.models.protocol import offered
from framework.parallel.dtensors import by_mesh, is_dtensor, local_tensor
from framework.parallel.whole_on_owners import WholeOnOwners

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
ROUTER = re.compile(r"(^|[._])(gate|router)\.(weight|bias)$")  # a MoE's routing projection
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "auto": None}  # auto: bf16 on GPUs, else fp32
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}  # the rest's, unless optim.adamw says


def newton_schulz(matrix: torch.Tensor, steps: int, coefficients: Sequence[float], eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization, op for op, in `dtype` (torch's is bf16); a 3-D
    stack is orthogonalized matrix by matrix."""
    if matrix.ndim == 3:
        return torch.stack([newton_schulz(m, steps, coefficients, eps, dtype) for m in matrix])
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)  # divided in place: never the caller's tensor (a momentum buffer)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """torch.optim.Muon's per-matrix scaling of lr, of a matrix's (rows, columns)."""
    rows, columns = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr * math.sqrt(max(1, rows / columns))


def _adamw_role(name: str, param: nn.Parameter, embeddings: set, output: set) -> Optional[str]:
    """Why a parameter is AdamW's by default (None: a hidden matrix, Muon's)."""
    if is_adapter(name):
        return "adapters"
    if id(param) in embeddings:
        return "embeddings"
    if id(param) in output:
        return "output layer"
    if ROUTER.search(name):
        return "routers"
    if param.ndim < 2:
        return "norms and biases"
    return None


def muon_split(module: nn.Module, to_muon: Sequence[str] = (), to_adamw: Sequence[str] = ()
               ) -> Tuple[List[Tuple[str, nn.Parameter]], Dict[str, List[Tuple[str, nn.Parameter]]]]:
    """(Muon's parameters, AdamW's by why), names as module.named_parameters gives them; a
    pattern (re.search on the name) overrides the default, to_adamw before to_muon; one that
    selects nothing, or a shape Muon cannot take, is refused."""
    embeddings = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = offered(module).output_layer()
    output = {id(p) for p in head.parameters()} if head is not None else set()
    muon: List[Tuple[str, nn.Parameter]] = []
    adamw: Dict[str, List[Tuple[str, nn.Parameter]]] = {}
    used = set()
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        role = _adamw_role(name, param, embeddings, output)
        for key, patterns, forced in (("to_adamw", to_adamw, "named in optim.to_adamw"), ("to_muon", to_muon, None)):
            hit = next((p for p in patterns if re.search(p, name)), None)
            if hit is not None:
                used.add((key, hit))
                role = forced
                break
        if role is not None:
            adamw.setdefault(role, []).append((name, param))
        elif param.ndim in (2, 3) and min(param.shape) > 0:
            muon.append((name, param))
        else:
            hit = next(p for p in to_muon if re.search(p, name))
            raise ConfigError("optim.to_muon", list(to_muon), f"{hit!r} selects {name} of shape {list(param.shape)}; "
                                                              f"Muon takes 2-D matrices and 3-D stacks of them: leave "
                                                              f"it to AdamW")
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    for key, patterns in (("to_muon", to_muon), ("to_adamw", to_adamw)):
        for pattern in patterns:
            if (key, pattern) not in used:
                raise ConfigError(f"optim.{key}", list(patterns), f"{pattern!r} matches no trainable parameter's "
                                                                  f"name (re.search; they read like {names[-1]!r})")
    return muon, adamw


def check_muon(c: Checked) -> None:
    """optim=muon's split of the meta model: each pattern selects a parameter, and what it moves
    to Muon is a matrix (before launch)."""
    options = c.cfg.optim
    if c.model is not None and hasattr(get_class(options._target_), "groups_of"):
        muon_split(c.model, list(options.get("to_muon") or ()), list(options.get("to_adamw") or ()))


def describe_split(muon: List[Tuple[str, nn.Parameter]], adamw: Dict[str, List[Tuple[str, nn.Parameter]]]) -> str:
    """The line printed at start: how many tensors and parameters each side has, and why."""
    def count(pairs):
        return f"{len(pairs)} tensors, {sum(p.numel() for _, p in pairs):,} parameters"
    rest = "; ".join(f"{why} {count(pairs)}" for why, pairs in adamw.items())
    return f"optim=muon: Muon for the hidden matrices ({count(muon)}); AdamW for {rest or 'nothing'}"


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `muon`, torch.optim.AdamW for the others (see the module).
    `adamw`'s lr / betas / eps / weight_decay and the to_muon / to_adamw patterns make the
    groups (`groups_of`, which the builder calls with the same options); `adamw`'s fused /
    foreach are the AdamW side's kernel choice."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, ns_steps: int = 5, ns_coefficients: Sequence[float] = COEFFICIENTS,
                 eps: float = 1e-7, adjust_lr_fn: str = "original", ns_dtype: str = "auto",
                 bucket_mb: float = 64, adamw: Optional[Dict[str, Any]] = None,
                 to_muon: Sequence[str] = (), to_adamw: Sequence[str] = ()):
        _check_options(lr, momentum, weight_decay, ns_steps, ns_coefficients, adjust_lr_fn, ns_dtype, bucket_mb,
                       adamw or {})
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay,
                                  "ns_steps": ns_steps, "ns_coefficients": tuple(ns_coefficients), "eps": eps,
                                  "adjust_lr_fn": adjust_lr_fn, "muon": True})
        self.ns_dtype, self.bucket_bytes = DTYPES[ns_dtype], int(bucket_mb * 2 ** 20)
        self.adamw_options = {k: v for k, v in (adamw or {}).items() if k in ("fused", "foreach")}
        self._adamw: Optional[torch.optim.AdamW] = None
        self._layout: Optional[WholeOnOwners] = None
        self._link()

    @staticmethod
    def groups_of(module: nn.Module, adamw: Optional[Dict[str, Any]] = None, to_muon: Sequence[str] = (),
                  to_adamw: Sequence[str] = (), **_: Any) -> Tuple[List[Dict[str, Any]], str]:
        """The parameter groups of `module` (one Muon group, an AdamW group per mesh with
        optim.adamw's lr / betas / eps / weight_decay), and the line that says the split."""
        muon, by_role = muon_split(module, to_muon, to_adamw)
        options = {k: (tuple(v) if k == "betas" else v) for k, v in {**ADAMW, **(adamw or {})}.items()
                   if k in ADAMW}
        rest = [p for pairs in by_role.values() for _, p in pairs]
        groups = [{"params": [p for _, p in muon], "muon": True}] if muon else []
        groups += [{"params": kind, "muon": False, **options} for kind in by_mesh(rest)]
        return groups, describe_split(muon, by_role)

    def _link(self) -> None:
        """AdamW's groups and state are this optimizer's own (again after load_state_dict)."""
        groups = [g for g in self.param_groups if not g["muon"]]
        if groups and self._adamw is None:
            self._adamw = torch.optim.AdamW(groups, **self.adamw_options)
        if self._adamw is not None:
            self._adamw.param_groups, self._adamw.state = groups, self.state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon takes no closure")
        if self._adamw is not None:
            self._adamw.step()
        groups = [g for g in self.param_groups if g["muon"]]
        params = [(p, g) for g in groups for p in g["params"]]
        if not params:
            return None
        if self._layout is None:  # collective: at the first step, on every rank at once
            self._layout = WholeOnOwners([p for p, _ in params], _flat_group, self.bucket_bytes)
            if self.ns_dtype is None:  # a CPU's bf16 matmul is no faster than fp32 and much slower on most
                self.ns_dtype = torch.bfloat16 if params[0][0].device.type == "cuda" else torch.float32
        directions = [self._direction(p, g) for p, g in params]
        first = groups[0]
        updates = self._layout.apply(directions, lambda whole: newton_schulz(
            whole, first["ns_steps"], first["ns_coefficients"], first["eps"], self.ns_dtype), self.ns_dtype)
        for (p, g), update in zip(params, updates):
            if p.grad is None:
                continue
            lr = g["lr"]
            local = local_tensor(p)
            local.mul_(1 - lr * g["weight_decay"])
            local.add_(update, alpha=-adjusted_lr(lr, g["adjust_lr_fn"], p.shape))
        return None

    def _direction(self, p: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
        """This rank's part of the momentum-smoothed gradient Newton-Schulz takes (zeros for a
        parameter without a gradient this step: the exchange is collective)."""
        if p.grad is None:
            return torch.zeros_like(local_tensor(p))
        grad = p.grad
        if is_dtensor(grad) and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        grad, buf, momentum = local_tensor(grad), local_tensor(state["momentum_buffer"]), group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _flat_group(mesh):
    """The process group over all of a DTensor mesh's ranks (DeviceMesh._flatten, as
    framework.parallel.roles flattens DP dims)."""
    return (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()


def _check_options(lr, momentum, weight_decay, ns_steps, ns_coefficients, adjust_lr_fn, ns_dtype, bucket_mb,
                   adamw) -> None:
    """torch.optim.Muon's refusals, and this optimizer's own (ValueError, before any parameter)."""
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, not {lr}")
    if not momentum >= 0:
        raise ValueError(f"momentum must be >= 0, not {momentum}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, not {weight_decay}")
    if not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be a whole number from 1 to 99, not {ns_steps}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three numbers (a, b, c), not {list(ns_coefficients)}")
    if adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ValueError(f"adjust_lr_fn must be original or match_rms_adamw, not {adjust_lr_fn}")
    if ns_dtype not in DTYPES:
        raise ValueError(f"ns_dtype must be one of {', '.join(DTYPES)}, not {ns_dtype}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, not {bucket_mb}")
    unknown = set(adamw) - {"lr", "betas", "eps", "weight_decay", "fused", "foreach"}
    if unknown:
        raise ValueError(f"adamw takes lr, betas, eps, weight_decay, fused, foreach; not {sorted(unknown)}")
    try:
        torch.optim.AdamW([torch.zeros(1)], **{k: (tuple(v) if k == "betas" else v) for k, v in adamw.items()
                                              if k != "fused"})
    except ValueError as error:
        raise ValueError(f"adamw: {error}") from None
