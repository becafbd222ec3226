"""Building a model on the meta device (shapes, no storage) without paying for its random init."""
import torch
from torch.overrides import TorchFunctionMode


class SkipRandomInit(TorchFunctionMode):
    """Random init fills nothing on the meta device, yet torch's meta normal_ / uniform_ cost
    about a second the first time they run. Inside, they return their tensor untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.nn.init.trunc_normal_, torch.Tensor.normal_, torch.nn.init.uniform_,
                    torch.Tensor.uniform_, torch.nn.init.kaiming_uniform_):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)
