"""`canary engine-serve`: the reference engine behind an OpenAI-compatible API, with vLLM's
metric names on /metrics (REFERENCE.md §7) — so that the openai engine and the judge client are
tested end to end over real HTTP, and a team can point any OpenAI client at a local config.

Routes: GET /v1/models, POST /v1/completions (echo + logprobs for prompt log-probs; streaming),
POST /v1/chat/completions (streaming), POST /tokenize, GET /metrics, GET /health.
Requests are queued and decoded one at a time by a single engine thread (the engine is not
thread-safe): vllm:num_requests_waiting counts the queue, vllm:num_requests_running the one in
flight. kv_cache_usage_perc = tokens held by the running request / the model's context.

Input is validated by pydantic request models (CompletionIn, ChatIn, TokenizeIn; they are in
/openapi.json). Bad input — malformed JSON, a wrongly typed or out-of-range field, an unknown
field, a prompt over the context, a token id outside the vocabulary — is a 400 in vLLM's
OpenAI error shape, {"error": {"message", "type": "BadRequestError", "param", "code": 400}};
sampling parameters the engine does not implement yet (n > 1, best_of > 1, top_p < 1, stop,
penalties, logit_bias, suffix, logprobs without echo) are a 400 naming the parameter, never
ignored. Chat `logprobs` is accepted (judges ask for it) and answered with `logprobs: null`.

    python -m workers.engine_serve --model builtin:pydoc-target --kv-cache turbo-3 --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.protocol import GenerationRequest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServeMetrics:
    """vLLM V1 metric names; counters are exposed with the _total suffix."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", lab, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1", lab, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", lab, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Draft proposals", lab, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens", lab, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens", lab, registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted at position", lab + ["position"], registry=r)
        self.model = model_name
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(model_name).set(0)


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float
    prompt_ids: list[int] | None = None  # echo: score these instead of generating
    stamps: list[float] = field(default_factory=list)


class EngineServer:
    def __init__(self, engine, model_name: str, prompt_logprobs: bool = True):
        self.engine = engine
        self.model_name = model_name
        self.prompt_logprobs = prompt_logprobs
        self.metrics = ServeMetrics(model_name)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine")
        self.thread.start()

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        m, name = self.metrics, self.model_name
        while True:
            job = self.jobs.get()
            m.waiting.labels(name).dec()
            m.running.labels(name).inc()
            try:
                if job.prompt_ids is not None:
                    lps, greedy = self.engine.prompt_logprobs(job.prompt_ids)
                    self._emit(job, ("scored", (lps, greedy)))
                else:
                    self._generate(job)
            except ValueError as e:  # the engine refuses this input (e.g. over the context): the client's error, a 400
                self._emit(job, ("invalid", str(e)))
            except Exception as e:  # noqa: BLE001 — the request fails, the server stays up
                self._emit(job, ("error", str(e)))
            finally:
                m.running.labels(name).dec()
                m.kv_usage.labels(name).set(0)

    def _generate(self, job: Job) -> None:
        m, name = self.metrics, self.model_name
        n_prompt = len(self.engine.tokenizer(job.request.prompt, add_special_tokens=False)["input_ids"]) + 1
        m.prompt_tokens.labels(name).inc(n_prompt)
        held = [n_prompt]

        def on_tokens(request_id, tokens, spec):
            now = time.perf_counter()
            if not job.stamps:
                m.ttft.labels(name).observe(now - job.arrived)
            else:
                m.itl.labels(name).observe(now - job.stamps[-1])
            job.stamps.append(now)
            held[0] += len(tokens)
            m.kv_usage.labels(name).set(min(1.0, held[0] / self.engine.args.max_seq_len))
            m.generation_tokens.labels(name).inc(len(tokens))
            if spec is not None:
                m.drafts.labels(name).inc(spec.num_drafts)
                m.draft_tokens.labels(name).inc(spec.num_draft_tokens)
                m.accepted.labels(name).inc(spec.num_accepted_tokens)
                for pos, a in enumerate(spec.accepted_per_position):
                    m.accepted_pos.labels(name, str(pos)).inc(a)
            self._emit(job, ("tokens", tokens))

        result = self.engine.generate([job.request], on_tokens=on_tokens)[0]
        m.e2e.labels(name).observe(time.perf_counter() - job.arrived)
        self._emit(job, ("done", result))

    @staticmethod
    def _emit(job: Job, event) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def submit(self, request: GenerationRequest | None, prompt_ids: list[int] | None = None) -> Job:
        job = Job(request or GenerationRequest("echo", ""), asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter(), prompt_ids)
        self.metrics.waiting.labels(self.model_name).inc()
        self.jobs.put(job)
        return job

    # -- helpers for the routes -------------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.engine.tokenizer.decode([i]) for i in ids]


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    """vLLM's error shape (OpenAI's, with the HTTP status as `code`)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


# -- request models ------------------------------------------------------------------------------------
MAX_PROMPT_CHARS = 1_000_000  # a bound on what one request makes the tokenizer read
INT64 = 2**63 - 1
Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=-INT64, le=INT64)]], Field(min_length=1, max_length=1 << 20)]


class _In(BaseModel):
    # unknown fields are refused (a 400 naming them) rather than silently ignored
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_In):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sampling(_In):
    """The OpenAI sampling fields, range-checked; those the engine does not implement yet are
    refused when set to anything but their neutral value."""

    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(None, ge=0, le=INT64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: Annotated[str, Field(max_length=1024)] | Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=4)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(max_length=32)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=1024)
    seed: int | None = Field(None, ge=-(2**63), le=INT64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=1024)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a parameter this server cannot honour yet."""
        checks = [
            ("n", self.n not in (None, 1), "n > 1 (several choices)"),
            ("top_p", self.top_p not in (None, 1.0), "top_p < 1 (nucleus sampling)"),
            ("stop", bool(self.stop), "stop sequences"),
            ("presence_penalty", self.presence_penalty not in (None, 0.0), "presence_penalty"),
            ("frequency_penalty", self.frequency_penalty not in (None, 0.0), "frequency_penalty"),
            ("logit_bias", bool(self.logit_bias), "logit_bias"),
        ]
        for param, bad, what in checks:
            if bad:
                return param, f"{what} is not supported by this server yet; leave `{param}` unset"
        return None


class CompletionIn(_Sampling):
    prompt: Text | TokenIds
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

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


class ChatIn(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64)
    # accepted for judges that ask for them; answered with logprobs: null (not produced yet)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatIn:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TokenizeIn(_In):
    model: str | None = Field(None, max_length=1024)
    prompt: Text
    add_special_tokens: bool = True


def _param(loc: tuple | list) -> str | None:
    """The request field a validation error is about: 'messages[0].content', 'temperature'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "str" or "[" in str(part) or "-" in str(part):
            continue  # pydantic's union-branch labels ('str', 'constrained-str', 'list[int]') are not fields
        else:
            out += f".{part}" if out else str(part)
    return out or None


def build_app(server: EngineServer) -> FastAPI:
    app = FastAPI(title="canary engine-serve", version="1")
    name = server.model_name
    ctx = server.engine.args.max_seq_len
    vocab = server.engine.args.vocab_size
    spec = getattr(server.engine, "spec", None)
    # speculative decoding holds k draft tokens (+1) past the answer in the cache
    spec_extra = (spec.speculative.k + 1) if spec is not None and getattr(spec.speculative, "method", "off") != "off" else 0

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON ({(first.get('ctx') or {}).get('error', 'decode error')} "
                              f"at position {first['loc'][-1]})")
        param = _param(first.get("loc", ()))
        if param is None:  # no body, or not an object: a list, a string, a form
            return error(400, "the body must be a JSON object (Content-Type: application/json)")
        msg = "; ".join(f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errs[:5])
        return error(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "HTTPError")
        return error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def crashed(_request: Request, exc: Exception) -> JSONResponse:  # a bug answers JSON, never a dropped connection
        return error(500, f"internal error: {type(exc).__name__}", "InternalServerError")

    def check_model(model: str | None, required: bool = True) -> JSONResponse | None:
        if (model is not None or required) and model != name:
            return error(404, f"The model `{model}` does not exist. This server serves `{name}`.", "NotFoundError", "model")
        return None

    def too_long(n_prompt: int, max_tokens: int, param: str) -> JSONResponse | None:
        if n_prompt + max_tokens + spec_extra > ctx:
            extra = f" (+{spec_extra} for speculative decoding)" if spec_extra else ""
            return error(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                              f"{n_prompt + max_tokens + spec_extra} tokens ({n_prompt} in the prompt, {max_tokens} in the "
                              f"completion{extra}). Please reduce the length of the prompt or the completion.", param=param)
        return None

    def gen_request(body: _Sampling, prompt: str, max_tokens: int | None, param: str) -> GenerationRequest | JSONResponse:
        if (bad := body.unsupported()) is not None:
            return error(400, bad[1], param=bad[0])
        max_tokens = 16 if max_tokens is None else max_tokens
        if max_tokens < 1:
            return error(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        n_prompt = len(server.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 1
        if (bad := too_long(n_prompt, max_tokens, param)) is not None:
            return bad
        temperature = 1.0 if body.temperature is None else body.temperature
        return GenerationRequest(uuid.uuid4().hex, prompt, max_tokens, temperature, (body.seed or 0) % (2**63))

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "inference-canary",
                                            "max_model_len": ctx}]}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeIn):
        if (bad := check_model(body.model, required=False)) is not None:
            return bad
        ids = server.engine.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
        if body.add_special_tokens:
            ids = [server.engine.start_id] + ids
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx}

    @app.post("/v1/completions")
    async def completions(body: CompletionIn):
        if (bad := check_model(body.model)) is not None:
            return bad
        if body.echo:
            return await echo_logprobs(body)
        if not isinstance(body.prompt, str):
            return error(400, "prompt must be a string (token-id prompts are accepted with echo=true)", param="prompt")
        if body.logprobs is not None:
            return error(400, "logprobs of generated tokens are not supported by this server yet (prompt log-probs are: "
                              "echo=true, max_tokens 0)", param="logprobs")
        req = gen_request(body, body.prompt, body.max_tokens, "prompt")
        if isinstance(req, JSONResponse):
            return req
        return await respond(server.submit(req), body, chat=False)

    async def echo_logprobs(body: CompletionIn) -> JSONResponse | dict:
        if not server.prompt_logprobs:
            return error(400, "echo with logprobs is not supported by this server", param="echo")
        if body.max_tokens not in (0, 1) or body.logprobs is None or body.stream:
            return error(400, "echo=true is served for prompt log-probs only: logprobs ≥ 0, max_tokens 0 or 1, no stream", param="echo")
        if (bad := body.unsupported()) is not None:
            return error(400, bad[1], param=bad[0])
        prompt = body.prompt
        if isinstance(prompt, str):
            ids = [server.engine.start_id] + server.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = prompt
            bad_ids = [i for i in ids if not 0 <= i < vocab]
            if bad_ids:
                return error(400, f"token id {bad_ids[0]} is out of vocabulary (valid ids: 0 to {vocab - 1})", param="prompt")
        if len(ids) > ctx:
            return error(400, f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                              f"{len(ids)} tokens. Please reduce the length of the prompt.", param="prompt")
        job = server.submit(None, prompt_ids=ids)
        kind, payload = await job.events.get()
        if kind == "invalid":
            return error(400, payload, param="prompt")
        if kind == "error":
            return error(500, payload, "InternalServerError")
        lps, _ = payload
        tokens = server.token_strings(ids)
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": name,
                "choices": [{"index": 0, "text": "".join(tokens), "finish_reason": "length",
                             "logprobs": {"tokens": tokens, "token_logprobs": [None] + lps, "text_offset": offsets,
                                          "top_logprobs": None}}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatIn):
        if (bad := check_model(body.model)) is not None:
            return bad
        # the tiny zoo has no chat template: a plain transcript
        prompt = "".join(f"{m.role}: {m.text()}\n" for m in body.messages) + "assistant:"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = gen_request(body, prompt, max_tokens, "messages")
        if isinstance(req, JSONResponse):
            return req
        return await respond(server.submit(req), body, chat=True)

    async def respond(job: Job, body: _Sampling, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + job.request.request_id
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if chat:
                return {"index": 0, ("delta" if delta else "message"): {"role": "assistant", "content": text}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if body.stream:
            # the first event decides the status: a refusal before any token is still a 400
            first = await job.events.get()
            if first[0] in ("invalid", "error"):
                return error(400, first[1], param="prompt") if first[0] == "invalid" else error(500, first[1], "InternalServerError")

            async def events():
                event = first
                while True:
                    kind, payload = event
                    if kind == "tokens":
                        chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "model": name,
                                 "choices": [choice(server.decode(payload), None, True)]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    elif kind == "done":
                        finish = "stop" if payload.token_ids and payload.token_ids[-1] == server.engine.tokenizer.eos_token_id else "length"
                        final = {"id": rid, "object": obj + (".chunk" if chat else ""), "model": name, "choices": [choice("", finish, True)],
                                 "usage": {"prompt_tokens": payload.prompt_tokens, "completion_tokens": len(payload.token_ids),
                                           "total_tokens": payload.prompt_tokens + len(payload.token_ids)}}
                        yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"
                        return
                    else:
                        code = 400 if kind == "invalid" else 500
                        kind_name = "BadRequestError" if code == 400 else "InternalServerError"
                        yield f"data: {json.dumps({'error': {'message': payload, 'type': kind_name, 'param': None, 'code': code}})}\n\n"
                        return
                    event = await job.events.get()

            return StreamingResponse(events(), media_type="text/event-stream")
        while True:
            kind, payload = await job.events.get()
            if kind == "done":
                break
            if kind == "invalid":
                return error(400, payload, param="prompt")
            if kind == "error":
                return error(500, payload, "InternalServerError")
        finish = "stop" if payload.token_ids and payload.token_ids[-1] == server.engine.tokenizer.eos_token_id else "length"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [choice(payload.text, finish, False)],
                "usage": {"prompt_tokens": payload.prompt_tokens, "completion_tokens": len(payload.token_ids),
                          "total_tokens": payload.prompt_tokens + len(payload.token_ids)}}

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from engines.registry import load_engine
    from engines.spec import OptimizationSpec
    from engines.zoo import resolve_model_path

    ap = argparse.ArgumentParser(prog="canary engine-serve", description="the reference engine behind an OpenAI-compatible API")
    ap.add_argument("--model", default="builtin:pydoc-target", help="builtin:<zoo name> or an HF directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the --model value)")
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--kv-cache", default="auto")
    ap.add_argument("--speculative", default="off", help='"off" or a JSON object, e.g. {"method": "ngram", "k": 4}')
    ap.add_argument("--no-prompt-logprobs", action="store_true", help="refuse echo=true (like servers without prompt log-probs)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    args = ap.parse_args(argv)
    speculative = {"method": "off"} if args.speculative == "off" else json.loads(args.speculative)
    spec = OptimizationSpec(engine="reference", weights=args.weights, kv_cache=args.kv_cache, speculative=speculative)
    engine = load_engine(str(resolve_model_path(args.model)), spec)
    server = EngineServer(engine, args.served_model_name or args.model, prompt_logprobs=not args.no_prompt_logprobs)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
