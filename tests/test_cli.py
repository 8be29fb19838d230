"""The `medusa` console command, run as a user would."""

import json
import subprocess
import sys

import pytest

from medusa_heads.cli import COMMANDS, build_parser


def medusa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medusa_heads.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_help_lists_every_subcommand(capsys):
    out = medusa("--help")  # the console command itself, once
    assert out.returncode == 0
    for name in COMMANDS:  # each subcommand's help in this process (a process each costs ~8 s of imports)
        assert name in out.stdout
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([name, "--help"])
        assert exit_.value.code == 0 and "usage: medusa " + name in capsys.readouterr().out


@pytest.mark.slow
def test_generate_json(tiny_folder):
    args = ["generate", "c d e", "--base", str(tiny_folder), "--raw", "--json", "--max-new-tokens", "12",
            "--tree", "chain-3"]
    out = medusa(*args)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert 1 <= result["new_tokens"] <= 12 and result["steps"] <= result["new_tokens"]
    assert result["mean_accepted_length"] >= 1
    assert set(result) == {"text", "new_tokens", "steps", "mean_accepted_length", "tokens_per_second"}
    compiled = medusa(*args, "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert json.loads(compiled.stdout)["text"] == result["text"] and "--compile" in compiled.stderr


@pytest.mark.slow
def test_generate_streams_text(tiny_folder):
    args = ["generate", "c d e", "--base", str(tiny_folder), "--raw", "--max-new-tokens", "8", "--acceptance",
            "exact", "--seed", "1"]
    streamed, whole = medusa(*args), medusa(*args, "--json")
    assert streamed.returncode == 0 == whole.returncode, streamed.stderr + whole.stderr
    text = json.loads(whole.stdout)["text"]
    assert text.strip() and streamed.stdout == text + "\n"  # the pieces add up to the whole answer


@pytest.mark.slow
def test_user_errors_are_one_line_and_exit_2(tiny_folder):
    out = medusa("generate", "c", "--base", str(tiny_folder), "--tree", "nope")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "unknown tree 'nope'" in out.stderr
    out = medusa("generate", "c", "--base", str(tiny_folder), "--heads", str(tiny_folder / "missing"))
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.mark.slow
def test_train_on_the_default_base_builds_fresh_heads(tiny_folder, tmp_path, monkeypatch):
    """Without --heads, `medusa train` makes the heads it is asked for, not the shipped ones."""
    from medusa_heads import MedusaModel, cli, default

    MedusaModel.from_pretrained(str(tiny_folder), num_heads=1).save_pretrained(tmp_path / "shipped")
    monkeypatch.setattr(default, "default_base_dir", lambda: tiny_folder)
    monkeypatch.setattr(default, "shipped_heads_dir", lambda: tmp_path / "shipped")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "a b"},
                                                     {"role": "assistant", "content": "c d e f g"}]}) + "\n"
                            for _ in range(4)))
    out = tmp_path / "heads"
    assert cli.main(["train", "--data", str(data), "--out", str(out), "--num-heads", "2", "--num-layers", "2",
                     "--chained", "--epochs", "1", "--batch-size", "2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_heads"], config["num_layers"], config["next_token"], config["chained"]) == (2, 2, True, True)


def test_export_takes_the_base_recorded_with_the_heads(tiny_folder, tmp_path, capsys):
    from medusa_heads import MedusaModel, cli

    heads = tmp_path / "heads"
    MedusaModel.from_pretrained(str(tiny_folder), num_heads=2).save_pretrained(heads)  # records tiny_folder
    assert cli.main(["export", "--heads", str(heads), "--format", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["hidden_size"] == 32  # not the default's
    config = json.loads((heads / "config.json").read_text())
    del config["base_model"]
    (heads / "config.json").write_text(json.dumps(config))
    assert cli.main(["export", "--heads", str(heads), "--format", "vllm", "--out", str(tmp_path / "again")]) == 2
    assert "records no base model: pass --base" in capsys.readouterr().err


def test_decoding_defaults_agree_across_library_cli_and_server():
    from medusa_heads.decoding import Decoding
    from medusa_heads.serve.schemas import CompletionRequest
    from medusa_heads.settings import from_arguments

    for argv in (["generate", "x"], ["chat"]):  # every option's default is the library's
        assert from_arguments(Decoding, build_parser().parse_args(argv)) == Decoding()
    args = build_parser().parse_args(["generate", "x", "--acceptance", "exact", "--temperature", "0.5", "--top-p",
                                      "0.9", "--max-new-tokens", "9", "--stop", "a", "b", "--seed", "3", "--adapt"])
    assert from_arguments(Decoding, args) == Decoding("exact", 0.5, 0.9, max_new_tokens=9, stop=["a", "b"], seed=3,
                                                      adapt=True)
    server = CompletionRequest(model="m", prompt="p")
    assert (server.temperature, server.top_p, server.seed) == (Decoding.temperature, Decoding.top_p, Decoding.seed)
    # OpenAI's default temperature (the library's too) samples, exactly; temperature 0 is the library's greedy
    assert server.decoding(Decoding.max_new_tokens) == Decoding("exact")
    greedy = CompletionRequest(model="m", prompt="p", temperature=0, stop="x").decoding(Decoding.max_new_tokens)
    assert greedy == Decoding(temperature=0, stop=["x"])


def test_library_refuses_unknown_settings():
    import torch
    from conftest import medusa_tiny

    model = medusa_tiny()
    with pytest.raises(TypeError, match="temprature"):
        model.generate(torch.tensor([[1, 2, 3]]), temprature=0.5)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=0)


def test_train_options_are_the_train_config():
    from dataclasses import asdict

    from medusa_heads.settings import from_arguments
    from medusa_heads.train.trainer import TrainConfig

    args = build_parser().parse_args(["train", "--data", "d", "--out", "o"])
    assert from_arguments(TrainConfig, args) == TrainConfig()  # every default, from the one definition
    args = build_parser().parse_args(["train", "--data", "d", "--out", "o", "--chained", "--no-cache-hidden",
                                      "--warmup-ratio", "0.1", "--mode", "medusa2"])
    changed = {k: v for k, v in asdict(from_arguments(TrainConfig, args)).items() if v != asdict(TrainConfig())[k]}
    assert changed == {"chained": True, "next_token": True, "cache_hidden": False, "warmup_ratio": 0.1,
                       "mode": "medusa2"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--data", "d", "--out", "o", "--projection", "mine"])
