"""The models' dense layers (engine/models/linear.py) and kernels.ops.linear
on the CPU: the same numbers as torch's linear, and the TANDEM_GEMV switch
that keeps one-row products with torch on a GPU. tests/gpu checks which
kernel a CUDA row takes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tandem.engine.models.linear import Linear
from tandem.kernels import linear


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_layer_is_torchs_linear_on_the_cpu(rows):
    torch.manual_seed(0)
    layer = Linear(24, 10, bias=True)
    x = torch.randn(rows, 24)
    assert isinstance(layer, nn.Linear)  # FP8 quantization and loading find it as one
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.equal(linear(x, layer.weight), nn.functional.linear(x, layer.weight))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_tandem_gemv_0_keeps_one_row_products_with_torch(value, on):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_GEMV"}
    if value is not None:
        env["TANDEM_GEMV"] = value
    out = subprocess.run([sys.executable, "-c", "from tandem.kernels import ops; print(ops._gemv_on)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(on)
