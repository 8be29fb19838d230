"""The real server, driven by the real `openai` client over loopback."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from server import Server

from medusa_heads import MedusaModel, Sampling
from medusa_heads.decoder import Request
from medusa_heads.serve.engine import Busy, Engine, Job


@pytest.fixture(scope="module")
def server(tiny_folder):
    server = Server(tiny_folder, "--max-concurrency", "4", "--max-new-tokens-limit", "64")
    yield server
    # SIGTERM: uvicorn shuts down gracefully, then re-raises the signal (exit status -15)
    assert server.stop() in (0, -15)
    assert "shut down cleanly" in server.process.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def library(tiny_folder):
    return MedusaModel.from_pretrained(tiny_folder, num_heads=5, projection="shared")


def expected_chat(library, messages, max_tokens, stop=None):
    out = library.generate(library.chat_ids(messages), max_new_tokens=max_tokens, stop=stop)
    return out.texts[0], out.finish_reasons[0]


PROMPTS = [[{"role": "user", "content": " ".join("abcdefghij"[(i + j) % 10] for j in range(1 + i % 4))}]
           for i in range(16)]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_openapi_schema_says_what_is_valid(server):
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    for request in ("ChatRequest", "CompletionRequest"):
        fields = schemas[request]["properties"]
        assert fields["model"]["enum"] == [server.model]
        assert {"type": "integer", "minimum": 1, "maximum": 64} in fields["max_tokens"]["anyOf"]  # the server's limit
        assert (fields["temperature"]["maximum"], fields["top_p"]["exclusiveMinimum"], fields["n"]["maximum"]) == (
            2.0, 0.0, 1)


def test_chat_greedy_equals_the_library(server, client, library):
    reply = client.chat.completions.create(model=server.model, messages=PROMPTS[0], max_tokens=20, temperature=0)
    text, finish = expected_chat(library, PROMPTS[0], 20)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == finish
    usage = reply.usage
    assert usage.prompt_tokens == library.chat_ids(PROMPTS[0]).shape[1]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.model_extra["mean_accepted_length"] >= 1.0


def test_chat_streaming(server, client, library):
    stream = client.chat.completions.create(model=server.model, messages=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text, expected_finish = expected_chat(library, PROMPTS[1], 20)
    assert "".join(pieces) == text and finish == expected_finish
    tokens = len(library.generate(library.chat_ids(PROMPTS[1]), max_new_tokens=20).new_tokens[0])
    assert usage is not None and usage.completion_tokens == tokens


def test_completions_and_stop(server, client, library):
    reply = client.completions.create(model=server.model, prompt="c d e f", max_tokens=16, temperature=0)
    ids = library.tokenizer("c d e f", return_tensors="pt")["input_ids"]
    assert reply.choices[0].text == library.generate(ids, max_new_tokens=16).texts[0]
    pieces = [c.choices[0].text for c in client.completions.create(model=server.model, prompt="c d e f",
                                                                    max_tokens=16, temperature=0, stream=True)]
    assert "".join(pieces) == reply.choices[0].text
    full, _ = expected_chat(library, PROMPTS[2], 24)
    stop = full.split()[3]
    reply = client.chat.completions.create(model=server.model, messages=PROMPTS[2], max_tokens=24, temperature=0,
                                           stop=[stop])
    assert reply.choices[0].message.content == full[: full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_is_reproducible(server, client, library):
    ask = dict(model=server.model, messages=PROMPTS[3], max_tokens=16, temperature=0.9, seed=7)
    ids = library.chat_ids(PROMPTS[3])
    for acceptance in ("exact", "typical"):  # the server's default at temperature > 0, then the paper's rule
        extra = {} if acceptance == "exact" else {"extra_body": {"acceptance": "typical"}}
        first = client.chat.completions.create(**ask, **extra).choices[0].message.content
        assert client.chat.completions.create(**ask, **extra).choices[0].message.content == first
        expected = library.generate(ids, max_new_tokens=16, acceptance=acceptance, temperature=0.9, seed=7)
        assert first == expected.texts[0], acceptance  # the library's draws from the same seed
    other = library.generate(ids, max_new_tokens=16, acceptance="typical", temperature=0.9, seed=8).texts[0]
    assert other != first  # the seed is what makes it reproducible


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return body["error"]


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"model": "nope", "messages": PROMPTS[0]}, 404, "does not exist"),
    ({"messages": PROMPTS[0]}, 400, "model"),
    ({"model": "{model}", "messages": []}, 400, "messages"),
    ({"model": "{model}", "messages": [{"role": "user"}]}, 400, "content"),
    ({"model": "{model}", "messages": [{"role": "wizard", "content": "a"}]}, 400, "role"),
    ({"model": "{model}", "messages": PROMPTS[0], "n": 2}, 400, "only n=1"),
    ({"model": "{model}", "messages": PROMPTS[0], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "{model}", "messages": PROMPTS[0], "max_tokens": 65}, 400, "max_tokens must be <= 64"),
    ({"model": "{model}", "messages": PROMPTS[0], "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "{model}", "messages": PROMPTS[0], "temperature": -1}, 400, "temperature"),
    ({"model": "{model}", "messages": PROMPTS[0], "stop": ["", "a"]}, 400, "stop"),
    ({"model": "{model}", "messages": [{"role": "user", "content": "a " * 300}]}, 400, "exceeds the context"),
    ({"model": "{model}", "prompt": ""}, 400, "at least 1 character"),
    ({"model": "{model}", "prompt": ["a", "b"]}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    body = json.loads(json.dumps(body).replace("{model}", server.model))
    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    response = httpx.post(server.url + route, json=body, timeout=30)
    assert response.status_code == status
    assert fragment in json.dumps(error_of(response))


def test_invalid_json_and_unknown_routes(server):
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in error_of(response)["message"]
    assert httpx.get(server.url + "/v2/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405


def test_sixteen_concurrent_streams(server, library):
    results = {}

    def run(i):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model=server.model, messages=PROMPTS[i], max_tokens=24,
                                                temperature=0, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 16
    for i in range(16):
        assert results[i] == expected_chat(library, PROMPTS[i], 24)[0], i


def test_a_client_that_disconnects_frees_its_slot(server, client, library):
    body = {"model": server.model, "messages": PROMPTS[5], "max_tokens": 64, "temperature": 0.8, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # the first event, then hang up
    deadline = time.time() + 20
    while httpx.get(server.url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json() | {"status": "ok"} == {
        "status": "ok", "model": server.model, "running": 0, "waiting": 0}
    reply = client.chat.completions.create(model=server.model, messages=PROMPTS[0], max_tokens=4, temperature=0)
    assert reply.choices[0].message.content == expected_chat(library, PROMPTS[0], 4)[0]  # the slot serves again


def test_queue_limit_answers_busy(library):
    engine = Engine(library, max_concurrency=1, max_queue=1)  # not started: nothing leaves the queue
    ids = library.chat_ids(PROMPTS[0])
    loop = asyncio.new_event_loop()
    engine.submit(Job(Request(ids[0]), loop))
    engine.submit(Job(Request(ids[0]), loop))
    with pytest.raises(Busy):
        engine.submit(Job(Request(ids[0]), loop))
    loop.close()


def test_continuous_batching_joins_and_leaves(library):
    """Driven step by step: two requests decode together, two more join mid-flight, and every
    answer still equals its solo greedy run."""
    loop = asyncio.new_event_loop()
    engine = Engine(library, max_concurrency=4)
    sizes = []
    decode = engine.decoder._decode

    def spy():
        sizes.append(len(engine.decoder.active))
        decode()

    engine.decoder._decode = spy
    jobs = [Job(Request(library.chat_ids(PROMPTS[i])[0], 20 + i, Sampling("greedy")), loop)
            for i in range(4)]
    engine.submit(jobs[0])
    engine.submit(jobs[1])
    for _ in range(3):
        engine.run_once()
    engine.submit(jobs[2])
    engine.submit(jobs[3])
    while engine.run_once():
        pass
    loop.run_until_complete(asyncio.sleep(0))  # deliver the events sent from the engine
    assert sizes[0] == 2 and max(sizes) == 4 and sizes[-1] < 4
    for i, job in enumerate(jobs):
        events = [job.events.get_nowait() for _ in range(job.events.qsize())]
        text = "".join(payload for kind, payload in events if kind == "text")
        assert events[-1][0] == "done"
        assert text == expected_chat(library, PROMPTS[i], 20 + i)[0], i
    assert engine.decoder._rows == {} and engine.admitted == 0
    loop.close()


def test_a_server_with_an_eagle_draft_answers_as_the_library(tiny_folder, tmp_path):
    import torch

    torch.manual_seed(0)
    library = MedusaModel.from_pretrained(tiny_folder, draft="eagle")
    library.save_pretrained(tmp_path / "draft")
    server = Server(tiny_folder, "--heads", str(tmp_path / "draft"), "--tree", "dynamic-8x3x3")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for messages in PROMPTS[:3]:
            reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0)
            out = library.generate(library.chat_ids(messages), max_new_tokens=20, tree="dynamic-8x3x3")
            assert reply.choices[0].message.content == out.texts[0]
            assert reply.usage.model_extra["mean_accepted_length"] == round(out.mean_accepted_length, 4)
    finally:
        server.stop()
