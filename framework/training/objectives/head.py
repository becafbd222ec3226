"""The loss side's owner of the model's output layer (torchtitan's ChunkedLossWrapper holds the
lm_head the same way). An objective's forward asks the model for its final hidden states
(ModelProtocol.output_layer; `forward(..., skip_output=True)`) and its OutputHead scores them:
whole, at the targets that count alone (a prompt's positions never reach the output layer: on
the peers' DPO row half of them; TRL's fused LM head does the same), or by chunks of tokens
(framework.training.objectives.chunked_loss). A model that declares no output layer, and a
pipeline, whose last stage projects, are scored on the forward's own outputs. Whether logits
are sharded on the vocabulary (and so scored under loss_parallel) is the plan's, said by
framework.parallel.plan.vocabulary_sharded alone."""
from typing import Optional

import torch
from torch import nn

from framework.config.errors import ConfigError
from framework.data.batch import IGNORE
from framework.models.protocol import offered, project
from framework.training.objectives.chunked_loss import score_by_chunks

AUTO_CHUNK = 2048  # tokens a chunk under trainer.loss_chunk_tokens=null: 1 GB of fp32 logits at 128k
AUTO_VOCAB = 32768  # ... where the vocabulary is at least this, on a GPU


class OutputHead:
    """How an objective's forward meets `output`, the model's output layer: at the counted
    targets alone (`select`: the layer whole on this rank) and by chunks of `chunk` tokens (0:
    whole logits). With neither (or no output layer), the forward's own logits."""

    def __init__(self, output: Optional[nn.Module] = None, select: bool = False, chunk: int = 0):
        self.output, self.select, self.chunk = output, select and output is not None, chunk if output is not None else 0

    def __eq__(self, other) -> bool:
        return isinstance(other, OutputHead) and (self.output, self.select, self.chunk) == (
            other.output, other.select, other.chunk)

    def __repr__(self) -> str:
        return f"OutputHead(select={self.select}, chunk={self.chunk})"

    def every_position(self) -> "OutputHead":
        """The same, at every position (a loss that counts each one: the LM objective's)."""
        return OutputHead(self.output, False, self.chunk)

    def of(self, model: nn.Module) -> "OutputHead":
        """The same scoring of another model's output layer (a frozen reference's)."""
        return OutputHead(offered(model).output_layer(), self.select, self.chunk)

    def __call__(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, per_token: bool,
                 **model_inputs):
        """`model`'s forward on `inputs` scored against `targets`: logits (rows, seq, vocab), or
        (count, vocab) at the counted targets alone with `select`; by chunks, a TokenLogps
        (`per_token`) or a LossSum (framework.training.objectives.logps)."""
        if not (self.select or self.chunk):
            return model(inputs, **model_inputs)
        hidden = model(inputs, skip_output=True, **model_inputs)
        if self.select:
            hidden = hidden[targets != IGNORE]
        if self.chunk:
            return score_by_chunks(hidden, self.output, targets, self.chunk, per_token)
        return project(self.output, hidden)


def output_head(module: nn.Module, loss_chunk_tokens: Optional[int], device_type: str, tp_size: int,
                pp_size: int) -> OutputHead:
    """The policy `module`'s OutputHead (the builder's, for the objective's context): positions
    selected if no TP plan splits the output layer; chunks as trainer.loss_chunk_tokens says
    (null: AUTO_CHUNK on a GPU with a vocabulary of AUTO_VOCAB or more); neither under a
    pipeline (its last stage projects)."""
    output = offered(module).output_layer()
    if output is None or pp_size > 1:
        return OutputHead()
    chunk = loss_chunk_tokens
    if chunk is None:
        big = output.weight.shape[0] >= AUTO_VOCAB
        chunk = AUTO_CHUNK if device_type == "cuda" and big else 0
    return OutputHead(output, select=tp_size == 1, chunk=chunk)


def check_loss_chunks(c) -> None:
    """Before launch: trainer.loss_chunk_tokens a count of tokens, and chunks only where a forward
    can score them (a model that declares its output layer; no pipeline, whose last stage scores
    whole logits)."""
    chunk = c.cfg.trainer.get("loss_chunk_tokens")
    if chunk is None or chunk == 0:
        return
    if chunk < 0:
        raise ConfigError("trainer.loss_chunk_tokens", chunk, "must be > 0 (tokens a chunk), 0 for whole logits, or "
                                                              "null for the automatic choice")
    if c.roles.pp_size > 1:
        raise ConfigError("trainer.loss_chunk_tokens", chunk, "a pipeline's last stage scores whole logits; set 0 "
                                                              "(or null), or use a mesh without a pp dim")
    if offered(c.model).output_layer() is None:
        raise ConfigError("trainer.loss_chunk_tokens", chunk, f"{type(c.model).__name__} declares no output layer for "
                                                              f"the loss to score by chunks "
                                                              f"(ModelProtocol.output_layer); set 0 or null")
