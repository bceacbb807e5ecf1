"""`python -m tandem.bench.moe_tiles`: its grid of candidate tiles, and its
refusal without a GPU (the sweep itself runs on one: docs/benchmarks.md)."""
from __future__ import annotations

import pytest
import torch

from tandem.bench.moe_tiles import DEFAULT_GRID, main, parse_grid
from tandem.kernels.fused_moe_triton import MoETiles


def test_the_grid_is_every_combination():
    tiles = parse_grid(DEFAULT_GRID)
    assert len(tiles) == 3 * 3 * 3 and len(set(tiles)) == len(tiles)
    assert MoETiles(32, 256, 8, 3) in tiles
    assert parse_grid("16:64:2x5") == [MoETiles(16, 64, 2, 5)]


def test_a_malformed_grid_is_refused_with_the_expected_form():
    with pytest.raises(SystemExit, match="expected N,..:K,..:WARPSxSTAGES"):
        parse_grid("32,64:128")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert main(["--tokens", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
