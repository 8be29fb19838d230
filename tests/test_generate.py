"""Greedy Medusa decoding equals plain greedy decoding, token for token, for every tree and family."""

import random

import pytest
import torch
from conftest import ARCHS, hf_greedy, medusa_tiny
from tiny import tiny_tokenizer

from medusa_heads import Tree, lookup
from medusa_heads import decoder as decoder_module
from medusa_heads import generate as generate_module

TREES = ["plain", "chain-4", "dense-2x3", "reference", "default", "default+lookup5"]


def random_tree(rng: random.Random, depth: int = 4, max_rank: int = 5) -> Tree:
    return Tree([[rng.randrange(max_rank) for _ in range(rng.randint(1, depth))] for _ in range(rng.randint(1, 20))])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_generate(arch):
    rng = random.Random(arch)
    model = medusa_tiny(arch, tied=rng.random() < 0.5, seed=rng.randrange(100))
    for trial in range(3):
        ids = torch.randint(3, 16, (1, rng.randint(1, 12)), generator=torch.Generator().manual_seed(trial))
        expected = hf_greedy(model.base_model, ids, max_new_tokens=24)
        for tree in [*TREES, random_tree(rng)]:
            out = model.generate(ids, max_new_tokens=24, tree=tree, eos_token_id=[])
            assert torch.equal(out.sequences, expected), (arch, tree, trial)
            assert sum(out.accept_lengths[0]) == 24


def test_trees_are_exercised():
    """The tiny models accept several tokens per step, so commits of long paths are tested above."""
    model = medusa_tiny("llama")
    out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=40, tree="reference", eos_token_id=[])
    assert max(out.accept_lengths[0]) >= 3 and out.mean_accepted_length > 1.3
    lookup = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=40, tree="plain+lookup6", eos_token_id=[])
    assert max(lookup.accept_lengths[0]) >= 4 and lookup.new_tokens == out.new_tokens


@pytest.mark.parametrize(("arch", "chained"), [("llama", False), ("qwen2", False), ("gpt2", False),
                                               ("llama", True), ("phi3", True)])
def test_heads_that_read_tokens_keep_greedy_exact(arch, chained):
    model = medusa_tiny(arch, next_token=True, chained=chained)
    hidden = torch.randn(1, model.config.hidden_size)
    path = torch.tensor([[3, 5, 7, 9]])
    assert not torch.equal(model.heads(hidden, tokens=path), model.heads(hidden, tokens=path + 1))  # they read the root
    later = model.heads(hidden, tokens=torch.tensor([[3, 6, 8, 10]]))[1:]
    assert torch.equal(later, model.heads(hidden, tokens=path)[1:]) != chained  # chained heads read the path too
    for trial in range(3):
        ids = torch.randint(3, 16, (1, 4 + trial), generator=torch.Generator().manual_seed(trial))
        expected = hf_greedy(model.base_model, ids, max_new_tokens=24)
        for tree in [*TREES, random_tree(random.Random(trial))]:
            out = model.generate(ids, max_new_tokens=24, tree=tree, eos_token_id=[])
            assert torch.equal(out.sequences, expected), (arch, tree, trial)


def find_cut(model, fresh: bool):
    """A prompt and a (token, position) emitted in the middle of a multi-token step of the reference
    tree; with fresh=True, a token that did not appear before it."""
    for seed in range(20):
        ids = torch.randint(3, 16, (1, 5), generator=torch.Generator().manual_seed(seed))
        out = model.generate(ids, max_new_tokens=40, tree="reference", eos_token_id=[])
        tokens, position = out.new_tokens[0], 0
        for length in out.accept_lengths[0]:
            for j in range(position, position + length - 1):  # not the step's last token
                if not fresh or tokens[j] not in tokens[:j]:
                    return ids, tokens[j], j
            position += length
    raise AssertionError("no multi-token step found")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_eos_inside_an_accepted_path(arch):
    model = medusa_tiny(arch)
    ids, eos, position = find_cut(model, fresh=True)
    out = model.generate(ids, max_new_tokens=40, tree="reference", eos_token_id=eos)
    assert out.new_tokens[0][-1] == eos and len(out.new_tokens[0]) == position + 1
    assert torch.equal(out.sequences, hf_greedy(model.base_model, ids, 40, eos_token_id=eos))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_max_new_tokens_inside_an_accepted_path(arch):
    model = medusa_tiny(arch)
    ids, _, position = find_cut(model, fresh=False)
    out = model.generate(ids, max_new_tokens=position + 1, tree="reference", eos_token_id=[])
    assert len(out.new_tokens[0]) == position + 1
    assert torch.equal(out.sequences, hf_greedy(model.base_model, ids, position + 1))


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_batch_rows_equal_their_solo_runs(arch, padding):
    """Rows of a batch (with drafts of different lengths from the lookup branch) decode as alone."""
    model = medusa_tiny(arch)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 3], [5, 5, 5, 5]]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        span = slice(width - len(p), width) if padding == "left" else slice(0, len(p))
        ids[i, span], mask[i, span] = torch.tensor(p), 1
    tree = "reference+lookup4"
    solo = [model.generate(torch.tensor([p]), max_new_tokens=30, tree=tree, eos_token_id=[]) for p in prompts]
    # an end-of-sequence token that makes the rows end at different steps
    ends = [{o.new_tokens[0].index(t) if t in o.new_tokens[0] else 30 for o in solo} for t in range(16)]
    eos = next(t for t in range(16) if len(ends[t]) > 1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, tree=tree, eos_token_id=eos)
    for i, p in enumerate(prompts):
        solo = model.generate(torch.tensor([p]), max_new_tokens=30, tree=tree, eos_token_id=eos)
        assert out.new_tokens[i] == solo.new_tokens[0]
    assert len({len(t) for t in out.new_tokens}) > 1
    if padding == "left":  # transformers' layout: the input as given, then the new tokens, pad after the end
        assert torch.equal(out.sequences, hf_greedy(model.base_model, ids, 30, eos_token_id=eos, attention_mask=mask))


def test_prefill_in_chunks_of_similar_lengths(monkeypatch):
    model = medusa_tiny("qwen2")
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 3], [5, 5, 5, 5], [7, 7]]
    solo = [model.generate(torch.tensor([p]), max_new_tokens=12, tree="reference", eos_token_id=[]) for p in prompts]
    monkeypatch.setattr(decoder_module, "PREFILL_TOKENS", 8)  # groups [10, 7 7], [11 12 3, 5 5 5 5], [3 ... 9]
    assert decoder_module._similar_lengths(prompts) == [[1, 4], [2, 3], [0]]
    ids, mask = decoder_module.pad_batch(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, tree="reference", eos_token_id=[])
    assert out.new_tokens == [s.new_tokens[0] for s in solo]


def test_cancelling_a_row_leaves_the_others_exact():
    model = medusa_tiny("llama")
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    decoder = decoder_module.Decoder(model, Tree.load("reference"))
    rows = [decoder.add(decoder_module.Request(torch.tensor(p), 20, eos_token_id=[]))[0] for p in prompts]
    for _ in range(3):
        decoder.step()
    decoder.cancel(rows[0])  # from outside inference mode, as the server does when a client leaves
    while decoder.busy:
        decoder.step()
    for row, prompt in zip(rows[1:], prompts[1:], strict=True):
        solo = model.generate(torch.tensor([prompt]), max_new_tokens=20, tree="reference", eos_token_id=[])
        assert decoder.progress(row).tokens == solo.new_tokens[0]
    assert decoder.progress(rows[0]).finish_reason == "cancelled"


def test_step_updates_account_for_every_token():
    """What `step` reports is the whole output: each row's updates concatenate to its tokens, its
    accepted lengths are their sizes, and the last one says why it ended; a done row can be forgotten."""
    model = medusa_tiny("llama")
    decoder = decoder_module.Decoder(model, Tree.load("reference+lookup4"))
    rows = decoder.add(decoder_module.Request.batch(torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]]),
                                                    torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), max_new_tokens=25,
                                                    eos_token_id=[]))
    seen = {row: [] for row in rows}
    for updates in decoder.steps():
        for update in updates:
            assert not seen[update.row] or not seen[update.row][-1].finish_reason  # nothing after the end
            seen[update.row].append(update)
    for row in rows:
        progress = decoder.progress(row)
        assert [t for u in seen[row] for t in u.tokens] == progress.tokens and len(progress.tokens) == 25
        assert [len(u.tokens) for u in seen[row]] == progress.accept_lengths
        assert seen[row][-1].finish_reason == progress.finish_reason == "length"
        decoder.forget(row)
    assert decoder._rows == {}
    decoder.add(decoder_module.Request(torch.tensor([3, 4]), 5))
    with pytest.raises(ValueError, match="still decoding"):
        decoder.forget(rows[-1] + 1)
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        decoder.add(decoder_module.Request(torch.tensor([[3, 4]])))


@pytest.mark.parametrize("adapt", [False, True])
def test_each_step_counts_the_tokens_it_verified(adapt):
    """A row's step verifies its tree's nodes (the root and two heads') and its lookup draft (with a fixed
    budget unless adapting): the count that prices a lookup branch (`calibrate.choose_dynamic`)."""
    model = medusa_tiny("llama")
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4, 5, 6], [6, 7, 8, 9, 6, 7, 8, 9, 6]]
    ids, mask = decoder_module.pad_batch(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, tree="chain-2+lookup4", eos_token_id=[],
                         adapt=adapt)
    for prompt, tokens, lengths, verified in zip(prompts, out.new_tokens, out.accept_lengths, out.verified,
                                                 strict=True):
        assert len(verified) == len(lengths) - 1  # one per step after the prefill
        drafts = [len(lookup.continuation(prompt + tokens[: sum(lengths[: i + 1])], 4)) for i in range(len(verified))]
        assert all(v >= 3 for v in verified)
        if not adapt:
            assert verified == [3 + d for d in drafts]
        assert sum(v > 3 for v in verified) == sum(d > 0 for d in drafts) > 0


def with_tokenizer(model):
    model.tokenizer = tiny_tokenizer()
    return model


def test_stop_string_ends_generation_and_is_cut_from_text():
    model = with_tokenizer(medusa_tiny("llama"))
    ids = torch.tensor([[3, 4, 5, 6]])
    full = model.generate(ids, max_new_tokens=40, tree="reference", eos_token_id=[])
    words = full.texts[0].split()
    stop = " ".join(words[5:7])
    out = model.generate(ids, max_new_tokens=40, tree="reference", eos_token_id=[], stop=stop)
    first = full.texts[0].find(stop)
    assert out.texts[0] == full.texts[0][:first]
    assert out.new_tokens[0] == full.new_tokens[0][: len(out.new_tokens[0])]
    assert model.tokenizer.decode(out.new_tokens[0], skip_special_tokens=True).endswith(stop)


def test_stream_yields_the_same_text():
    model = with_tokenizer(medusa_tiny("qwen2"))
    ids = torch.tensor([[3, 4, 5]])
    full = model.generate(ids, max_new_tokens=30, tree="default", eos_token_id=[])
    pieces = list(model.stream(ids, max_new_tokens=30, tree="default", eos_token_id=[]))
    assert len(pieces) > 1 and "".join(pieces) == full.texts[0]
    stop = full.texts[0].split()[4]
    streamed = "".join(model.stream(ids, max_new_tokens=30, tree="default", eos_token_id=[], stop=stop))
    assert streamed == full.texts[0][: full.texts[0].find(stop)]


def test_bad_arguments():
    model = medusa_tiny("llama", num_heads=2)
    ids = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match="4 deep but the model has 2 heads"):
        model.generate(ids, tree="reference")
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="shape"):
        model.generate(torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, stop="x")
    assert generate_module.resolve_tree(model, "auto").paths == Tree.chain(2).paths  # the default is 4 deep
    assert len(model.generate(ids, max_new_tokens=3, eos_token_id=[]).new_tokens[0]) == 3


@pytest.mark.slow
def test_compiled_decoding_equals_eager():
    """torch.compile'd verification passes (dynamic batch, tree size and cache length) give the same tokens,
    in float32: through the speed levers (routed products, grouped attention)."""
    model = medusa_tiny("llama").float()
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 3]]
    ids, mask = decoder_module.pad_batch(prompts)
    eager = {tree: model.generate(ids, attention_mask=mask, max_new_tokens=20, tree=tree, eos_token_id=[])
             for tree in ["plain", "reference", "default+lookup4"]}
    model.compile_decoding()
    for tree, expected in eager.items():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, tree=tree, eos_token_id=[])
        assert out.new_tokens == expected.new_tokens, tree
    solo = model.generate(torch.tensor([prompts[0]]), max_new_tokens=20, tree="reference", eos_token_id=[])
    assert torch.equal(solo.sequences, hf_greedy(model.base_model, torch.tensor([prompts[0]]), 20))
    with torch.compiler.set_stance("fail_on_recompile"):  # one graph serves every tree size and cache length
        repeats = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4, 5, 6]])  # lookup drafts of varying lengths
        for tree in ["default+lookup8", "chain-3", "dense-3x2"]:
            model.generate(repeats, max_new_tokens=30, tree=tree, eos_token_id=[])
