"""The packed-weight route computes what F.linear computes, and follows changes of the weight."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from medusa_heads import speed


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 9, 64, 65, 300])
def test_packed_route_runs_and_matches_f_linear(rows, monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(256, 96)
    speed.install(layer)
    ran = []
    monkeypatch.setitem(speed.ROUTES, "packed", lambda *args: ran.append(1) or speed._packed_linear(*args))
    x = torch.randn(1, rows, 256)
    with speed.decoding_step():  # unprobed routes: packed in float32
        got = layer(x)
    assert ran == [1]  # the packed route itself computed it (not an F.linear fallback)
    assert got.shape == (1, rows, 96)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)


def test_packed_weight_follows_updates():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16, bias=False)
    speed.install(layer)
    x = torch.randn(4, 32)
    with speed.decoding_step():
        layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)  # in place, as an optimizer step or load_state_dict does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
        layer.weight = nn.Parameter(torch.randn(16, 32))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
def test_no_packed_route_when_the_copies_do_not_fit(monkeypatch):
    layer = nn.Linear(32, 16)
    monkeypatch.setattr(speed, "_free_memory", lambda: layer.weight.nbytes)  # half of it is too little
    with pytest.warns(UserWarning, match="free memory"):
        speed.install(layer)
    assert "forward" not in vars(layer)
    monkeypatch.setattr(speed, "_free_memory", lambda: 4 * layer.weight.nbytes)
    speed.install(layer)
    assert "forward" in vars(layer)
