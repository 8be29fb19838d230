"""The speed levers compute what they replace: the packed-weight route (and it follows changes of the
weight), grouped attention."""

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


@pytest.mark.skipif(not speed.GROUPED_ATTENTION, reason="grouped attention switched off")
@pytest.mark.parametrize("queries", [1, 5])
def test_grouped_attention_reads_shared_heads_in_place(queries, monkeypatch):
    from transformers.integrations import sdpa_attention

    torch.manual_seed(0)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value = torch.randn(2, 6, queries, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    mask = torch.where(torch.rand(2, 1, queries, 11) > 0.3, 0.0, torch.finfo(torch.float32).min)
    expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    repeats, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(1) or repeat_kv(*a))
    with speed.decoding_step():
        got, _ = speed.grouped_attention(module, query, key, value, mask, scaling=0.3)
    assert not repeats  # no copy of the key/value heads per query head
    torch.testing.assert_close(got, expected)
    speed.grouped_attention(module, query, key, value, mask, scaling=0.3)  # outside a step: transformers' own
    assert repeats == ([1, 1] if queries > 1 else [])  # keys and values
