"""The small plain (non-HF) model the ndp.parallel tests parallelize: two pre-norm MLP blocks and a head."""
import torch
from torch import nn

from ndp.parallel import ModelPlan


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=16, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


PLAN = ModelPlan(tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, blocks=("blocks.*",))
