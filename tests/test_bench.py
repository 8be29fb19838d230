"""The benchmark on a tiny model with two questions: schema, self speed-up, mismatch detection."""

import json

import pytest
from conftest import medusa_tiny
from tiny import tiny_tokenizer

from medusa_heads.bench import Method, bench, load_questions


class WrongMethod(Method):
    """Plain decoding with one token changed: the bench must report it."""

    def run(self, ids, max_new_tokens):
        tokens, steps, lengths, seconds = super().run(ids, max_new_tokens)
        return [(tokens[0] + 1) % 16, *tokens[1:]], steps, lengths, seconds


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    questions = out / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["c d e", "f g"]},
        {"question_id": 2, "category": "math", "turns": ["h i j"]},
    ]) + "\n")
    model = medusa_tiny("llama")
    model.tokenizer = tiny_tokenizer()
    methods = ["hf", "hf-pld", "plain", "medusa", "medusa:reference", WrongMethod("plain", model)]
    methods[-1].name = "wrong"
    return bench(model, load_questions(questions), methods, out / "run", max_new_tokens=12), out / "run"


def test_files_and_schema(result):
    _, out = result
    assert {p.name for p in out.iterdir()} >= {"results.json", "report.md", "speedup.png", "accepted_lengths.png",
                                                 "head_accuracy.png"}
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) == {"records", "settings", "summary", "environment", "head_accuracy"}
    assert len(saved["records"]) == 3 * 6  # 3 turns x 6 methods
    record = saved["records"][0]
    assert set(record) >= {"question_id", "category", "turn", "method", "new_tokens", "seconds", "tokens_per_second",
                           "steps", "accept_lengths", "tokens"}
    assert saved["environment"]["torch"] and saved["settings"]["max_new_tokens"] == 12
    assert set(saved["summary"]["methods"]["medusa"]) == {"overall", "writing", "math"}


def test_reference_speedup_is_one(result):
    res, _ = result
    for category, s in res["summary"]["methods"]["hf"].items():
        assert s["speedup"] == 1.0, category
    assert res["summary"]["methods"]["plain"]["overall"]["mean_accepted_length"] == 1.0


def test_greedy_methods_match_and_wrong_is_reported(result):
    res, out = result
    mismatched = {(m["method"], m["question_id"], m["turn"]) for m in res["summary"]["mismatches"]}
    assert mismatched == {("wrong", 1, 0), ("wrong", 1, 1), ("wrong", 2, 0)}
    assert "wrong differs on question 1 turn 0 from token 0" in (out / "report.md").read_text()


def test_question_selection(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "ab"[i % 2], "turns": ["x"]})
                              for i in range(10)))
    assert [q["question_id"] for q in load_questions(path, per_category=2)] == [0, 1, 2, 3]
    assert [q["question_id"] for q in load_questions(path, limit=3, per_category=2)] == [0, 1, 2]


def test_bad_question_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a Spec-Bench question"):
        load_questions(bad)


def test_load_bench(tmp_path):
    from medusa_heads.bench import load_bench, load_markdown

    model = medusa_tiny("llama")
    model.tokenizer = tiny_tokenizer()
    questions = [{"question_id": i, "category": "x", "turns": [t]} for i, t in enumerate(["c d e", "f g", "h"])]
    result = load_bench(model, questions, [1, 3], max_new_tokens=10, tree="reference")
    assert [(r["batch_size"], r["method"]) for r in result["rows"]] == [(1, "plain"), (1, "medusa"), (3, "plain"),
                                                                        (3, "medusa")]
    assert all(r["identical_to_plain"] for r in result["rows"] if r["method"] == "medusa")
    assert result["rows"][0]["mean_accepted_length"] == 1.0 and result["rows"][1]["mean_accepted_length"] > 1.0
    assert "| 3 | medusa |" in load_markdown(result)


def test_suite_rows_hold_unseen_prompts_of_each_task_type(tmp_path):
    from medusa_heads.suite import suite_questions

    records = [{"id": "t1", "category": "translation", "turns": ["Translate: chat"]},
               {"id": "t2", "category": "translation", "turns": ["Translate: chien", "and more"]},
               {"id": "t3", "category": "translation", "turns": ["Translate: oiseau"]},
               {"id": "s1", "category": "summarization", "turns": ["Summarize: ..."]},
               {"id": "q0", "category": "qa", "source": "trivia", "turns": ["Who?"]},  # no passage: not passage-qa
               {"id": "x1", "category": "extraction", "source": "x (passage)", "turns": ["List the names: ..."]},
               {"id": "q1", "category": "stem", "source": "x (passage; template)", "turns": ["Read: ... Who?"]},
               {"id": "m1", "category": "math", "turns": ["3 apples..."]},
               {"id": "c1", "category": "coding", "turns": ["Write a function"]}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    mt_bench = tmp_path / "mt.jsonl"
    mt_bench.write_text("\n".join(json.dumps({"question_id": i, "category": "ab"[i // 2], "turns": [f"q{i}", "next"]})
                                  for i in range(4)) + "\n")
    questions = suite_questions(prompts, mt_bench, per_category=1, exclude={"t1"})
    assert [(q["category"], q["question_id"], q["turns"]) for q in questions] == [
        ("translation", "t2", ["Translate: chien"]), ("summarization", "s1", ["Summarize: ..."]),
        ("passage-qa", "q1", ["Read: ... Who?"]), ("math", "m1", ["3 apples..."]), ("code", "c1", ["Write a function"]),
        ("mt-bench", 0, ["q0"])]
    with pytest.raises(ValueError, match="fewer than 2 prompts left for summarization, passage-qa, math, code"):
        suite_questions(prompts, None, per_category=2)
    for name in ("s", "q", "m", "c"):  # a second prompt of every type
        records.append({**next(r for r in records if r["id"] == f"{name}1"), "id": f"{name}2"})
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    questions = suite_questions(prompts, mt_bench, per_category=2)
    assert [q["question_id"] for q in questions if q["category"] == "translation"] == ["t1", "t2"]
    assert [q["question_id"] for q in questions if q["category"] == "mt-bench"] == [0, 2]  # one of each category
