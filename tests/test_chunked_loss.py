"""trainer.loss_chunk_tokens (framework.training.objectives.chunked_loss): the loss by chunks of tokens
against the whole logits' (losses, gradients of the hidden states, the output weight and the
whole model, after a step), for the LM, DPO and GRPO objectives, under TP's loss_parallel, and
that no [tokens, vocab] tensor is ever made."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from framework.config.errors import ConfigError
from framework.validate import validate
from framework.data.batch import Batch
from framework.data.batch import IGNORE
from framework.launch.local import spawn_ranks
from framework.models import Transformer
from framework.training.objectives.chunked_loss import fused
from framework.training.objectives.grpo import GroupRelativePolicy
from framework.parallel.device import resolve_device
from framework.training.objectives.context import ObjectiveContext
from framework.training.objectives.head import OutputHead, output_head
from framework.training.objectives.lm import NextTokenCrossEntropy
from framework.training.objectives.preference import DirectPreference
from tests.conftest import QUIET, TINY_LM, compose_config

# Measured here (fp32, CPU, torch 2.13): the chunks' largest difference from the whole logits'
# was 9.5e-7 on a loss (DPO's 1.84, a log-probability of 8.8), 2.9e-6 on a gradient element
# (of a weight gradient up to 13.7), 2.4e-7 on a weight after the step; bounds >= 10x that.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=3e-5)


def tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Targets with every seventh one -100 (not counted)."""
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    targets[::7] = IGNORE
    return targets


def leaves(n: int, dim: int, vocab: int):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, dim, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=generator) / math.sqrt(dim)).requires_grad_()
    return hidden, weight


def test_the_fused_cross_entropy_sum_and_its_gradients_are_the_whole_logits_ones():
    hidden, weight = leaves(100, 24, 500)
    targets = tokens(100, 500)
    whole = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE, reduction="sum")
    chunked = fused(hidden, weight, targets, 16, per_token=False)
    torch.testing.assert_close(chunked, whole, **LOSS_TOL)
    for a, b in zip(torch.autograd.grad(2.5 * chunked, (hidden, weight)),
                    torch.autograd.grad(2.5 * whole, (hidden, weight))):
        torch.testing.assert_close(a, b, **GRAD_TOL)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(fused(hidden, weight, targets, 16, per_token=False), whole.detach(), **LOSS_TOL)


def test_the_fused_token_logps_and_their_gradients_are_the_whole_logits_ones():
    hidden, weight = leaves(100, 24, 500)
    targets = tokens(100, 500)
    upstream = torch.randn(100, generator=torch.Generator().manual_seed(2))  # a nonlinear loss's per-token gradient
    whole = -F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE, reduction="none")
    chunked = fused(hidden, weight, targets, 16, per_token=True)
    torch.testing.assert_close(chunked, whole, **LOSS_TOL)
    assert (chunked[targets == IGNORE] == 0).all()
    for a, b in zip(torch.autograd.grad(chunked, (hidden, weight), upstream),
                    torch.autograd.grad(whole, (hidden, weight), upstream)):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def lm(seed: int = 0, vocab: int = 300) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64)


def step_grads_and_weights(objective, chunk: int, batch: Batch, select: bool):
    """One step of an LM on `batch` under `objective` with chunks of `chunk` tokens (0: whole
    logits), at the counted targets alone with `select`: the loss, every parameter's gradient,
    the parameters after an SGD step (AdamW's first step, lr x sign(gradient), flips on
    gradients near 0)."""
    model = lm()
    objective.head = OutputHead(model.output, select=select, chunk=chunk)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = objective.loss_sum(objective.forward(model, batch), batch.targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()
    return loss.detach(), grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_step(objective, batch: Batch, chunk: int = 8, select: bool = False) -> None:
    loss, grads, weights = step_grads_and_weights(objective, chunk, batch, select)
    whole_loss, whole_grads, whole_weights = step_grads_and_weights(objective, 0, batch, select)
    torch.testing.assert_close(loss, whole_loss, **LOSS_TOL)
    for name in whole_grads:
        torch.testing.assert_close(grads[name], whole_grads[name], **GRAD_TOL, msg=name)
        torch.testing.assert_close(weights[name], whole_weights[name], **GRAD_TOL, msg=name)


def test_the_lm_objective_by_chunks_trains_the_model_the_whole_logits_train():
    inputs = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(3))
    targets = tokens(60, 300).view(3, 20)  # masked, as instruction data's
    assert_same_step(NextTokenCrossEntropy(), Batch(inputs, targets))


def preference_pairs(pairs: int = 2, seq: int = 16) -> Batch:
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randint(0, 300, (pairs, 2, seq), generator=generator)
    targets = inputs.clone()
    targets[..., :seq // 2] = IGNORE  # the prompt's positions
    return Batch(inputs, targets, reference=torch.randn(pairs, 2, generator=generator) - 40)


@pytest.mark.parametrize("select", [False, True])
def test_dpo_by_chunks_trains_the_model_the_whole_logits_train(select):
    dpo = DirectPreference(beta=0.5, reference="precomputed")
    assert_same_step(dpo, preference_pairs(), select=select)


def test_grpo_by_chunks_trains_the_model_the_whole_logits_train():
    grpo = GroupRelativePolicy(group_size=2, beta=0.1, reference="frozen_copy")
    assert_same_step(grpo, grpo_batch(preference_pairs()), select=True)  # 2 prompts x a group of 2 completions


class LargestVocabularyTensor(TorchDispatchMode):
    """The largest tensor any op makes with a `vocab`-long dimension, other than the output
    weight's own shape (its gradient, its transpose, the embedding's)."""

    def __init__(self, vocab: int, weight_shape):
        super().__init__()
        self.vocab, self.weight_shape, self.largest = vocab, tuple(weight_shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.vocab in t.shape and sorted(t.shape) != sorted(self.weight_shape):
                self.largest = max(self.largest, t.numel())
        return out


def grpo_batch(pairs: Batch) -> Batch:
    """`pairs` as GRPO's batch: each pair a prompt's group of 2 completions, with advantages."""
    generator = torch.Generator().manual_seed(5)
    return Batch(pairs.inputs, pairs.targets, reference=torch.randn(*pairs.inputs.shape, generator=generator) - 5,
                 advantages=torch.randn(pairs.inputs.shape[:2], generator=generator))


@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])
def test_no_forward_or_backward_by_chunks_makes_a_tokens_by_vocabulary_tensor(objective):
    vocab, chunk = 1000, 16
    batch = preference_pairs(pairs=4, seq=32)  # 256 tokens
    if objective == "lm":
        scored, batch = NextTokenCrossEntropy(), Batch(batch.inputs.flatten(0, 1), batch.inputs.flatten(0, 1))
    elif objective == "dpo":
        scored = DirectPreference(reference="precomputed")
    else:  # (a GRPO forward that took whole logits would make 256 x 1000)
        scored, batch = GroupRelativePolicy(group_size=2, beta=0.1, reference="frozen_copy"), grpo_batch(batch)
    largest = {}
    for size in (chunk, 0):
        model = lm(vocab=vocab)
        scored.head = OutputHead(model.output, chunk=size)
        with LargestVocabularyTensor(vocab, model.output.weight.shape) as seen:
            scored.loss_sum(scored.forward(model, batch), batch.targets).backward()
        largest[size] = seen.largest
    assert largest[chunk] <= chunk * vocab
    assert largest[0] >= batch.targets.numel() * vocab  # (what the test would see of whole logits)


class HeldVocabularyTensors(torch.autograd.graph.saved_tensors_hooks):
    """What autograd keeps for backward of the tensors with a `vocab`-long dimension (DTensors by
    their global shape), each storage once, in elements: all of it is held from the forward to
    the backward (torch.utils.checkpoint's own hooks, inside these, keep its chunks' out of it)."""

    def __init__(self, vocab: int, weight_shape):
        self.vocab, self.weight_shape, self.storages = vocab, tuple(weight_shape), {}
        super().__init__(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.vocab in t.shape and sorted(t.shape) != sorted(self.weight_shape):
            local = t._local_tensor if isinstance(t, DTensor) else t
            self.storages[local.untyped_storage().data_ptr()] = t.numel()
        return t

    @property
    def held(self) -> int:
        return sum(self.storages.values())


def one_step(cfg_container: dict, out_dir: str) -> dict:
    """In each rank: the Trainer's forward and backward of the first global batch, the objective
    set up (trainer.loss_chunk_tokens); the global loss, the full gradients, the largest tensor
    of the vocabulary's length made and what of that length was kept for backward."""
    import torch.distributed as dist

    from framework.training.builder import build_and_run
    from framework.training.trainer import Trainer, local_value, mean_over_dp

    run = build_and_run(OmegaConf.create(cfg_container), out_dir, through="objective")
    batch = Batch.of(next(iter(run.dataloader)), "cpu")
    vocab = cfg_container["model"]["vocab_size"]
    kept = HeldVocabularyTensors(vocab, (1, 1))  # (its __enter__ returns None)
    with LargestVocabularyTensor(vocab, (1, 1)) as seen, kept:
        loss = Trainer(run).forward_backward(batch)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in run.module.named_parameters()}
    result = {"loss": mean_over_dp(run, local_value(loss).reshape(1))[0], "grads": grads, "largest": seen.largest,
              "held": kept.held}
    dist.destroy_process_group()
    return result


def test_under_tp_loss_parallel_the_chunks_train_the_model_one_process_trains(tmp_path):
    """lm_tp_sp_loss_parallel on 1x2: the output layer vocabulary-sharded, its logits scored under
    loss_parallel by chunks of rows (each recomputed in backward), against one process."""
    base = [*TINY_LM, *QUIET, "mesh.device_type=cpu", "model.vocab_size=384"]  # 8 x 32 tokens (bytes)
    results = {}
    for name, extra in {"1x1 whole": ["mesh=1x1", "trainer.loss_chunk_tokens=0"],
                        "1x2 chunks": ["mesh=1x2", "plan=lm_tp_sp_loss_parallel", "trainer.loss_chunk_tokens=64"],
                        "1x1 chunks": ["mesh=1x1", "trainer.loss_chunk_tokens=48"]}.items():
        cfg = OmegaConf.to_container(compose_config([*base, *extra]), resolve=True)
        results[name] = spawn_ranks(math.prod(cfg["mesh"]["shape"]), one_step, cfg, str(tmp_path / name))[0]
    reference = results["1x1 whole"]
    assert reference["largest"] >= 256 * 384 and reference["held"] >= 256 * 384
    assert results["1x2 chunks"]["largest"] <= 64 * 384  # (the DTensors' global shapes: 2 rows of 32 a chunk)
    assert results["1x1 chunks"]["largest"] <= 48 * 384
    # held from forward to backward: at most a chunk's logits (the row chunks' recomputed in backward)
    assert results["1x2 chunks"]["held"] <= 64 * 384, results["1x2 chunks"]["held"]
    assert results["1x1 chunks"]["held"] <= 48 * 384, results["1x1 chunks"]["held"]
    for name, result in results.items():
        torch.testing.assert_close(result["loss"], reference["loss"], **LOSS_TOL, msg=name)
        assert set(result["grads"]) == set(reference["grads"])
        for param, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][param], **GRAD_TOL, msg=f"{name} {param}")


@pytest.mark.parametrize("overrides, message", [
    (["trainer.loss_chunk_tokens=-1"], "trainer.loss_chunk_tokens=-1: must be > 0 (tokens a chunk), 0 for whole"),
    (["trainer.loss_chunk_tokens=64", "mesh=pp2x1x1", "model.n_layers=4", "plan=none"],
     "trainer.loss_chunk_tokens=64: a pipeline's last stage scores whole logits; set 0"),
    (["trainer.loss_chunk_tokens=64", "model=seed_mlp", "plan=none", "mesh=1x1"],
     "trainer.loss_chunk_tokens=64: SeedMLP declares no output layer for the loss to score by chunks"),
])
def test_chunks_no_forward_can_score_are_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_config([*TINY_LM, *overrides]))


@pytest.mark.parametrize("device, vocab, setting, chunk", [
    ("cuda", 32768, None, 2048),  # null: 2048 tokens a chunk on a GPU at a vocabulary of 32k or more
    ("cuda", 32767, None, 0),
    ("cpu", 32768, None, 0),
    ("cuda", 32768, 0, 0),
    ("cpu", 300, 64, 64),
])
def test_the_default_chunks_on_a_gpu_at_a_large_vocabulary_alone(device, vocab, setting, chunk):
    """trainer.loss_chunk_tokens as the LM objective's setup reads it for the run's device and vocabulary."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=vocab, dim=4, n_layers=1, n_heads=1)
    cfg = OmegaConf.create({"trainer": {"loss_chunk_tokens": setting}})
    objective = NextTokenCrossEntropy()
    objective.setup(ObjectiveContext(cfg=cfg, device=resolve_device(device, 1, gpu_count=1), module=model, model=model,
                                     head=output_head(model, setting, device, tp_size=1, pp_size=1)))
    assert objective.head == OutputHead(model.output, select=False, chunk=chunk)
