"""Self-distillation through the CLI: multi-turn answers, and a SIGKILL mid-run loses nothing."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from medusa_heads import MedusaModel
from medusa_heads.train.data import DataError
from medusa_heads.train.distill import LocalAnswerer, completed_ids, distill, read_prompts, save_answers


def write_prompts(path, count):
    letters = "abcdefghij"
    with open(path, "w") as f:
        for i in range(count):
            turns = [" ".join(letters[(i + j) % 10] for j in range(3))]
            if i % 3 == 0:
                turns.append("j i")
            f.write(json.dumps({"id": f"p{i}", "turns": turns}) + "\n")


def check_output(path, count):
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["id"] for r in records) == sorted(f"p{i}" for i in range(count))  # each exactly once
    for r in records:
        i = int(r["id"][1:])
        roles = [t["from"] for t in r["conversations"]]
        assert roles == (["human", "gpt"] * (2 if i % 3 == 0 else 1))


@pytest.mark.slow
def test_multi_turn_answers_see_the_model_s_own_history(tmp_path, tiny_folder):
    model = MedusaModel.from_pretrained(tiny_folder, num_heads=2)
    prompts_file, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    write_prompts(prompts_file, 4)
    answer = LocalAnswerer(model, max_new_tokens=6, temperature=0.0, batch_size=3)
    assert distill(read_prompts(prompts_file), answer, out, progress=False) == 4
    check_output(out, 4)
    record = next(json.loads(line) for line in out.read_text().splitlines() if json.loads(line)["id"] == "p0")
    first = record["conversations"][:2]
    chat = [{"role": "user", "content": first[0]["value"]}, {"role": "assistant", "content": first[1]["value"]},
            {"role": "user", "content": "j i"}]
    expected = model.generate(model.chat_ids(chat), max_new_tokens=6, tree="plain").texts[0].strip()
    assert record["conversations"][3]["value"] == expected
    assert distill(read_prompts(prompts_file), answer, out, progress=False) == 0  # nothing left to do


def test_a_torn_last_line_is_cut_and_redone(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "p0", "conversations": []}\n{"id": "p1", "conv')
    assert completed_ids(out) == {"p0"}
    assert out.read_text() == '{"id": "p0", "conversations": []}\n'


class Unasked:
    """An answerer for runs where every answer must come from the answers file."""

    def has_room(self):
        return True

    def submit(self, key, chat):
        raise AssertionError(f"{key} was asked again")


def test_answers_alone_rebuild_the_distilled_file(tmp_path):
    prompts_file, out, answers = tmp_path / "p.jsonl", tmp_path / "out.jsonl", tmp_path / "answers.jsonl.gz"
    write_prompts(prompts_file, 4)
    prompts = read_prompts(prompts_file)
    records = [{"id": key, "conversations": [m for j, turn in enumerate(turns) for m in (
        {"from": "human", "value": turn}, {"from": "gpt", "value": f"answer {j} to {key}"})]} for key, turns in prompts]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert save_answers(out, answers) == 4
    assert "a b c" not in gzip.decompress(answers.read_bytes()).decode()  # no prompt text
    out.unlink()
    assert distill(prompts, Unasked(), out, progress=False, answers=answers) == 0
    assert sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["id"]) == records
    fewer = tmp_path / "fewer.jsonl"  # a run over fewer prompts restores those and keeps every answer
    assert distill(prompts[:2], Unasked(), fewer, progress=False, answers=answers) == 0
    assert len(fewer.read_text().splitlines()) == 2
    assert distill(prompts, Unasked(), tmp_path / "all.jsonl", progress=False, answers=answers) == 0
    assert sorted((tmp_path / "all.jsonl").read_text().splitlines()) == sorted(out.read_text().splitlines())
    other = [(key, turns[:1]) for key, turns in prompts]  # p0 had two turns
    with pytest.raises(DataError, match="2 answers for the 1 turns of prompt 'p0'"):
        distill(other, Unasked(), tmp_path / "fresh.jsonl", progress=False, answers=answers)


def test_bad_prompt_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "turns": ["a"]}\n{"id": 1, "turns": ["b"]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: duplicate id '1'"):
        read_prompts(bad)
    bad.write_text('{"turns": []}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: needs a non-empty list"):
        read_prompts(bad)
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "a b"}]}]))
    assert read_prompts(sharegpt) == [("x", ["a b"])]


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_completes_exactly_once(tmp_path, tiny_folder):
    prompts_file, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    count = 120
    write_prompts(prompts_file, count)
    command = [sys.executable, "-m", "medusa_heads.cli", "distill", "--base", str(tiny_folder), "--prompts",
               str(prompts_file), "--out", str(out), "--batch-size", "1", "--max-new-tokens", "48"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 5:
            break
        time.sleep(0.02)
    assert process.poll() is None, "distillation finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    written = out.read_text().count("\n")
    assert 5 <= written < count
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{count - written} prompts answered, {count} in all" in rerun.stdout
    check_output(out, count)
    straight = tmp_path / "straight.jsonl"  # the same prompts, never interrupted: the same answers
    subprocess.run([*command[:-5], str(straight), *command[-4:]], check=True, capture_output=True, timeout=300)
    answers = {path: {r["id"]: r["conversations"] for r in map(json.loads, path.read_text().splitlines())}
               for path in (out, straight)}
    assert answers[out] == answers[straight]
