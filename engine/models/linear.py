"""The dense linear layer of the models: nn.Linear (its parameters, names and
loading unchanged) whose product goes through kernels.ops.linear, so that a
decode step of one sequence on a GPU takes the Triton GEMV."""
from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
