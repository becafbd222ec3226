"""Context parallelism's checks before launch (framework.parallel.context_parallel applies it):
the sequence splits into its chunks, and the model has attention to split it for."""
from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.protocol import offered


def check_context_parallel(c: Checked) -> None:
    """Before launch: the sequence splits into 2 x cp chunks (with TP, each rank's share a
    multiple of the TP size, for sequence parallelism), and the model has attention to split it for."""
    cfg, model, cp_size, tp_size = c.cfg, c.model, c.roles.cp_size, c.roles.tp_size
    if cp_size == 1:
        return
    cp_dim = cfg.parallel.cp_dim
    if not offered(model).supports_context_parallel:
        raise ConfigError("parallel.cp_dim", cp_dim, f"context parallelism splits the sequences of a model with "
                                                     f"attention (framework.models.Transformer); "
                                                     f"{type(model).__name__} has none")
    seq_len = (cfg.data.get("dataset") or {}).get("seq_len")
    if seq_len is None:
        raise ConfigError("parallel.cp_dim", cp_dim, "context parallelism splits token sequences; this data has no "
                                                     "data.dataset.seq_len")
    if seq_len % (2 * cp_size * tp_size):
        per_tp = f", each rank's two a multiple of the TP size {tp_size}" if tp_size > 1 else ""
        raise ConfigError("data.dataset.seq_len", seq_len, f"must divide into 2 x cp = {2 * cp_size} equal chunks "
                                                           f"(context parallelism's head-tail layout{per_tp}); use a "
                                                           f"multiple of {2 * cp_size * tp_size}")
