"""The seed's model. Any torch.nn module (or one under framework.) can be a model `_target_`."""
from torch import nn

from framework.models.protocol import ModelProtocol


class SeedMLP(ModelProtocol, nn.Module):
    """The seed's 3-layer model: net1 -> relu -> net2 -> relu -> net3.

    Its TP plan (conf/plan/seed_mlp_tp.yaml) is Megatron's MLP pair, colwise net1 then rowwise
    net2, with net3 colwise gathering its output.
    """

    def __init__(self, in_dim: int = 12, hidden_dim: int = 48, out_dim: int = 12):
        super().__init__()
        self.net1 = nn.Linear(in_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden_dim, hidden_dim)
        self.net3 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x):
        return self.net3(self.relu(self.net2(self.relu(self.net1(x)))))
