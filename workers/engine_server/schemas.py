"""The engine server's request models: the OpenAI fields, range-checked. Unknown fields are refused
(a 400 naming them) rather than silently ignored; a parameter the engine does not implement is
refused when set to anything but its neutral value (`unsupported`: best_of and suffix today)."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_PROMPT_CHARS = 1_000_000  # a bound on what one request makes the tokenizer read
INT64 = 2**63 - 1
Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=-INT64, le=INT64)]], Field(min_length=1, max_length=1 << 20)]
StopText = Annotated[str, Field(max_length=1024)]


class _In(BaseModel):
    # unknown fields are refused (a 400 naming them) rather than silently ignored
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_In):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingIn(_In):
    """The OpenAI sampling fields, range-checked; those the engine does not implement yet are
    refused when set to anything but their neutral value."""

    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(None, ge=0, le=INT64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)  # vLLM's: -1 or 0 = every token
    n: int | None = Field(None, ge=1, le=128)
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64)]], Field(max_length=64)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(max_length=32)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=1024)
    seed: int | None = Field(None, ge=-(2**63), le=INT64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=1024)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a parameter this server cannot honour yet: every sampling parameter
        it accepts is honoured now (completions refine this with best_of and suffix)."""
        return None


class CompletionIn(SamplingIn):
    # one prompt, or a batch (what lm-eval's local-completions sends): one choice per prompt
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=256)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=256)]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    # vLLM's field: tokens, and the keys of top_logprobs, as "token_id:<id>" instead of their text
    # (two tokens may decode to the same text; an id never collides)
    return_tokens_as_token_ids: bool | None = False

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string or a token-id list alone is a batch of one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        # a list of strings or of token-id lists: a list of ints is the batch of one above
        return list(cast("list[str] | list[list[int]]", self.prompt))

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported by this server yet; leave `best_of` unset"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this server; leave `suffix` unset"
        return super().unsupported()


class TextPart(_In):
    type: Literal["text"]
    text: Text


class ChatMessage(_In):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(min_length=1, max_length=256)]
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatIn(SamplingIn):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64)
    # the generated tokens' log-probs, with top_logprobs alternatives each (not with stream)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatIn:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class DetokenizeIn(_In):
    model: str | None = Field(None, max_length=1024)
    tokens: Annotated[list[Annotated[int, Field(ge=-INT64, le=INT64)]], Field(max_length=1 << 20)]


class TokenizeIn(_In):
    model: str | None = Field(None, max_length=1024)
    prompt: Text
    add_special_tokens: bool = True
