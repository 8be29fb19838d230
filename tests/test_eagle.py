"""The EAGLE-style draft: exact greedy and sampled output over its dynamic trees, training, saving, loading."""

import json

import pytest
import torch
from conftest import ARCHS, hf_greedy, randomize_heads, tiny_model
from test_exact import REPEATING, chi_square_p, exact_joint, sampled_counts
from tiny import tiny_tokenizer

from medusa_heads import MedusaModel, adapter, eagle
from medusa_heads import decoder as decoder_module
from medusa_heads.decoder import Request
from medusa_heads.io import export_heads
from medusa_heads.train.data import IGNORE, Example
from medusa_heads.train.trainer import TrainConfig, Trainer
from medusa_heads.tree import DynamicTree, StepTree, Tree


def eagle_tiny(arch: str = "llama", seed: int = 0) -> MedusaModel:
    """A tiny random model with a fresh (randomly initialised) EAGLE-style draft."""
    torch.manual_seed(seed + 1)
    return MedusaModel.from_pretrained(tiny_model(arch, seed=seed), draft="eagle")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_plain_decoding(arch):
    model = eagle_tiny(arch)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 3]]
    ids, mask = decoder_module.pad_batch(prompts)
    for tree in ("dynamic-10x3x3", "dynamic-5x1x4", "dynamic-6x2x2+lookup4"):
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=30, tree=tree, eos_token_id=[])
        for i, p in enumerate(prompts):
            reference = hf_greedy(model.base_model, torch.tensor([p]), 30)[0, len(p):].tolist()
            solo = model.generate(torch.tensor([p]), max_new_tokens=30, tree=tree, eos_token_id=[])
            assert solo.new_tokens[0] == batch.new_tokens[i] == reference, (tree, i)
        assert max(max(a) for a in batch.accept_lengths) >= 2  # candidates were accepted


def test_rows_join_leave_and_finish_at_different_steps():
    model = eagle_tiny("qwen2")
    tree = DynamicTree(8, 3, 3)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    solo = [model.generate(torch.tensor([p]), max_new_tokens=20, tree=tree, eos_token_id=[]).new_tokens[0]
            for p in prompts]
    eos = next(t for t in range(16) if len({s.index(t) if t in s else 20 for s in solo}) > 1)
    decoder = decoder_module.Decoder(model, tree)
    rows = [decoder.add(Request(torch.tensor(p), 20, eos_token_id=eos))[0] for p in prompts[:2]]
    for _ in range(3):
        decoder.step()
    rows += decoder.add(Request(torch.tensor(prompts[2]), 20, eos_token_id=eos))
    decoder.step()
    cancelled = next(i for i, r in enumerate(rows) if decoder.progress(r).finish_reason is None)
    decoder.cancel(rows[cancelled])
    rows += decoder.add(Request(torch.tensor(prompts[3]), 20, eos_token_id=eos))
    while decoder.busy:
        decoder.step()
    for i in {0, 1, 2, 3} - {cancelled}:
        expected = model.generate(torch.tensor([prompts[i]]), max_new_tokens=20, tree=tree, eos_token_id=eos)
        assert decoder.progress(rows[i]).tokens == expected.new_tokens[0]
    assert decoder.progress(rows[cancelled]).finish_reason == "cancelled"


def test_each_node_holds_what_the_draft_predicts_from_real_features(monkeypatch):
    """Every node of every step's tree is among its parent's top-k as the draft computes it with no cache:
    one causal pass over the real entries (the base's feature at each position with the token after it),
    then the draft's own guesses along the node's path; so the draft's cache, positions, masks and the
    features handed over after each verification are those training sees."""
    model = randomize_heads(eagle_tiny("llama"))  # large weights: any change to what a node sees shows
    with torch.no_grad():  # and tokens that weigh as much as features (the base's embeddings are tiny)
        model.base_model.get_input_embeddings().weight.mul_(50)
    draft, shape, prompt = model.heads, DynamicTree(10, 3, 3), [3, 4, 5, 6, 7]
    seen: list[tuple[list[int], StepTree]] = []
    grow = eagle.Drafting.tree

    def recording(self, root):
        step = grow(self, root)
        seen.append((prompt + decoder.progress(0).tokens, step))
        return step

    monkeypatch.setattr(eagle.Drafting, "tree", recording)
    decoder = decoder_module.Decoder(model, shape)
    decoder.add(Request(torch.tensor(prompt), 12, eos_token_id=[]))
    for _ in decoder.steps():
        pass
    assert len(seen) >= 3
    body = adapter.decoder(model.base_model)
    for text, step in seen:  # text: the committed tokens and the root (the last one)
        with torch.no_grad():
            features = body(input_ids=torch.tensor([text[:-1]])).last_hidden_state  # f_0 .. f_{L-1}
        tokens, parents = step.tokens[0].tolist(), step.parents[0].tolist()
        for node in range(len(tokens)):
            path = [node]
            while path[-1]:
                path.append(parents[path[-1]])
            feats, after = features, torch.tensor([text[1:]])
            with torch.no_grad():
                for ancestor in path[-2::-1]:  # the node's path below the root, each guess fed back
                    guess = draft(feats, after, torch.arange(after.shape[1])[None])[:, -1:]
                    feats = torch.cat([feats, guess], 1)
                    after = torch.cat([after, torch.tensor([[tokens[ancestor]]])], 1)
                guess = draft(feats, after, torch.arange(after.shape[1])[None])[0, -1]
            best = set(draft.logits(guess).topk(shape.topk).indices.tolist())
            children = {tokens[c] for c in range(len(tokens)) if c and parents[c] == node}
            assert children <= best, (text, node)


@pytest.mark.parametrize("tree", ["dynamic-8x2x4", "dynamic-20x2x16"])
def test_exact_sampling_matches_the_base_distribution(tree):
    model = eagle_tiny("llama", seed=3).float()
    counts, from_tree = sampled_counts(model, "exact", 1.0, 1.0, tree=tree)
    assert from_tree > 0.1
    assert chi_square_p(counts, exact_joint(model.base_model, 1.0, 1.0)) > 1e-3


def test_exact_sampling_with_a_lookup_branch_matches_the_base_distribution():
    """The lookup draft repeats one of the draft's depth-1 guesses (they cover the vocabulary): that token
    must not count twice (see test_exact)."""
    model = eagle_tiny("llama", seed=3).float()
    counts, _ = sampled_counts(model, "exact", 0.1, 1.0, REPEATING, "dynamic-17x1x16+lookup2")
    assert chi_square_p(counts, exact_joint(model.base_model, 0.1, 1.0, REPEATING)) > 1e-3


def test_step_trees_from_parents():
    parents = torch.tensor([[0, 0, 0, 1, 3], [0, 0, 1, 2, 0]])
    step = StepTree.from_parents(torch.zeros_like(parents), parents, depth=3)
    assert step.depths.tolist() == [[0, 1, 1, 2, 3], [0, 1, 2, 3, 1]]
    assert step.retrieve[0, 4].tolist() == [0, 1, 3, 4] and step.retrieve[1, 4].tolist() == [0, 4, -1, -1]
    assert step.mask[1, 3].tolist() == [True, True, True, True, False]
    chained = step.with_chain(torch.tensor([[7, 8], [9, 10]]), reach=3)
    assert chained.parents[0].tolist() == [0, 0, 0, 1, 3, 0, 5] and chained.depths[1, 5:].tolist() == [1, 2]
    assert chained.retrieve[1, 6].tolist() == [0, 5, 6, -1]
    assert Tree.load("dynamic-8x2x4+lookup6").size == 14 and Tree.load("dynamic-8x2x4+lookup0").lookup == 0


def test_trees_and_drafts_must_match():
    medusa = MedusaModel.from_pretrained(tiny_model("llama"), num_heads=2)
    with pytest.raises(ValueError, match="grown by an EAGLE-style draft"):
        medusa.generate(torch.tensor([[3, 4]]), max_new_tokens=4, tree="dynamic-8x2x4")
    model = eagle_tiny()
    with pytest.raises(ValueError, match="grows its own tree"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=4, tree="chain-2")
    with pytest.raises(ValueError, match="adapt"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=4, tree="dynamic-8x2x4", adapt=True)
    assert model.generate(torch.tensor([[3, 4]]), max_new_tokens=4, tree="plain").new_tokens[0] == (
        hf_greedy(model.base_model, torch.tensor([[3, 4]]), 4)[0, 2:].tolist())
    with pytest.raises(ValueError, match="2 <= tokens <= 13"):
        Tree.load("dynamic-14x2x3")
    with pytest.raises(ValueError, match="frozen backbone"):
        TrainConfig(draft="eagle", mode="medusa2")
    with pytest.raises(ValueError, match="Medusa heads only"):
        export_heads(model.heads, "unused", "vllm")


def self_distilled(base, count: int, seed: int) -> tuple[list[Example], torch.Tensor]:
    """The base model's own greedy answers to random prompts, as training examples (answers labelled)."""
    prompts = torch.randint(3, 16, (count, 4), generator=torch.Generator().manual_seed(seed))
    out = hf_greedy(base, prompts, 40)
    return [Example(o.tolist(), [IGNORE] * 4 + o[4:].tolist()) for o in out], prompts


def test_a_trained_draft_accepts_more_and_round_trips(tmp_path):
    base = tiny_model("llama").float()
    train, _ = self_distilled(base, 128, seed=0)
    held_out, prompts = self_distilled(base, 16, seed=1)
    model = MedusaModel.from_pretrained(base, draft="eagle", draft_vocab=12, tokenizer=tiny_tokenizer())
    tree = "dynamic-12x4x3"

    def decode(m):
        out = m.generate(prompts, max_new_tokens=40, tree=tree, eos_token_id=[])
        assert torch.equal(out.sequences, hf_greedy(base, prompts, 40))
        return out

    untrained = decode(model).mean_accepted_length
    config = TrainConfig(draft="eagle", draft_vocab=12, epochs=10, lr=3e-3, batch_size=8, checkpoint_every=10_000)
    history = Trainer(model, config, tmp_path).fit(train, held_out)["history"]
    assert history[-1]["accuracy"][0]["top1"] > 0.6  # the token after next, from the base's features
    trained = decode(model)
    assert trained.mean_accepted_length > max(1.8, untrained + 0.5), (untrained, trained.mean_accepted_length)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["kind"] == "eagle" and saved["draft_vocab"] == 12
    reloaded = MedusaModel.from_pretrained(base, heads=tmp_path)
    assert torch.equal(reloaded.heads.token_map, model.heads.token_map)
    assert decode(reloaded).accept_lengths == trained.accept_lengths


def test_auto_chooses_a_recorded_dynamic_tree_by_its_cost_here(monkeypatch, tmp_path):
    """The accepted length of each shape is recorded once; the probe of a machine times each shape and picks
    the best accepted length per cost: with costs made up here, the pick follows them."""
    from medusa_heads import calibrate, speed, tuning
    from medusa_heads.generate import resolve_tree

    model = eagle_tiny("llama")
    prompts = [torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8, 9]])]
    shapes = ("dynamic-3x2x1", "dynamic-8x3x3")
    record = calibrate.record_dynamic(model, prompts, max_new_tokens=16, shapes=shapes)
    for name in shapes:  # greedy decoding with the shape accepts what the record says
        outs = [model.generate(p, max_new_tokens=16, tree=name) for p in prompts]
        assert record.accepted_length[name] == sum(len(o.new_tokens[0]) for o in outs) / sum(o.steps for o in outs)
        assert record.verified[name] == Tree.load(name).tokens  # every step verifies the shape's nodes
    record.accepted_length = {"dynamic-3x2x1": 1.5, "dynamic-8x3x3": 2.0}
    folder = tmp_path / "draft"  # the record goes with the draft, as `medusa calibrate` saves it
    model.record = record
    model.save_pretrained(folder)
    reloaded = MedusaModel.from_pretrained(model.base_model, heads=folder)
    assert reloaded.record == record
    monkeypatch.setenv("MEDUSA_HEADS_TUNE", "1")
    monkeypatch.setenv("MEDUSA_HEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(speed, "probe_routes", lambda *a, **k: speed.Routes())  # (not what this test is about)
    for cost, expected in (((1.2, 1.4), "dynamic-8x3x3"), ((1.0, 1.9), "dynamic-3x2x1")):
        monkeypatch.setattr(calibrate, "cost_curve", lambda *a, cost=cost, **k: list(cost))
        reloaded.tuning = None
        chosen = tuning.tuning(reloaded, refresh=True).tree
        assert chosen.name == expected
        assert resolve_tree(reloaded, "auto") == chosen
    cached = tuning.Tuning.from_json(json.loads(json.dumps(tuning.tuning(reloaded).to_json())))
    assert cached.tree == DynamicTree.parse("dynamic-3x2x1")


def test_a_lookup_branch_is_priced_by_the_tokens_it_verified(monkeypatch):
    """A shape's lookup branch drafts nothing on the probe's prompt, so it costs its shape's timed step plus
    what the verification ladder says its recorded lookup tokens cost; a branch that verifies many tokens
    for few accepted ones loses to its shape alone."""
    from medusa_heads import calibrate

    model = eagle_tiny("llama")
    prompts = [torch.tensor([REPEATING]), torch.tensor([[6, 7, 8, 9, 6, 7, 8, 9, 6]])]
    record = calibrate.record_dynamic(model, prompts, max_new_tokens=16, shapes=("dynamic-3x2x1",
                                                                                "dynamic-3x2x1+lookup4"))
    outs = [model.generate(p, max_new_tokens=16, tree="dynamic-3x2x1+lookup4") for p in prompts]
    assert record.verified["dynamic-3x2x1+lookup4"] == sum(sum(o.verified[0]) for o in outs) / sum(
        len(o.verified[0]) for o in outs) > 3
    timed = calibrate.timed_shapes(record)
    assert timed[0] == DynamicTree.parse("dynamic-3x2x1") and len(timed) == 1 + len(calibrate.VERIFY_LADDER)

    def made_up(model, ids, shapes, *args, **kwargs):  # 1.3 for the shape, 0.1 per token on the ladder
        assert shapes == timed
        return [1.3] + [1.0 + 0.1 * n for n in calibrate.VERIFY_LADDER]

    monkeypatch.setattr(calibrate, "cost_curve", made_up)
    record.verified["dynamic-3x2x1+lookup4"] = 5.0
    for accepted, expected in ((2.0, "dynamic-3x2x1+lookup4"), (1.7, "dynamic-3x2x1")):
        record.accepted_length = {"dynamic-3x2x1": 1.6, "dynamic-3x2x1+lookup4": accepted}
        result = calibrate.choose_dynamic(model, record, prompts[0])
        assert result["table"][1]["cost"] == pytest.approx(1.3 + 0.1 * (5 - 3))
        assert result["tree"].name == expected  # 2.0 / 1.5 beats 1.6 / 1.3; 1.7 / 1.5 does not
    monkeypatch.undo()
    timed_here = calibrate.choose_dynamic(model, record, prompts[0], steps=1, rounds=1)  # the ladder runs here
    assert [row["tree"] for row in timed_here["table"]] == list(record.accepted_length)


def test_an_outdated_dynamic_record_is_ignored_with_a_warning(tmp_path):
    model = eagle_tiny("llama")
    model.save_pretrained(tmp_path)
    (tmp_path / "dynamic.json").write_text(json.dumps({"accepted_length": {"dynamic-3x2x1": 1.5}, "prompts": 1,
                                                       "max_new_tokens": 8}))  # as recorded before `verified`
    with pytest.warns(UserWarning, match="run `medusa calibrate --heads"):
        reloaded = MedusaModel.from_pretrained(model.base_model, heads=tmp_path)
    assert reloaded.record is None
