"""`medusa demo`'s report: every answer identical to plain decoding, with its speeds."""

from conftest import medusa_tiny
from tiny import tiny_tokenizer

from medusa_heads.demo import run_demo


def test_demo_reports_each_answer_and_the_overall_speed_up(capsys):
    model = medusa_tiny("llama")
    model.tokenizer = tiny_tokenizer()
    run_demo(model, ["c d e", "f g h i"], max_new_tokens=12)
    out = capsys.readouterr().out
    assert out.count("identical to plain decoding") == 2 and "DIFFERS" not in out
    assert out.count("tok/s | speed-up") == 2 and "overall speed-up:" in out and ">>> f g h i" in out
