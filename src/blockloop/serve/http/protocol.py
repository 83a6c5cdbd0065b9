"""The OpenAI request and response shapes the server speaks, and the checks that turn bad input into errors.

Requests are validated strictly (a ``"10"`` is not an integer, ``1.5`` not a token count) so every mistake
comes back as an OpenAI-style error object naming the field (``param``), with a 4xx status, instead of a
guess. Fields of the API that blockloop does not implement (log-probabilities, penalties, echo, tools, more
than one choice) are refused by name rather than silently ignored. ``ignore_eos`` (as in vLLM) keeps
generating past the end-of-text token, for benchmarks.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from blockloop.errors import utf8_problem
from blockloop.serve.requests import INT64_MAX

# Fields of the OpenAI API, and vLLM's sampling extras, this server does not implement, and the values that mean
# "not used". Other fields it does not know are ignored, as vLLM ignores them.
# A value means "not used" only as that JSON type: completions' ``"logprobs": 0`` asks for the chosen tokens'
# log-probabilities, where chat's ``"logprobs": false`` asks for none.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0), "suffix": (None, ""),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "response_format": (None, {"type": "text"}),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "min_tokens": (None, 0), "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False), "use_beam_search": (None, False), "length_penalty": (None, 1),
    # vLLM's extras that constrain or reshape what is generated
    "allowed_token_ids": (None, []), "bad_words": (None, []), "logits_processors": (None, []),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None, []), "guided_grammar": (None,),
    "structured_outputs": (None, {}), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True), "return_tokens_as_token_ids": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None, []),
}
MAX_STOP = 4


class ApiError(Exception):
    """An error response: HTTP ``status`` and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None  # null: the default, no usage chunk


class Sampling(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are checked against UNSUPPORTED

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1 or 0: off (as vLLM)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream", False):  # ``stream`` is declared, so checked, first
            raise ValueError("is only allowed with stream: true")
        return options

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}; send separate requests for more choices")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP:
            raise ValueError(f"give at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("an empty stop string would end every answer before it starts; leave it out")
        return [_utf8(s) for s in stops]  # one that is not UTF-8 could never match the text

    def stops(self) -> list[str]:
        return list(self.stop or [])


def _utf8(text: str) -> str:
    problem = utf8_problem(text)
    if problem is not None:
        raise ValueError(f"{problem}; send UTF-8 text")
    return text


class CompletionRequest(Sampling):
    prompt: Any = Field(...)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """A string or a list of token ids; a list holding one of those is the same prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            if len(prompt) == 0:
                raise ValueError("the prompt is empty; give at least one character or token")
            return _utf8(prompt) if isinstance(prompt, str) else prompt
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("the prompt must be a string or a list of token ids")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(...)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> str:
        """A string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
        if isinstance(content, str):
            return _utf8(content)
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            return _utf8("".join(p["text"] for p in content))
        raise ValueError("content must be a string or a list of text parts ({'type': 'text', 'text': ...})")


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    # vLLM's: the template's opening of the assistant's turn, or the last message continued (an answer prefix)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, continue_final: bool, info: ValidationInfo) -> bool:
        if continue_final and info.data.get("add_generation_prompt", True):
            raise ValueError("continues the last message, so add_generation_prompt must be false beside it")
        return continue_final

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a text's ids under the served tokenizer, for a client that cuts prompts
    to token lengths (``blockloop bench --url``); ``add_special_tokens`` adds the BOS a prompt would get."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str = Field(..., min_length=1)
    add_special_tokens: bool = True


FIELDS = {name for m in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions, TokenizeRequest)
          for name in m.model_fields}


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a request body, or raise the :class:`ApiError` naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, defaults in UNSUPPORTED.items():
        if name in body and not any(_same_json(body[name], unused) for unused in defaults):
            raise ApiError(400, f"{name} is not supported by this server; leave it out", param=name)
    # The API lets a client send null for any optional field (several do): it means the default.
    optional = {name for name, f in model.model_fields.items() if not f.is_required()}
    body = {key: value for key, value in body.items() if value is not None or key not in optional}
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _param(error["loc"], unknown_ok=error["type"] == "extra_forbidden")
        # A validator's own message reads as it was written, without pydantic's "Value error, " in front.
        message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
        raise ApiError(400, f"{param}: {message}", param=param) from None


def _same_json(value: Any, other: Any) -> bool:
    """Equal as JSON values: Python's ``0 == False`` is not JSON's (an integer and 0.0 are both numbers)."""
    return isinstance(value, bool) == isinstance(other, bool) and value == other


def _param(loc: tuple[Any, ...], unknown_ok: bool = False) -> str:
    """``('messages', 0, 'role')`` -> ``messages[0].role``; stops at pydantic's union-member tags, except that
    a field refused for being unknown (``unknown_ok``) is named as sent."""
    text = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in FIELDS or (unknown_ok and i == len(loc) - 1):
            text += f".{part}" if text else str(part)
        else:
            break
    return text or "body"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """The response objects of one request: whole (``completion``) or streamed (``chunk``)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def completion(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
