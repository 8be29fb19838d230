"""OpenAI-compatible request and response bodies (the subset this server honours, validated)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..decoding import Decoding
from ..settings import describe

Text = Annotated[str, Field(min_length=1)]  # a non-empty string


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, description="new tokens at most")
    temperature: float = Field(default=Decoding.temperature, ge=0.0, le=2.0,
                               description="0 decodes greedily; > 0 samples (see acceptance)")
    top_p: float = Field(default=Decoding.top_p, gt=0.0, le=1.0, description=describe(Decoding, "top_p"))
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = Field(
        default=None, description="up to 4 strings that end the answer")
    seed: int | None = Field(default=Decoding.seed, description=describe(Decoding, "seed"))
    n: int = Field(default=1, ge=1, json_schema_extra={"maximum": 1}, description="choices per request: only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    acceptance: Literal["exact", "typical"] | None = Field(
        default=None, description="sampling (temperature > 0): exact (default, lossless) or typical (faster)")

    def decoding(self, max_new_tokens: int) -> Decoding:
        """These fields as decoding settings: temperature 0 decodes greedily, else by `acceptance`."""
        acceptance = "greedy" if self.temperature == 0 else self.acceptance or "exact"
        return Decoding(acceptance, self.temperature, self.top_p, max_new_tokens=max_new_tokens, stop=self.stop,
                        seed=self.seed)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)] = Field(
        description="the text to continue (or a list of exactly one)")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        return value[0] if isinstance(value, list) else value


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
