"""Rank 0's TensorBoard writer: scalars per logged step, config and mesh layout as text,
hparams (mesh shape, plan, ...) with the final metrics so sweeps compare in the HPARAMS tab."""
import json
from typing import Any, Dict, Mapping, Optional

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


class TensorBoardLogger:
    def __init__(self, log_dir: str, purge_step: Optional[int] = None):
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log_text(self, tag: str, text: str) -> None:
        # Markdown: indent four spaces so YAML and tables keep their layout.
        self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def log_hparams(self, hparam_values: Dict[str, Any], final_metrics: Dict[str, float], step: int) -> None:
        """Write the hparams summary into this run's own event file (not a sub-run), then the
        metrics as scalars under the same tags, which is what the HPARAMS tab reads."""
        clean = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in hparam_values.items()}
        for summary in hparams(clean, final_metrics):
            self.writer.file_writer.add_summary(summary)
        self.log_scalars(step, final_metrics)

    def close(self) -> None:
        self.writer.close()
