"""The skinny-matmul route computes what F.linear computes, for every row count it handles."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from medusa_heads import speed


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 9, speed.SKINNY_ROWS, speed.SKINNY_ROWS + 1])
def test_linear_routes_match_f_linear(rows):
    torch.manual_seed(0)
    layer = nn.Linear(256, 96)
    speed.install(layer)
    x = torch.randn(1, rows, 256)
    with speed.decoding_step():
        got = layer(x)
    assert got.shape == (1, rows, 96)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
