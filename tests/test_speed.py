"""The speed levers compute what they replace: the packed-weight route (and it follows changes of the
weight), fused siblings, grouped attention."""

import pytest
import torch
from conftest import ARCHS, hf_greedy, medusa_tiny
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


class Block(nn.Module):
    """Three layers that read one input (fused), one that reads their sum (alone)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.o(self.q(x) + 2 * self.k(x) + 3 * self.v(x))


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
def test_fused_siblings_compute_their_own_products_and_follow_updates():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 32)
    speed.install(block, sample=lambda: block(x))
    assert block.q.siblings.layers == [block.q, block.k, block.v] and block.o.siblings is None
    assert type(block.o) is speed.RoutedLinear

    def reference():
        q, k, v = (F.linear(x, layer.weight, layer.bias) for layer in (block.q, block.k, block.v))
        return F.linear(q + 2 * k + 3 * v, block.o.weight, block.o.bias)

    with torch.no_grad(), speed.decoding_step():
        torch.testing.assert_close(block(x), reference())
        block.v.weight.mul_(2)  # one sibling changes in place
        torch.testing.assert_close(block(x), reference())
        y = torch.randn(3, 32)
        block.q(x)  # a sibling called on another input than the first one's computes its own product
        torch.testing.assert_close(block.k(y), F.linear(y, block.k.weight, block.k.bias))


def test_decoding_steps_take_one_route_whose_rows_round_alone():
    """A step's rows round alike only on a route that sums each row alone (stream, columns): a step of any rows
    takes the one of least time over the widths up to 16 rows (untimed: the one-row choice, where it is one);
    elsewhere, and in prefills, the probed choice per width stands."""
    widths = (1, 4, 16, 64)
    timed = {"stream": (1.0, 2.0, 8.0, 9.0), "columns": (1.2, 1.5, 4.0, 99.0), "packed": (3.0, 2.0, 2.0, 2.0)}
    routes = speed.Routes(widths, {"torch.float32": ("stream", "columns", "packed", "packed"),
                                   "torch.bfloat16": ("stream", "stream", "packed", "packed")},
                          {"torch.float32": timed})
    steps = routes.for_steps()
    assert [steps.route(rows, torch.float32, 0) for rows in (1, 9, 40)] == ["columns"] * 3
    assert [routes.route(rows, torch.float32, 0) for rows in (1, 3, 40)] == ["stream", "columns", "packed"]
    assert [steps.route(rows, torch.bfloat16, 0) for rows in (1, 9, 40)] == ["stream"] * 3
    untimed = speed.Routes(widths, {"torch.bfloat16": ("packed", "stream", "aten", "aten")}).for_steps()
    assert [untimed.route(rows, torch.bfloat16, 0) for rows in (1, 3, 9)] == ["packed", "stream", "aten"]
    assert steps.route(9, torch.float16, 0) == routes.route(9, torch.float16, 0)  # not probed: the default


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
def test_no_packed_route_when_the_copies_do_not_fit(monkeypatch):
    layer = nn.Linear(32, 16)
    monkeypatch.setattr(speed, "_free_memory", lambda: layer.weight.nbytes)  # half of it is too little
    with pytest.warns(UserWarning, match="free memory"):
        speed.install(layer)
    assert type(layer) is nn.Linear
    monkeypatch.setattr(speed, "_free_memory", lambda: 4 * layer.weight.nbytes)
    speed.install(layer)
    assert type(layer) is speed.RoutedLinear


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


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
@pytest.mark.parametrize("arch", ARCHS)
def test_levers_keep_greedy_exact_in_float32(arch, monkeypatch):
    """float32 decoding takes every lever (routed products, fused siblings, grouped attention) and still
    gives transformers' greedy tokens."""
    from transformers.integrations import sdpa_attention

    model = medusa_tiny(arch, seed=5).float()
    repeats, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(1) or repeat_kv(*a))
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5]])
    expected = hf_greedy(model.base_model, ids, 20)
    repeats.clear()
    for tree in ["plain", "reference", "default+lookup4"]:
        out = model.generate(ids, max_new_tokens=20, tree=tree, eos_token_id=[])
        assert torch.equal(out.sequences, expected), tree
    groups = {layer.siblings for layer in speed.cpu_linears(model)} - {None}
    assert all(g._fused is not None for g in groups)  # each group's one product ran
    assert len(groups) == SIBLINGS[arch]
    if model.config._attn_implementation == "sdpa":
        assert not repeats  # grouped attention read the shared heads


# per family, the runs of layers that read one input (2 layers: q/k/v and gate/up each); Phi-3, GPT-NeoX and GPT-2
# already fuse them in their weights
SIBLINGS = {"llama": 4, "mistral": 4, "qwen2": 4, "qwen3": 4, "gemma2": 4, "gemma3": 4, "phi3": 0, "gpt2": 0,
            "gpt_neox": 0}
