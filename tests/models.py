"""Tiny models shared by several test files."""

from torch import nn


class TwoInputs(nn.Module):
    """One Linear applied to two inputs: ``model(a=..., c=...)``."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, a, c):
        return self.l(a) + self.l(c)
