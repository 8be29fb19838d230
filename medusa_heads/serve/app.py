"""The OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /health.

Every error, a client's or ours, answers with an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` and never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .. import decoder
from .engine import Busy, Engine, Job
from .schemas import ChatRequest, CompletionRequest, ErrorBody, SamplingFields


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body, status_code=err.status)


def engine_error(kind: str, message: str) -> APIError:
    """The APIError for an engine event: "invalid" (the request) or "error" (ours)."""
    if kind == "invalid":
        return APIError(400, message)
    return APIError(500, message, type="server_error")


def create_app(model, max_concurrency: int = 4, max_queue: int = 64, max_new_tokens_limit: int = 2048,
               tree=None) -> FastAPI:
    """The app for one MedusaModel; its engine thread starts and stops with the app."""
    model.require_tokenizer()
    model_id = Path(model.base_name).name or "medusa"
    engine = Engine(model, max_concurrency, max_queue, tree)
    # tree tokens sit up to `reach` positions past the last accepted one
    context = int(getattr(model.config, "max_position_embeddings", 0) or 4096) - engine.tree.reach

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()
        print("medusa serve: shut down cleanly", flush=True)

    app = FastAPI(title="medusa-heads", description="OpenAI-compatible server with Medusa decoding",
                  lifespan=lifespan, responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody},
                                                429: {"model": ErrorBody}})
    app.state.engine = engine

    def openapi() -> dict:
        """The schema, saying what this server accepts: its model id, and its limit on max_tokens (requests
        outside them still get OpenAI's errors: 404 for another model, 400 for too many tokens)."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for request in ("ChatRequest", "CompletionRequest"):
                fields = schema["components"]["schemas"][request]["properties"]
                fields["model"]["enum"] = [model_id]
                for option in fields["max_tokens"].get("anyOf", [fields["max_tokens"]]):
                    if option.get("type") == "integer":
                        option["maximum"] = max_new_tokens_limit
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message = "the body is not valid JSON"
        else:
            message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(APIError(400, message, param=".".join(location) or None, code=first.get("type")))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        return error_response(APIError(err.status_code, str(err.detail), code=str(err.status_code)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return error_response(APIError(500, "internal server error", type="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_id, "running": engine.running, "waiting": len(engine.waiting)}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "medusa-heads"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        return await complete(body, model.chat_ids(messages), request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ids = model.tokenizer(body.prompt, return_tensors="pt")["input_ids"].to(model.device)
        if ids.shape[1] == 0:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        return await complete(body, ids, request, chat=False)

    async def complete(body: SamplingFields, ids: torch.Tensor, request: Request, chat: bool):
        if body.model != model_id:
            raise APIError(404, f"model {body.model!r} does not exist; this server has {model_id!r}", param="model",
                           code="model_not_found")
        prompt = ids.shape[1]
        if body.max_tokens is not None and body.max_tokens > max_new_tokens_limit:
            raise APIError(400, f"max_tokens must be <= {max_new_tokens_limit}", param="max_tokens")
        max_tokens = body.max_tokens or min(max_new_tokens_limit, context - prompt)
        if prompt >= context or prompt + max_tokens > context:
            raise APIError(400, f"the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context of {context} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        job = Job(decoder.Request(ids[0], **body.decoding(max_tokens).request_settings()), asyncio.get_running_loop())
        try:
            engine.submit(job)
        except Busy:
            raise APIError(429, "the server is busy: retry shortly", type="rate_limit_error",
                           code="rate_limit_exceeded") from None
        reply = Reply(chat, model_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_events(job, reply, include_usage), media_type="text/event-stream")
        try:
            text = []
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():  # the client left: free its row now
                        return JSONResponse({}, status_code=499)
                    continue
                if kind == "text":
                    text.append(payload)
                elif kind == "done":
                    return reply.whole("".join(text), payload)
                else:
                    raise engine_error(kind, payload)
        finally:
            job.cancelled.set()

    return app


class Reply:
    """Builds response bodies for one request in chat or text-completion shape."""

    def __init__(self, chat: bool, model_id: str):
        self.chat, self.model_id = chat, model_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, choice: dict, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id, "choices": [choice]}

    def whole(self, text: str, done: dict) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text, "logprobs": None}
        body = self._envelope({"index": 0, **content, "finish_reason": done["finish_reason"]}, chunk=False)
        return {**body, "usage": usage(done)}

    def usage_chunk(self, done: dict) -> dict:
        return {**self._envelope({}, chunk=True), "choices": [], "usage": usage(done)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(choice, chunk=True)


def usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
            "mean_accepted_length": round(done["mean_accepted_length"], 4)}


async def stream_events(job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events; if the client goes away, the generator is closed and the job cancelled."""

    def event(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

    try:
        if reply.chat:
            yield event(reply.chunk(role=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "text":
                yield event(reply.chunk(payload))
            elif kind == "done":
                yield event(reply.chunk(finish_reason=payload["finish_reason"]))
                if include_usage:
                    yield event(reply.usage_chunk(payload))
                yield event("[DONE]")
                return
            else:
                yield event(engine_error(kind, payload).body)
                return
    finally:
        job.cancelled.set()
