"""Request bodies: pydantic v2 models that refuse unknown fields and name the bad one.

Limits that an operator sets (``max_tokens``, ``n``, logprobs, stop strings and ids) are not
written here: :mod:`app.limits` checks them against the settings. The OpenAI routes take vLLM's
and OpenAI's sampling fields (:class:`VllmSampling`: penalties,
``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``), ``n`` and
``logprobs``; every other unknown field is refused with 422 naming it.

Decoding modes are checked against :data:`d3d.config.MODES` (plus ``auto``) when a request
arrives, not against a list written here, so a mode the library adds is served at once. Scorers
are checked against compression's registry through :mod:`app.documents`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app import documents
from d3d import config as d3d_config
from d3d.model.load import check_template_vars

STRICT = ConfigDict(extra="forbid")


def allowed_modes() -> tuple[str, ...]:
    modes = tuple(d3d_config.MODES)
    return modes if "auto" in modes else ("auto", *modes)


class Speculative(BaseModel):
    """How to decode: ``auto`` lets the server's policy decide per step; others force it."""

    model_config = STRICT
    mode: str = "auto"

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v not in allowed_modes():
            raise ValueError(f"unknown mode {v!r}: choose from {', '.join(allowed_modes())}")
        return v


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what a generator takes (vLLM's range)


class Sampling(BaseModel):
    """Fields shared by every generating route."""

    model_config = STRICT
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="a 64-bit integer")
    speculative: Speculative = Field(default_factory=Speculative)


class Compression(BaseModel):
    model_config = STRICT
    keep_ratio: float | None = Field(
        None,
        description=f"fraction of document kept, in (0, 1]; {documents.DEFAULT_KEEP_RATIO:g} if unset",
    )
    scorer: str | None = Field(None, description="how document parts are ranked")

    @field_validator("keep_ratio")
    @classmethod
    def _keep_ratio(cls, v: float | None) -> float | None:
        return None if v is None else documents.check_keep_ratio(v)

    @field_validator("scorer")
    @classmethod
    def _scorer(cls, v: str | None) -> str | None:
        if v is not None and v not in documents.scorers():
            raise ValueError(f"unknown scorer {v!r}: choose from {', '.join(documents.scorers())}")
        return v


class QARequest(Sampling, Compression):
    """``POST /qa``: answer a question about a document (JSON, or multipart with a file)."""

    document: str = Field(..., description="the document text")
    question: str = Field(..., min_length=1)
    max_new_tokens: int = Field(64, ge=1, description="at most --max-new-tokens")
    stream: bool = False
    return_prompt: bool = Field(False, description="also return the exact prompt the model read")

    @field_validator("document", "question")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class VllmSampling(BaseModel):
    """vLLM's sampling parameters (OpenAI's two penalties among them), with vLLM's meanings
    (:class:`d3d.config.SamplingConfig`)."""

    model_config = STRICT
    top_k: int = Field(0, ge=-1, description="keep the k most likely tokens; 0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top one")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="> 1 discourages tokens of the prompt and output"
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=4096, description="no stop token before this many")
    ignore_eos: bool = Field(False, description="EOS does not end the answer")
    stop_token_ids: list[int] | None = Field(None, description="ids that end the answer")

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


class OpenAIRequest(Sampling, VllmSampling, Compression):
    """Fields common to chat and text completions (extras arrive through ``extra_body``)."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="at most --max-new-tokens")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="independent answers (choices), at most --max-n")
    user: str | None = None
    document: str | None = Field(None, description="extra: a document to compress and answer from")

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="at most --max-new-tokens")
    logprobs: bool = Field(False, description="each answer token's log-probability")
    top_logprobs: int | None = Field(
        None, ge=0, description="and that many alternatives, at most --max-logprobs"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='variables for the chat template, as vLLM takes them: {"enable_thinking": '
        "true} lets Qwen3 think (returned apart, as reasoning_content); default non-thinking",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_vars(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_template_vars(v)
        return v


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(
        None, ge=0, description="each token's log-probability and that many alternatives"
    )

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request")
        return v

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
