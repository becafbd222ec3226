"""One small function per parallelism: apply_dp, apply_tp."""
from framework.parallel.data_parallel import DataParallel, apply_dp
from framework.parallel.tensor_parallel import apply_tp

__all__ = ["DataParallel", "apply_dp", "apply_tp"]
