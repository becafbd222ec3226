"""The framework's own Transformer's starting weights, declared once (torchtitan's llama3 and
deepseek_v3 `param_init`): every matrix truncated normal of std 0.02, those that write into
the residual stream (wo, w2, w3) and the router scaled by the depth of their block, the
embedding of std 1, norms one, biases zero. The output projection: truncated normal cut at 3
std, of std 0.5 * dim**-0.5 where torchtitan draws dim**-0.5. The final norm makes every
hidden state of rms 1, so logits start with the std of that draw times sqrt(dim), and the first
loss at about ln V + std**2 / 2: torchtitan's logit std of 1 starts at ln V + 0.5 (measured
9.56 for ln V = 9.01 at dim 2048), ours of 0.5 at ln V + 0.13.

Tied, the embedding is the output projection and keeps its draw (torchtitan skips the
embedding's init when tied): drawn N(0, 1) it made logits of std ~sqrt(dim), a first loss of
1,868 for a Llama-3.2-1B shape (ln V = 11.76).

A model is built on the meta device and drawn after the parallel stages sharded it (torchtitan's
init_weights after to_empty): each parameter from a generator of its own (the run's seed and the
parameter's name), drawn whole and cut to this rank's part, so every mesh and plan starts from
the weights one process draws and no rank ever holds the model whole.
"""
import zlib

import torch
from torch import nn

from framework.models.adapter_names import is_adapter
from framework.parallel.dtensors import local_tensor, place_whole

BASE_STD = 0.02
LOGIT_STD = 0.5  # the logits' std at the start (see above)
# A block's matrices drawn with the depth-scaled std (named by the last part of their name).
DEPTH_SCALED = ("wo", "w2", "w3", "gate")


def depth_scaled_std(layer: int) -> float:
    """torchtitan's depth_scaled_std: block `layer`'s (0-based) writers into the residual stream
    get smaller weights the deeper they are, so the stream's variance grows slowly with depth."""
    return BASE_STD / (2 * (layer + 1)) ** 0.5


def _kind(name: str) -> str:
    """The module a parameter belongs to: `feed_forward.experts.w2` -> w2, `attention.wo.weight` -> wo."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


def parameter_generator(seed: int, name: str, device) -> torch.Generator:
    """The generator a parameter (or an adapter) is drawn from: seeded by the run's seed and its
    own name, so its draw does not depend on what else a rank holds or in which order."""
    return torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))


def _draw(whole: torch.Tensor, name: str, dim: int, generator: torch.Generator) -> None:
    """Parameter `name`'s declared starting value, drawn whole into `whole`."""
    kind = _kind(name)
    if name == "output.weight":
        std = LOGIT_STD * dim ** -0.5
        nn.init.trunc_normal_(whole, std=std, a=-3 * std, b=3 * std, generator=generator)
    elif name == "tok_embeddings.weight":
        nn.init.normal_(whole, std=1.0, generator=generator)
    elif name.endswith("bias"):
        nn.init.zeros_(whole)
    elif kind.endswith("norm"):
        nn.init.ones_(whole)
    else:  # a block's matrix: layers.<index>. ...
        std = depth_scaled_std(int(name.split(".")[1])) if kind in DEPTH_SCALED else BASE_STD
        nn.init.trunc_normal_(whole, std=std, generator=generator)


@torch.no_grad()
def init_transformer(model: nn.Module, seed: int) -> None:
    """Every parameter of a framework.models.Transformer this rank holds, each drawn whole on
    its device from parameter_generator and this rank's part kept (framework.parallel.dtensors.
    place_whole): a shard of FSDP2, TP or EP, or a pipeline stage's own blocks, holds what one
    process draws, and no rank holds more than one whole parameter beside its own. Tied, the
    embedding is the output projection and is drawn as it. Buffers (the experts' bias) zero;
    LoRA's adapters are framework.models.lora.init_adapters' to draw."""
    for name, param in model.named_parameters():
        if is_adapter(name) or param.is_meta:
            continue
        name = "output.weight" if model.tie_word_embeddings and name == "tok_embeddings.weight" else name
        whole = torch.empty(param.shape, dtype=param.dtype, device=local_tensor(param).device)
        _draw(whole, name, model.dim, parameter_generator(seed, name, whole.device))
        place_whole(param, whole)
    for buffer in model.buffers():
        buffer.zero_()
