"""`medusa train` under torchrun with two CPU processes (gloo); the heads it writes load."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from medusa_heads import MedusaModel

pytestmark = pytest.mark.slow


def test_train_with_torchrun_two_processes(tmp_path):
    base = tmp_path / "base"
    tiny_model("llama").float().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    data = tmp_path / "data.jsonl"
    letters = "abcdefghij"
    with open(data, "w") as f:
        for i in range(24):
            answer = " ".join(letters[(i + j) % 10] for j in range(8))
            f.write(json.dumps({"conversations": [{"from": "human", "value": letters[i % 10]},
                                                  {"from": "gpt", "value": answer}]}) + "\n")
    torchrun = shutil.which("torchrun", path=str(sys.executable).rsplit("/", 1)[0]) or "torchrun"
    out = tmp_path / "heads"
    result = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "medusa_heads.cli", "train", "--base", str(base),
         "--data", str(data), "--out", str(out), "--num-heads", "2", "--epochs", "2", "--batch-size", "4",
         "--projection", "shared", "--lr", "0.01"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("heads saved") == 1
    assert "on 2 process(es) (DistributedDataParallel)" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["num_heads"] == 2 and len(config["history"]) == 2
    loaded = MedusaModel.from_pretrained(base, heads=out)
    assert loaded.heads(torch.zeros(1, 32)).shape == (2, 1, 16)
    assert len(list((out / "hidden-cache").glob("part-*.safetensors"))) == 1
