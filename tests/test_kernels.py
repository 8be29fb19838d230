"""The C++ kernels (where a C++ compiler and an AVX2/FMA CPU are there to build them; elsewhere they are left out):
the stream route's products equal F.linear's, the lean decoder's fused operations equal transformers' own, and
greedy decoding with every product on the stream route and the fused operations equals transformers'."""

import copy
import platform
import shutil

import pytest
import torch
from conftest import ARCHS, hf_greedy, randomize_heads
from test_lean import FAMILIES, lean_forward, passes, transformers_forward
from tiny import tiny_model
from torch.nn import functional as F

from medusa_heads import MedusaModel, adapter, kernels, lean, speed, tuning
from medusa_heads import decoder as decoder_module
from medusa_heads.acceptance import Sampling, accept
from medusa_heads.cache import TreeCache
from medusa_heads.kernels import stream_linear
from medusa_heads.tree import Tree
from medusa_heads.tuning import cpu_info

BUILDABLE = shutil.which("c++") is not None and platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_info()[1]
pytestmark = pytest.mark.skipif(not BUILDABLE, reason="the kernels need a C++ compiler and an AVX2/FMA CPU")


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 16])
def test_products_equal_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    for inputs, outputs in ((7, 1), (64, 5), (579, 130)):  # sizes off the 8-wide and 16-output blocks
        x = torch.randn(rows, inputs, generator=generator)
        weight, bias = torch.randn(outputs, inputs, generator=generator), torch.randn(outputs, generator=generator)
        for b in (None, bias):
            assert torch.allclose(stream_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 2 * rows, 64, generator=generator)[:, ::2]  # (B, T, K), not contiguous
    weight = torch.randn(33, 64, generator=generator)
    assert torch.allclose(stream_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_a_rows_product_does_not_depend_on_the_other_rows():
    """A tree pass of n rows rounds each row as a plain step of one row does (the kernel's tiles of up to 8
    rows sum in one order), so the verification and plain decoding see the same logits."""
    generator = torch.Generator().manual_seed(0)
    for inputs in (7, 579):
        x = torch.randn(20, inputs, generator=generator)
        weight, bias = torch.randn(37, inputs, generator=generator), torch.randn(37, generator=generator)
        whole = stream_linear(x, weight, bias)
        for rows in range(1, 20):  # one row alone, every tile height, and passes of several tiles
            assert torch.equal(stream_linear(x[:rows], weight, bias), whole[:rows])
            assert torch.equal(stream_linear(x[rows - 1 : rows + 1], weight, bias), whole[rows - 1 : rows + 1])


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_bfloat16_weights_widen_exactly(rows):
    """Over a bfloat16 weight the kernel computes exactly what it computes over the same values in float32."""
    generator = torch.Generator().manual_seed(rows)
    for inputs in (7, 579):
        x = torch.randn(rows, inputs, generator=generator)
        weight, bias = torch.randn(41, inputs, generator=generator).bfloat16(), torch.randn(41, generator=generator)
        assert torch.equal(stream_linear(x, weight, bias), stream_linear(x, weight.float(), bias))


def test_a_draft_projects_through_a_bfloat16_copy_within_a_decoding_step_only(monkeypatch):
    heads = MedusaModel.from_pretrained(tiny_model("llama", dtype=torch.float32), num_heads=2, projection="shared",
                                        draft_vocab=12).heads
    states = torch.randn(3, heads.config.hidden_size)
    with torch.inference_mode():
        assert torch.allclose(heads.shared_logits(states), F.linear(states, heads.draft_weight))  # training's
        for token_map in (torch.arange(12), torch.arange(4, 16)):
            heads.set_token_map(token_map)  # new rows in the same weight: the copy follows them
            with speed.decoding_step():
                drafted = heads.shared_logits(states)
            assert torch.equal(drafted, stream_linear(states, heads.draft_weight.bfloat16(), None, draft=True))
        monkeypatch.setattr(speed, "DRAFT_BF16", False)
        with speed.decoding_step():
            assert torch.allclose(heads.shared_logits(states), F.linear(states, heads.draft_weight))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_a_drafts_products_equal_linear(rows):
    """A draft's products sum in another order (4 chains a row), over float32 or bfloat16 weights."""
    generator = torch.Generator().manual_seed(rows)
    for inputs in (7, 40, 579):  # below, at and off the chains' 32-wide steps
        x = torch.randn(rows, inputs, generator=generator)
        weight, bias = torch.randn(37, inputs, generator=generator), torch.randn(37, generator=generator)
        for w in (weight, weight.bfloat16()):
            expected = F.linear(x, w.float(), bias)
            assert torch.allclose(stream_linear(x, w, bias, draft=True), expected, rtol=1e-5, atol=1e-4)


def chained_heads(arch: str, **kwargs) -> MedusaModel:
    return randomize_heads(MedusaModel.from_pretrained(tiny_model(arch, dtype=torch.float32), num_heads=3,
                                                       next_token=True, chained=True, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projection", [dict(projection="shared", draft_vocab=12), dict(projection="shared"),
                                        dict(projection="own")])
def test_a_native_draft_proposes_what_the_heads_modules_propose(projection, dtype, monkeypatch):
    """bfloat16 heads draft in float32 over their weights: what their float32 copy's modules propose."""
    model = chained_heads("llama", **projection).to(dtype)
    heads, reference = model.heads, copy.deepcopy(model).float().heads  # the same values in float32
    tree = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    hidden = (torch.randn(2, heads.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    root = torch.tensor([5, 9])
    calls = []
    real = heads._native_draft
    monkeypatch.setattr(heads, "_native_draft", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode(), speed.decoding_step():
        native = heads.draft(hidden, root, tree.levels(), tree.topk)
        monkeypatch.setattr(speed, "NATIVE_DRAFT", False)
        modules = reference.draft(hidden.float(), root, tree.levels(), tree.topk)
    assert calls == [1] and torch.equal(native, modules)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_native_drafts_acceptance_and_commits_equals_transformers(arch, monkeypatch):
    model = chained_heads(arch, projection="shared", draft_vocab=12)
    calls = []
    real, real_accept = model.heads._native_draft, kernels.load().greedy_accept
    monkeypatch.setattr(model.heads, "_native_draft", lambda *a: calls.append("draft") or real(*a))
    real_commit = kernels.load().commit_moves
    monkeypatch.setattr(kernels.load(), "greedy_accept", lambda *a: calls.append("accept") or real_accept(*a))
    monkeypatch.setattr(kernels.load(), "commit_moves", lambda *a: calls.append("commit") or real_commit(*a))
    ids = torch.tensor([[5, 9, 3, 7, 5, 9, 3, 7], [4, 8, 6, 2, 6, 2, 6, 2]])
    out = model.generate(ids, max_new_tokens=24, tree="default", eos_token_id=[])
    assert {"draft", "accept", "commit"} == set(calls)  # drafted, accepted and kept by the C++ calls
    for row, tokens in zip(ids, out.new_tokens, strict=True):
        assert tokens == hf_greedy(model.base_model, row[None], 24, eos_token_id=[])[0, ids.shape[1]:].tolist()


def counting_draft_layers(monkeypatch) -> list[int]:
    """The C++ passes of a layer without an input norm (an EAGLE-style draft's, not the base's), counted."""
    calls, real = [], kernels.load().decoder_layers

    def counted(hidden, params, *rest):
        calls.extend([1] * (params[0].numel() == 0))
        return real(hidden, params, *rest)

    monkeypatch.setattr(kernels.load(), "decoder_layers", counted)
    return calls


@pytest.mark.parametrize("width", [3, 70])  # attention.cpp's few queries; sdpa's many
def test_a_native_eagle_layer_pass_equals_the_modules(width, monkeypatch):
    layer = MedusaModel.from_pretrained(tiny_model("llama", dtype=torch.float32), draft="eagle").heads.layer
    monkeypatch.setattr(speed, "DRAFT_BF16", False)  # both ways over the same float32 weights
    calls = counting_draft_layers(monkeypatch)
    generator = torch.Generator().manual_seed(width)
    hidden = layer.q_proj.in_features
    first, x = torch.randn(2, 8, hidden, generator=generator), torch.randn(2, width, hidden, generator=generator)
    # the tree's nodes see the 8 committed entries, themselves and a random choice of the nodes before them
    among = torch.rand(2, 1, width, width, generator=generator).tril(-1) > 0.5
    allowed = torch.cat([torch.ones(2, 1, width, 8, dtype=torch.bool), among | torch.eye(width, dtype=torch.bool)], -1)
    results = []
    for native in (True, False):
        monkeypatch.setattr(speed, "NATIVE_DRAFT", native)
        cache = TreeCache(1, 2, 8 + width, torch.device("cpu"))
        with torch.inference_mode(), speed.decoding_step():
            cache.prepare(8, 8)
            layer(first, torch.arange(8).expand(2, 8), cache, torch.ones(8, 8, dtype=torch.bool).tril()[None, None])
            cache.commit(torch.tensor([8, 8]))
            cache.prepare(width, 8 + width)
            results.append((layer(x, torch.tensor([[8], [9]]).expand(2, width), cache, allowed), cache.keys.clone()))
    assert calls == [1, 1]  # both passes of the first round natively, none of the second
    (native_out, native_keys), (modules_out, modules_keys) = results
    torch.testing.assert_close(native_out, modules_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native_keys, modules_keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_a_native_eagle_draft_equals_transformers(arch, monkeypatch):
    torch.manual_seed(1)
    model = MedusaModel.from_pretrained(tiny_model(arch, dtype=torch.float32), draft="eagle")
    calls = counting_draft_layers(monkeypatch)
    prompts = [[5, 9, 3, 7, 5, 9, 3, 7], [4, 8, 6]]
    ids, mask = decoder_module.pad_batch(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, tree="dynamic-6x2x2+lookup4", eos_token_id=[])
    assert calls  # the draft's passes ran in C++, over bfloat16 copies of its products
    for prompt, tokens in zip(prompts, out.new_tokens, strict=True):
        reference = hf_greedy(model.base_model, torch.tensor([prompt]), 24, eos_token_id=[])[0, len(prompt):]
        assert tokens == reference.tolist()


@pytest.mark.parametrize("paths", [[], [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_greedy_acceptance_equals_the_tensor_functions(paths, batch, dtype, monkeypatch):
    tree, vocab = Tree(paths), 37
    generator = torch.Generator().manual_seed(0)
    for trial in range(100):
        logits = torch.randn(batch, tree.size, vocab, generator=generator).round().to(dtype)  # many equal largest
        if trial % 5 == 0:
            logits[batch - 1, trial % tree.size, trial % vocab] = float("nan")  # the largest, as torch has it
        agreeing = logits.argmax(-1).gather(1, tree.parents.expand(batch, -1))  # every path accepted whole
        tokens = torch.where(torch.rand(batch, tree.size, generator=generator) < 0.3,
                             torch.randint(vocab, (batch, tree.size), generator=generator), agreeing)
        parents, retrieve = tree.parents, tree.retrieve
        if trial % 2:  # one tree per row, as a step's trees come
            parents, retrieve = parents.expand(batch, -1), retrieve.expand(batch, -1, -1)
        with torch.inference_mode(), speed.decoding_step():
            assert speed.native_accept(logits)
            native = accept(tokens, logits, parents, retrieve, Sampling())
            monkeypatch.setattr(speed, "NATIVE_ACCEPT", False)
            tensors = accept(tokens, logits, parents, retrieve, Sampling())
            monkeypatch.setattr(speed, "NATIVE_ACCEPT", True)
        for field in ("path", "count", "next_token"):
            assert torch.equal(getattr(native, field), getattr(tensors, field)), (trial, field)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_commit_keeps_what_the_indexed_copies_keep(dtype, monkeypatch):
    tree, generator = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], lookup=3), torch.Generator().manual_seed(0)
    for trial in range(60):
        batch = 1 + trial % 3
        lengths = torch.randint(0, 20, (batch,), generator=generator)
        paths = tree.retrieve[torch.randint(tree.retrieve.shape[0], (batch,), generator=generator)]  # (B, depth + 1)
        counts = torch.stack([torch.randint(1, int((p >= 0).sum()) + 1, (), generator=generator) for p in paths])
        buffers = torch.randn(2, 3, batch, 2, 40, 8, generator=generator).to(dtype)
        kept = []
        for native in (True, False):
            cache = TreeCache(num_layers=3, batch_size=batch, max_len=40, device=torch.device("cpu"))
            cache.keys, cache.values = buffers.clone()
            cache.lengths = lengths.clone()
            monkeypatch.setattr(speed, "NATIVE_ACCEPT", native)
            with torch.inference_mode(), speed.decoding_step():
                assert speed.native_commit(cache.keys) == native
                cache.commit(counts, paths.clamp(min=0))
            kept.append(cache)
        assert torch.equal(kept[0].lengths, lengths + counts)
        for b in range(batch):  # what lies past a row's length is free to differ
            span = int(kept[0].lengths[b])
            for name in ("keys", "values"):
                assert torch.equal(getattr(kept[0], name)[:, b, :, :span], getattr(kept[1], name)[:, b, :, :span])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_bfloat16_drafts_equals_transformers(arch, monkeypatch):
    """The heads' guesses round differently in bfloat16; what is emitted does not."""
    model = chained_heads(arch, projection="shared", draft_vocab=12)
    monkeypatch.setattr(speed, "NATIVE_DRAFT", False)  # the heads' modules: their products in Python
    weights = []
    monkeypatch.setattr(speed, "stream_linear", lambda x, w, b, draft=False, real=speed.stream_linear:
                        weights.append(w.dtype) or real(x, w, b, draft))
    ids = torch.tensor([[5, 9, 3, 7, 5, 9, 3, 7]])
    out = model.generate(ids, max_new_tokens=24, tree="default", eos_token_id=[])
    assert weights and set(weights) == {torch.bfloat16}  # the drafts' products (the base's take the routes)
    assert out.new_tokens[0] == hf_greedy(model.base_model, ids, 24, eos_token_id=[])[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_a_bfloat16_models_product_rounds_once_and_does_not_depend_on_the_other_rows(rows):
    """bfloat16 x over a bfloat16 weight (a bfloat16 model's product on the stream route): the exact products summed
    in float32, rounded to bfloat16 once; each row as in a pass of it alone (plain steps and tree passes agree)."""
    generator = torch.Generator().manual_seed(rows)
    for inputs in (7, 579):  # sizes off the 32-wide steps of bfloat16 pairs
        x = torch.randn(rows, inputs, generator=generator).bfloat16()
        weight = torch.randn(41, inputs, generator=generator).bfloat16()
        for bias in (None, torch.randn(41, generator=generator).bfloat16()):
            out = stream_linear(x, weight, bias)
            exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
            assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-4)
            for r in range(1, rows + 1):
                assert torch.equal(stream_linear(x[r - 1 : r], weight, bias), out[r - 1 : r])


BF16_PAIRS = "avx512_bf16" in cpu_info()[1]  # the bfloat16 columns kernel's instructions


columns_linear = speed.ROUTES["columns"]  # x W^T + b over W's copy by columns


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_PAIRS, reason="bfloat16 columns need AVX512-BF16"))])
def test_products_by_columns_equal_linear_and_each_row_rounds_alone(dtype):
    """The columns route: within rounding of the float64 product (a bfloat16 x's sums rounded once, a float32 x over
    bfloat16 columns in float32), and every row of a pass of 1-13 rows exactly as in a pass of it alone."""
    generator = torch.Generator().manual_seed(0)
    for inputs, outputs in ((7, 5), (64, 41), (579, 130)):  # sizes off the 16-output blocks and 2-wide pairs
        x = torch.randn(13, inputs, generator=generator)
        weight, bias = torch.randn(outputs, inputs, generator=generator), torch.randn(outputs, generator=generator)
        for x_dtype in {dtype, torch.float32}:
            for b in (None, bias.to(x_dtype)):
                whole = columns_linear(x.to(x_dtype), weight.to(dtype), b)
                assert whole.dtype == x_dtype
                xs = x.to(x_dtype).to(dtype).double()  # what the products read (a bfloat16 weight's x: rounded)
                exact = F.linear(xs, weight.to(dtype).double(), None if b is None else b.double())
                tolerance = 2**-8 if x_dtype == torch.bfloat16 else 1e-5
                assert torch.allclose(whole.double(), exact, rtol=tolerance, atol=1e-4)
                for rows in (1, 5, 6, 7, 13):
                    alone = [columns_linear(x[m : m + 1].to(x_dtype), weight.to(dtype), b) for m in range(rows)]
                    assert torch.equal(columns_linear(x[:rows].to(x_dtype), weight.to(dtype), b), torch.cat(alone))
                    assert torch.equal(torch.cat(alone), whole[:rows])


def test_refuses_what_it_does_not_compute():
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        stream_linear(x.half(), weight.half(), None)
    with pytest.raises(RuntimeError, match="needs a bfloat16 weight"):
        stream_linear(x.bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        stream_linear(x, torch.randn(16, 8).T, None)
    with pytest.raises(RuntimeError, match="sizes differ"):
        stream_linear(x, torch.randn(8, 15), None)
    with pytest.raises(RuntimeError, match="columns' layout"):
        kernels.columns_linear(x, weight, None, 8)  # the weight itself, not laid out by columns
    with pytest.raises(RuntimeError, match="needs bfloat16 columns"):
        columns_linear(x.bfloat16(), weight, None)


@pytest.mark.parametrize("route", ["stream", "packed", "columns"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_every_product_on_one_route_and_fused_operations_equals_transformers(arch, route, monkeypatch):
    model = randomize_heads(MedusaModel.from_pretrained(tiny_model(arch, dtype=torch.float32), num_heads=3))
    used = []
    real = speed.ROUTES[route]
    monkeypatch.setitem(speed.ROUTES, route, lambda x, w, b: used.append(x.shape[0]) or real(x, w, b))
    monkeypatch.setattr(speed.Routes, "route", lambda self, rows, dtype, elements: route)
    monkeypatch.setattr(decoder_module, "PREFILL_TOKENS", 8)  # prefills of a few rows of the batch at a time
    prompts = [[5, 9, 3, 7, 5, 9, 3], [4, 8], [6, 2, 6, 2, 6]]
    ids, mask = decoder_module.pad_batch(prompts)
    for tree in ("plain", "default"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, tree=tree, eos_token_id=[])
        for prompt, tokens in zip(prompts, out.new_tokens, strict=True):
            expected = hf_greedy(model.base_model, torch.tensor([prompt]), 24, eos_token_id=[])[0, len(prompt):]
            assert tokens == expected.tolist(), (arch, tree)
    assert used  # the products did take the route


@pytest.mark.parametrize("steps", ["stream", pytest.param("columns", marks=pytest.mark.skipif(
    not BF16_PAIRS, reason="bfloat16 columns need AVX512-BF16"))])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bfloat16_models_pass_is_one_call_in_float32_and_decodes_as_its_plain_steps_do(arch, steps, monkeypatch):
    """A bfloat16 model's pass is one C++ call too, in float32 over its bfloat16 weights; the probe times the stream
    route for bfloat16; on it every row of a tree pass rounds as in a plain step, so greedy Medusa in bfloat16 equals
    plain decoding through the same loop; the chained heads draft in one C++ call too."""
    model = randomize_heads(MedusaModel.from_pretrained(tiny_model(arch, dtype=torch.bfloat16), num_heads=3,
                                                        next_token=True, chained=True, projection="shared",
                                                        draft_vocab=12))
    speed.install(model)
    assert "stream" in speed.probe_routes(model, widths=(1, 4), rounds=1).times["torch.bfloat16"]
    times = {"stream": (1.0, 4.0), "columns": (1.1, 2.0) if steps == "columns" else (1.1, 4.5), "packed": (3.0, 1.0)}
    routes = speed.Routes((1, 4), {"torch.bfloat16": ("stream", "packed")}, {"torch.bfloat16": times})  # steps: one
    model.tuning = tuning.Tuning(tuning.machine(model), routes, None, None, None, 0.0)
    monkeypatch.setenv("MEDUSA_HEADS_TUNE", "1")  # (the decoders take model.tuning: nothing is probed)
    passes, drafts = [], []
    real, real_draft = lean.Native.forward, model.heads._native_draft
    monkeypatch.setattr(lean.Native, "forward", lambda self, hidden, cos, sin, route, *args: passes.append(
        (hidden.dtype, hidden.shape[1], route)) or real(self, hidden, cos, sin, route, *args))
    monkeypatch.setattr(model.heads, "_native_draft", lambda *a: drafts.append(1) or real_draft(*a))
    ids = torch.tensor([[5, 9, 3, 7, 5, 9, 3, 7]])
    plain, medusa = (model.generate(ids, max_new_tokens=24, tree=tree, eos_token_id=[])
                     for tree in ("plain", "default"))
    assert medusa.new_tokens == plain.new_tokens and medusa.mean_accepted_length > 1
    assert {dtype for dtype, _, _ in passes} == {torch.float32} and drafts
    assert {route for _, rows, route in passes if rows == ids.shape[1]} == {"packed"}  # the prefills
    assert {route for _, rows, route in passes if rows < ids.shape[1]} == {steps}  # the steps, of 1 to 8 rows


def test_the_probe_times_the_route_and_leaves_it_out_where_it_cannot_be_built(monkeypatch):
    model = MedusaModel.from_pretrained(tiny_model("llama", dtype=torch.float32), num_heads=2)
    speed.install(model)
    assert "stream" in speed.probe_routes(model, widths=(1, 4), rounds=1).times["torch.float32"]
    monkeypatch.setattr(kernels, "load", lambda: None)  # as on a machine without a compiler
    routes = speed.probe_routes(model, widths=(1, 4), rounds=1)
    assert set(routes.times["torch.float32"]) == {"aten", "packed"}


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load():
    import os
    import subprocess
    import sys
    import time

    kernels.load()  # built (or loaded) here first
    root = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))
    lock = os.path.join(root, f"medusa_heads_kernels_{kernels.build_key()}", "lock")
    open(lock, "w").close()
    old = time.time() - 2 * kernels.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    load = "from medusa_heads.kernels import load; assert load() is not None"
    subprocess.run([sys.executable, "-c", load], check=True, timeout=120)  # torch alone would wait forever
    assert not os.path.exists(lock)


@pytest.mark.parametrize("arch", FAMILIES)
def test_lean_decoder_with_fused_operations_equals_transformers_modules(arch):
    base = tiny_model(arch, dtype=torch.float32)
    assert lean.Plan(adapter.decoder(base)).native  # the pass is one C++ call
    (ours, our_cache), (theirs, their_cache) = passes(base, lean_forward), passes(base, transformers_forward)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(our_cache.keys, their_cache.keys, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [5, 300])  # a decoding pass (one thread), a prefill (threads, torch's silu)
def test_fused_operations_equal_the_unfused_ones(tokens):
    generator = torch.Generator().manual_seed(0)
    norm = torch.nn.RMSNorm(40, eps=1e-6)
    norm.variance_epsilon = norm.eps
    with torch.no_grad():
        norm.weight.normal_(generator=generator)
    fused = torch.randn(3, tokens, 3 * 40, generator=generator)  # fused q/k/v or gate/up outputs: strided views
    a, b, c = fused.split(40, dim=-1)
    cos, sin = torch.randn(2, 3, 8, generator=generator).unbind(0)  # per row

    def everything(fused: bool):
        hidden = torch.randn(3, tokens, 40, generator=torch.Generator().manual_seed(1))
        cache = TreeCache(1, 4, tokens + 4, torch.device("cpu"))
        cache.lengths += torch.tensor([0, 2, 4, 1])
        cache.prepare(tokens, tokens + 4, rows=torch.tensor([3, 0, 2]))  # a prefill of 3 of the 4 rows
        # 5 query heads and 2 key/value heads of 8; cos / sin broadcast over the tokens (stride 0)
        qkv = a, b[..., :16], c[..., :16]
        rotation = cos[:, None].expand(3, tokens, 8), sin[:, None].expand(3, tokens, 8)
        if fused:
            ops = kernels.load()
            cache.allocate(*(torch.empty(0, 2, 0, 8),) * 2)
            rows, slots = cache.write_index
            query = ops.rotary_write(*qkv, *rotation, cache.keys[0], cache.values[0], rows[:, 0], slots)
            keys, values = cache.read(0)
            normed = ops.rms_norm(hidden, norm.weight, norm.variance_epsilon, a.contiguous())
            return (normed, hidden, ops.rms_norm(hidden, norm.weight, norm.variance_epsilon, None), ops.silu_mul(a, b),
                    query, keys, values, cache.keys)
        query, keys, values = lean._rotary_write(*qkv, *rotation, cache, 0)
        normed = lean._rms_norm(hidden, norm, a.contiguous())
        return normed, hidden, lean._rms_norm(hidden, norm, None), F.silu(a) * b, query, keys, values, cache.keys

    with torch.no_grad():
        for ours, theirs in zip(everything(fused=True), everything(fused=False), strict=True):
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # 24: a size without its own compiled case
@pytest.mark.parametrize("queries", [1, 5])
def test_attention_of_a_few_queries_equals_sdpa(queries, head_dim):
    generator = torch.Generator().manual_seed(queries * head_dim)
    visible, heads, kv_heads = 37, 6, 2
    keys, values = torch.randn(2, 4, kv_heads, 50, head_dim, generator=generator).unbind(0)  # a cache of 4 rows
    rows = torch.tensor([3, 1, 2])  # the pass's batch rows in the cache
    query = torch.randn(3, heads, queries, head_dim, generator=generator)
    allowed = torch.rand(3, 1, queries, visible, generator=generator) > 0.4
    allowed[..., 0] = True
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    for m in (mask, mask.expand(3, heads, queries, visible), None):  # one mask for every head, one per head, none
        seen_keys, seen_values = keys[rows, :, :visible], values[rows, :, :visible]
        expected = F.scaled_dot_product_attention(query, seen_keys, seen_values, attn_mask=m, scale=0.3,
                                                  enable_gqa=True)
        got = kernels.load().attend(query, keys, values, rows, visible, m, 0.3)
        assert torch.allclose(got, expected.transpose(1, 2).flatten(-2), rtol=1e-5, atol=1e-5)


def test_a_rows_attention_does_not_depend_on_the_hidden_slots_between_its_keys():
    """A tree row's keys are its prefix, its ancestors and itself, other branches' slots hidden between them; a
    plain step's are the same keys side by side: the two rows' attention is the same, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    heads, head_dim, prefix = 3, 64, 29
    keys, values = torch.randn(2, 1, heads, 60, head_dim, generator=generator).unbind(0)
    query = torch.randn(1, heads, 1, head_dim, generator=generator)
    tree_slots = torch.tensor([prefix + 2, prefix + 5, prefix + 6, prefix + 11])  # ancestors and itself
    seen = torch.cat([torch.arange(prefix), tree_slots])
    plain_keys, plain_values = keys.clone(), values.clone()
    plain_keys[0, :, : len(seen)], plain_values[0, :, : len(seen)] = keys[0, :, seen], values[0, :, seen]
    visible = prefix + 12
    mask = torch.full((1, 1, 1, visible), torch.finfo(torch.float32).min)
    mask[..., seen] = 0.0
    rows = torch.tensor([0])
    tree = kernels.load().attend(query, keys, values, rows, visible, mask, 0.125)
    plain = kernels.load().attend(query, plain_keys, plain_values, rows, len(seen), None, 0.125)
    assert torch.equal(tree, plain)
