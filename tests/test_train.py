"""Training: labels, loss shifts, frozen backbone, LoRA-only changes, resume after a crash."""

import json

import pytest
import torch
from accelerate import Accelerator
from conftest import tiny_model
from tiny import tiny_tokenizer

from medusa_heads import MedusaModel, adapter
from medusa_heads.train.data import IGNORE, DataError, Example, read_conversations, tokenize
from medusa_heads.train.trainer import HiddenCache, TrainConfig, Trainer, TrainModule


def test_labels_cover_only_assistant_tokens():
    tok = tiny_tokenizer()
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b c"},
                {"role": "assistant", "content": "d e"}, {"role": "user", "content": "f"},
                {"role": "assistant", "content": "g"}]
    ex = tokenize(tok, messages, max_length=100)
    words = tok.convert_ids_to_tokens(ex.input_ids)
    learned = [w for w, label in zip(words, ex.labels, strict=True) if label != IGNORE]
    assert learned == ["d", "e", "</s>", "g", "</s>"]
    assert all(label in (IGNORE, i) for label, i in zip(ex.labels, ex.input_ids, strict=True))
    assert tokenize(tok, messages, max_length=7).input_ids == ex.input_ids[:7]


def test_both_record_forms_and_bad_records(tmp_path):
    good = [{"conversations": [{"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]},
            {"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in good) + "\n{broken\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:3: not valid JSON"):
        read_conversations(path)
    conversations, skipped = read_conversations(path, skip_bad=True)
    assert skipped == 2 and conversations[0] == conversations[1]
    array = tmp_path / "d.json"
    array.write_text(json.dumps([good[0], {"conversations": [{"from": "robot", "value": "x"}]}]))
    with pytest.raises(DataError, match=r"d.json: record 2: turn 0 has unknown role 'robot'"):
        read_conversations(array)


def counting_examples(count: int, length: int = 24, seed: int = 0) -> list[Example]:
    """Sequences that count upward through tokens 6..15 (cyclic): token t+k+2 follows from token t."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        start = int(torch.randint(0, 10, (1,), generator=generator))
        ids = [6 + (start + i) % 10 for i in range(length)]
        examples.append(Example(ids, list(ids)))
    return examples


def tiny_medusa(projection="own", num_heads=3, draft_vocab=0):
    base = tiny_model("llama").float()
    return MedusaModel.from_pretrained(base, num_heads=num_heads, projection=projection, draft_vocab=draft_vocab,
                                       tokenizer=tiny_tokenizer())


@pytest.mark.parametrize("bf16", [False, True])
def test_heads_learn_the_right_offsets(tmp_path, bf16):
    model = tiny_medusa()
    before = {k: v.clone() for k, v in model.base_model.state_dict().items()}
    config = TrainConfig(num_heads=3, epochs=8, lr=1e-2, batch_size=8, checkpoint_every=10_000, bf16=bf16)
    result = Trainer(model, config, tmp_path).fit(counting_examples(96), counting_examples(16, seed=1))
    accuracy = result["history"][-1]["accuracy"]
    assert all(a["top1"] > 0.6 for a in accuracy), accuracy  # chance is 0.1
    # checked without the training code's shift: head k at the last position names token t + k + 2
    seq = torch.tensor([[6, 7, 8, 9, 10, 11]])
    hidden = model.base_model.model(input_ids=seq).last_hidden_state[:, -1]
    guesses = model.heads(hidden).argmax(-1)[:, 0].tolist()
    assert guesses == [13, 14, 15]  # the base model itself would have to say 12
    after = model.base_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # Medusa-1: backbone bit-identical
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["history"][-1]["accuracy"][0]["top1"] == accuracy[0]["top1"]
    reloaded = MedusaModel.from_pretrained(model.base_model, heads=tmp_path)
    assert torch.equal(reloaded.heads(hidden), model.heads(hidden))


def test_next_token_heads_learn_what_follows_the_root(tmp_path):
    """Pairs (r, r + 3): at a position before a random r, only a head that reads r can name r + 3."""
    def pairs(count, seed):
        generator = torch.Generator().manual_seed(seed)
        examples = []
        for _ in range(count):
            ids = [t for r in torch.randint(6, 16, (12,), generator=generator).tolist() for t in (r, 6 + (r - 3) % 10)]
            examples.append(Example(ids, list(ids)))
        return examples

    first_head = {}
    for next_token in (False, True):
        model = MedusaModel.from_pretrained(tiny_model("llama").float(), num_heads=1, projection="shared",
                                            next_token=next_token, tokenizer=tiny_tokenizer())
        config = TrainConfig(num_heads=1, projection="shared", next_token=next_token, epochs=8, lr=1e-2,
                             batch_size=8, checkpoint_every=10_000)
        result = Trainer(model, config, tmp_path / str(next_token)).fit(pairs(96, 0), pairs(16, 1))
        first_head[next_token] = result["history"][-1]["accuracy"][0]["top1"]
    # half the targets follow from the root (the other half are random: 0.1 by chance)
    assert first_head[True] > 0.45 and first_head[False] < 0.3, first_head
    reloaded = MedusaModel.from_pretrained(model.base_model, heads=tmp_path / "True")
    assert reloaded.heads.config.next_token


def test_chained_heads_learn_what_follows_the_path(tmp_path):
    """Triples (5, r, g(r)), r random: from the token before a 5, the second head aims at g(r),
    which only a head that reads r (the first head's target) can name."""
    def triples(count, seed):
        generator = torch.Generator().manual_seed(seed)
        examples = []
        for _ in range(count):
            ids = [t for r in torch.randint(6, 16, (8,), generator=generator).tolist()
                   for t in (5, r, 6 + (r - 3) % 10)]
            examples.append(Example(ids, list(ids)))
        return examples

    second_head = {}
    for chained in (False, True):
        model = MedusaModel.from_pretrained(tiny_model("llama").float(), num_heads=2, projection="shared",
                                            next_token=True, chained=chained, tokenizer=tiny_tokenizer())
        config = TrainConfig(num_heads=2, projection="shared", chained=chained, epochs=8, lr=1e-2, batch_size=8,
                             checkpoint_every=10_000)
        result = Trainer(model, config, tmp_path / str(chained)).fit(triples(96, 0), triples(16, 1))
        second_head[chained] = result["history"][-1]["accuracy"][1]["top1"]
    # knowable: chained, 2 positions of 3 (~0.7); reading the root only, 1 of 3 (~0.4)
    assert second_head[True] > 0.6 and second_head[False] < 0.5, second_head
    reloaded = MedusaModel.from_pretrained(model.base_model, heads=tmp_path / "True")
    assert reloaded.heads.config.chained and reloaded.heads.config.next_token


def test_draft_vocabulary_is_the_most_frequent_answer_tokens(tmp_path):
    model = tiny_medusa(projection="shared", draft_vocab=8)
    config = TrainConfig(num_heads=3, projection="shared", draft_vocab=8, epochs=8, lr=1e-2, batch_size=8,
                         checkpoint_every=10_000)
    train = counting_examples(96)
    train[0].labels[:] = [IGNORE] * 20 + [1, 1, 1, 1]  # token 1: rare, outside the draft vocabulary
    result = Trainer(model, config, tmp_path).fit(train, counting_examples(16, seed=1))
    counts = torch.bincount(torch.tensor([t for e in train for t in e.labels if t != IGNORE]), minlength=16)
    assert set(model.heads.token_map.tolist()) == set(counts.argsort(descending=True, stable=True)[:8].tolist())
    assert 1 not in model.heads.token_map.tolist()
    # two of the ten counting tokens are left out, which caps each head near 8/10
    assert all(0.5 < a["top1"] < 0.9 for a in result["history"][-1]["accuracy"])
    in_map = set(model.heads.token_map.tolist())
    counting = [[6 + (start + i) % 10 for i in range(9)] for start in range(10)]
    sequence = next(s for s in counting if set(s[6:]) <= in_map)  # heads can name its next three tokens
    hidden = model.base_model.model(input_ids=torch.tensor([sequence[:5]])).last_hidden_state[:, -1]
    assert model.heads.propose(hidden, 1)[:, 0, 0].tolist() == sequence[6:]


def test_medusa2_lora_changes_only_adapters_and_heads(tmp_path):
    model = tiny_medusa(projection="shared")
    base_before = {k: v.clone() for k, v in model.base_model.state_dict().items()}
    heads_before = {k: v.clone() for k, v in model.heads.state_dict().items()}
    config = TrainConfig(mode="medusa2", num_heads=3, epochs=2, lr=1e-2, batch_size=8, heads_warmup_steps=2,
                         kl=True, checkpoint_every=10_000)
    Trainer(model, config, tmp_path).fit(counting_examples(32), counting_examples(8, seed=1))
    state = model.base_model.state_dict()
    lora = [k for k in state if "lora_" in k]
    assert lora and any(not torch.equal(state[k], torch.zeros_like(state[k])) for k in lora if "lora_B" in k)
    for key, value in base_before.items():  # every original weight is untouched
        name = key.replace(".weight", ".base_layer.weight") if key not in state else key
        assert torch.equal(state.get(key, state.get(name)), value), key
    assert any(not torch.equal(heads_before[k], v) for k, v in model.heads.state_dict().items())
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    fresh = tiny_model("llama").float()
    loaded = MedusaModel.from_pretrained(fresh, heads=tmp_path)  # applies the adapter found beside the heads
    ids = torch.tensor([[6, 7, 8, 9]])
    assert torch.allclose(loaded.base_model(ids).logits, model.base_model(ids).logits, atol=1e-5)


def test_resume_after_a_crash_gives_the_same_heads(tmp_path, monkeypatch):
    config = TrainConfig(num_heads=2, epochs=3, lr=5e-3, batch_size=4, checkpoint_every=3)
    train, held = counting_examples(20), counting_examples(4, seed=1)
    straight = tiny_medusa(num_heads=2)
    Trainer(straight, config, tmp_path / "straight").fit(train, held)

    calls = {"n": 0}
    forward = TrainModule.forward

    def crash_at_step_8(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt("killed")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TrainModule, "forward", crash_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny_medusa(num_heads=2), config, tmp_path / "crashed").fit(train, held)
    monkeypatch.setattr(TrainModule, "forward", forward)
    position = json.loads((tmp_path / "crashed" / "checkpoint" / "position.json").read_text())
    assert position["global_step"] == 6  # the last checkpoint before the crash
    with pytest.raises(ValueError, match="pass --resume"):
        Trainer(tiny_medusa(num_heads=2), config, tmp_path / "crashed").fit(train, held)
    resumed = tiny_medusa(num_heads=2)
    Trainer(resumed, config, tmp_path / "crashed").fit(train, held, resume=True)
    for key, value in straight.heads.state_dict().items():
        assert torch.equal(resumed.heads.state_dict()[key], value), key
    history = json.loads((tmp_path / "crashed" / "config.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]


def test_unicode_line_separators_inside_strings(tmp_path):
    path = tmp_path / "d.jsonl"
    record = {"messages": [{"role": "user", "content": "a\u2028b\x0cc"}, {"role": "assistant", "content": "d"}]}
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n")
    conversations, _ = read_conversations(path)
    assert conversations[0][0]["content"] == "a\u2028b\x0cc"


def test_hidden_cache_runs_only_conversations_it_has_not_seen(tmp_path):
    model, accelerator = tiny_medusa(), Accelerator(cpu=True)
    first, more = ([counting_examples(1, length=n)[0] for n in lengths] for lengths in (range(20, 25), range(30, 34)))
    cache = HiddenCache(tmp_path, model, accelerator)
    cache.PART = 2
    before = cache.states(model, first, accelerator)
    assert len(list(tmp_path.glob("part-*.safetensors"))) == 3
    body, runs = adapter.decoder(model.base_model), []
    body.register_forward_hook(lambda *_: runs.append(1))
    grown = more[:2] + first[::-1] + more[2:]  # more data, another order
    states = cache.states(model, grown, accelerator)
    assert len(runs) == len(more)
    assert all(torch.equal(a, b) for a, b in zip(states[2:7], before[::-1], strict=True))
    with torch.no_grad():
        expected = body(input_ids=torch.tensor([more[3].input_ids])).last_hidden_state[0].half()
    assert torch.equal(states[-1], expected)


def test_a_second_run_reuses_the_first_runs_hidden_cache(tmp_path):
    train, held = counting_examples(16), counting_examples(8, seed=1)
    config = TrainConfig(num_heads=2, epochs=1, batch_size=8, hidden_cache=str(tmp_path / "states"))
    Trainer(tiny_medusa(num_heads=2), config, tmp_path / "heads").fit(train, held)
    assert list((tmp_path / "states").glob("part-*.safetensors")) and not (tmp_path / "heads" / "hidden-cache").exists()
    model = tiny_medusa(num_heads=2)
    runs = []
    adapter.decoder(model.base_model).register_forward_hook(lambda *_: runs.append(1))
    eagle = TrainConfig(draft="eagle", epochs=1, batch_size=8, hidden_cache=str(tmp_path / "states"))
    Trainer(MedusaModel.from_pretrained(model.base_model, draft="eagle"), eagle, tmp_path / "draft").fit(train, held)
    assert not runs  # every state came from the first run's folder
