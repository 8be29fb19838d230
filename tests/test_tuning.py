"""tree="auto": kernel routes and the tree are probed on this machine, cached, and reused."""

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import randomize_heads
from tiny import tiny_model, tiny_tokenizer

from medusa_heads import MedusaModel, Tree, speed, tuning
from medusa_heads.calibrate import Record, record_answers

PROMPT = torch.tensor([[3, 4, 5]])


@pytest.fixture
def probing(monkeypatch, tmp_path):
    """The probe on, with a cache of its own."""
    monkeypatch.setenv("MEDUSA_HEADS_TUNE", "1")
    monkeypatch.setenv("MEDUSA_HEADS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tuning"


def float_tiny(seed: int = 0) -> MedusaModel:
    """A tiny float32 Llama with random heads: its linear layers take the routed products."""
    base = tiny_model("llama", seed=seed, dtype=torch.float32)
    return randomize_heads(MedusaModel.from_pretrained(base, num_heads=3))


def recorded(model: MedusaModel) -> MedusaModel:
    model.record = record_answers(model, [PROMPT, torch.tensor([[6, 7, 8, 9]])], max_new_tokens=16)
    return model


def test_routes_by_rows_and_dtype():
    routes = speed.Routes((1, 4, 16), {"torch.float32": ("aten", "packed", "aten")})
    assert [routes.route(rows, torch.float32, 1000) for rows in (1, 2, 4, 5, 16, 500)] == [
        "aten", "packed", "packed", "aten", "aten", "aten"]
    assert routes.route(3, torch.bfloat16, 1000) == "aten"  # not probed: the unprobed default
    assert speed.Routes().route(3, torch.float32, 1000) == "packed"
    assert speed.Routes.from_json(json.loads(json.dumps(routes.to_json()))) == routes


def test_packed_copies_are_rented_until_packing_would_have_paid():
    times = {"aten": (1.0, 30.0), "stream": (0.5, 40.0), "packed": (2.0, 20.0)}  # ms for all products
    routes = speed.Routes((1, 16), {"torch.float32": ("stream", "packed")}, {"torch.float32": times},
                          packing={"torch.float32": (25.0, 1000)})  # 25 ms to pack 1000 elements
    assert routes.route(1, torch.float32, 1000) == "stream"  # not packed: nothing to rent
    # a pass of 16 rows over all 1000 elements loses 10 ms by aten: two passes rent, the third packs
    assert [routes.route(16, torch.float32, 1000) for _ in range(3)] == ["aten", "aten", "packed"]
    assert routes.route(16, torch.float32, 250) == "packed"  # packed once bought
    assert routes.lost == {"torch.float32": 30.0}
    # charged by its share of the elements: 40 products of a quarter of them each lose as much as 10 passes
    fresh = speed.Routes.from_json(json.loads(json.dumps(routes.to_json())))
    assert fresh == routes and fresh.lost == {}
    assert [fresh.route(16, torch.float32, 250) for _ in range(10)] == ["aten"] * 9 + ["packed"]


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
def test_probe_times_the_packing_and_leaves_nothing_to_rent():
    model = float_tiny()
    speed.install(model)
    routes = speed.probe_routes(model, widths=(1, 16), rounds=1)
    ms, elements = routes.packing["torch.float32"]
    assert ms > 0 and elements == sum(weight.numel() for weight, _ in speed._products(model))
    assert routes.lost["torch.float32"] == ms  # its copies are made: packed products take them at once


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
def test_decoding_takes_the_route_chosen_for_its_rows(monkeypatch):
    model = float_tiny()
    taken = []
    for name, fn in dict(speed.ROUTES).items():  # the real routes, recording the rows they took
        def spy(x, w, b, name=name, fn=fn):
            taken.append((x.numel() // x.shape[-1], name))
            return fn(x, w, b)

        monkeypatch.setitem(speed.ROUTES, name, spy)
    plain = model.generate(PROMPT, max_new_tokens=12, tree="plain").sequences
    monkeypatch.setattr(tuning, "tuning", lambda model, refresh=False: tuning.Tuning(
        {}, speed.Routes((1, 3), {"torch.float32": ("aten", "packed")}), None, None, None, 0.0))
    taken.clear()
    out = model.generate(PROMPT, max_new_tokens=12, tree="chain-2")
    assert torch.equal(out.sequences, plain)
    assert {name for rows, name in taken if rows == 1} == {"aten"}  # the heads' products over one state
    assert {name for rows, name in taken if rows > 1} == {"packed"}  # prefill (3 tokens) and the 3-node passes


@pytest.mark.skipif(not speed.ENABLED, reason="packed weights switched off or oneDNN missing")
def test_probe_picks_the_faster_route(monkeypatch):
    model = float_tiny()
    speed.install(model)
    real = speed.ROUTES["packed"]

    def slow_when_wide(x, w, b):  # packed made slower than aten beyond 4 rows
        if x.shape[0] > 4:
            time.sleep(1e-3)
        return real(x, w, b)

    for route in ("stream", "columns"):  # two routes left, of known speeds
        monkeypatch.delitem(speed.ROUTES, route)
    monkeypatch.setitem(speed.ROUTES, "packed", slow_when_wide)
    monkeypatch.setitem(speed.ROUTES, "aten", lambda x, w, b: time.sleep(5e-4) or torch.nn.functional.linear(x, w, b))
    routes = speed.probe_routes(model, widths=(1, 4, 16), rounds=3)
    assert routes.choice["torch.float32"] == ("packed", "packed", "aten")
    packed, aten = routes.times["torch.float32"]["packed"], routes.times["torch.float32"]["aten"]
    assert packed[0] < aten[0] and packed[2] > aten[2]
    assert "float32 packed" in routes.table()


def test_probe_chooses_a_tree_caches_it_and_a_second_process_reuses_it(probing, monkeypatch):
    model = recorded(float_tiny())
    out = model.generate(PROMPT, max_new_tokens=20)  # tree="auto"
    tuned = model.tuning
    assert tuned.tree is not None and tuned.tree.name == "auto" and not tuned.cached
    assert tuned.cost_curve["tokens"][0] == 1 and len(tuned.table) > 1
    assert "routes by rows" in tuned.summary() and "tree" in tuned.summary()
    assert torch.equal(out.sequences, model.generate(PROMPT, max_new_tokens=20, tree="plain").sequences)
    assert tuning.cache_file(tuning.machine(model)).exists()

    again = float_tiny(seed=1)  # another process's model: same machine, model, dtype and heads
    again.record = model.record
    monkeypatch.setattr(tuning, "probe", lambda *a: pytest.fail("probed again despite the cache"))
    assert tuning.tuning(again).cached
    assert again.tuning.tree.paths == tuned.tree.paths and again.tuning.routes == tuned.routes


def test_another_record_or_machine_probes_again(probing, monkeypatch):
    model = recorded(float_tiny())
    files = {tuning.cache_file(tuning.tuning(model).machine)}
    model.record = Record(model.record.accuracy_top_r, model.record.targets, model.record.answers[:1], 16)
    files.add(tuning.cache_file(tuning.tuning(model).machine))  # other heads' record: another key
    monkeypatch.setattr(tuning, "cpu_info", lambda: ("Some Other CPU", frozenset({"avx2"})))
    assert tuning.tuning(model).machine["cpu"] == "Some Other CPU"
    files.add(tuning.cache_file(model.tuning.machine))
    assert len(files) == 3 and all(file.exists() for file in files)


def test_tuning_off_gives_the_shipped_tree(monkeypatch):
    monkeypatch.setenv("MEDUSA_HEADS_TUNE", "0")
    model = float_tiny()
    model.generate(PROMPT, max_new_tokens=4)
    assert model.tuning is None
    from medusa_heads.generate import resolve_tree

    assert resolve_tree(model, "auto").paths == Tree.load("default").paths


def test_record_travels_with_the_heads(tmp_path):
    model = recorded(float_tiny())
    model.save_pretrained(tmp_path / "heads")
    loaded = MedusaModel.from_pretrained(tiny_model("llama", dtype=torch.float32), heads=tmp_path / "heads")
    assert loaded.record == model.record


@pytest.mark.slow
def test_calibrate_probe_command(probing, tmp_path):
    base = tmp_path / "base"
    tiny_model("llama").float().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    command = [sys.executable, "-m", "medusa_heads.cli", "calibrate", "--probe", "--base", str(base)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tuning (probed in" in out.stderr and "routes by rows" in out.stderr and "float32 aten" in out.stderr
    assert len(list(probing.glob("*.json"))) == 1
