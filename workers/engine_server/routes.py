"""The OpenAI-compatible routes. Each reads the EngineServer from the app (ServerDep); every
refusal is a response in vLLM's error shape (errors.py), never an exception."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.protocol import GenerationRequest
from workers.engine_server.answers import ClientGone, Events, answer, text_offsets
from workers.engine_server.engine_thread import EngineServer
from workers.engine_server.errors import error
from workers.engine_server.jobs import ServeQueueFull, ServeRequest, ShuttingDown
from workers.engine_server.schemas import ChatIn, CompletionIn, DetokenizeIn, SamplingIn, TokenizeIn


def get_server(request: Request) -> EngineServer:
    return request.app.state.engine_server


ServerDep = Annotated[EngineServer, Depends(get_server)]
router = APIRouter()


@router.get("/health")
def health() -> Response:
    return Response(status_code=200)


@router.get("/v1/models")
def models(server: ServerDep) -> dict:
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "inference-canary",
                                        "max_model_len": server.max_model_len}]}


# response_model=None where a route answers a dict or a Response: FastAPI would take the union it returns for a model
@router.get("/v1/models/{model_id:path}", response_model=None)
def model(model_id: str, server: ServerDep) -> JSONResponse | dict:
    if model_id != server.model_name:
        return error(404, f"The model `{model_id}` does not exist. This server serves `{server.model_name}`.",
                     "NotFoundError", "model")
    return {"id": server.model_name, "object": "model", "owned_by": "inference-canary",
            "max_model_len": server.max_model_len}


@router.get("/version")
def version() -> dict:
    from importlib.metadata import version as installed

    return {"version": installed("inference-canary")}


@router.get("/tokenizer_info")
def tokenizer_info(server: ServerDep) -> dict:
    tok = server.engine.tokenizer
    return {"tokenizer_class": type(tok).__name__, "vocab_size": server.vocab_size,
            "model_max_length": server.max_model_len, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "add_bos_token": True}


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeIn, server: ServerDep) -> JSONResponse | dict:
    if (bad := check_model(server, body.model, required=False)) is not None:
        return bad
    bad_ids = [i for i in body.tokens if not 0 <= i < server.vocab_size]
    if bad_ids:
        return error(400, f"token id {bad_ids[0]} is out of vocabulary (valid ids: 0 to {server.vocab_size - 1})",
                     param="tokens")
    return {"prompt": server.engine.tokenizer.decode(body.tokens)}


@router.get("/metrics")
def metrics(server: ServerDep) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeIn, server: ServerDep) -> JSONResponse | dict:
    if (bad := check_model(server, body.model, required=False)) is not None:
        return bad
    ids = server.engine.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
    if body.add_special_tokens:
        ids = [server.engine.start_id] + ids
    return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionIn, server: ServerDep, http: Request) -> Response | dict:
    if (bad := check_model(server, body.model)) is not None:
        return bad
    if body.echo:
        return await echo_logprobs(server, body, http)
    prompts = body.prompts()
    requests = []
    for index, prompt in enumerate(prompts):  # every prompt is checked before any is run
        where = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
        if not isinstance(prompt, str) and (bad_ids := [i for i in prompt if not 0 <= i < server.vocab_size]):
            return error(400, f"{where}: token id {bad_ids[0]} is out of vocabulary (valid ids: 0 to "
                              f"{server.vocab_size - 1})", param="prompt")
        request = generation_request(server, body, prompt, body.max_tokens, "prompt", body.logprobs)
        if isinstance(request, JSONResponse):
            return request
        requests.append(request)
    jobs = submit_choices(server, requests, body)
    return jobs if isinstance(jobs, JSONResponse) else await respond(server, jobs, body, http, chat=False)


@router.post("/v1/chat/completions", response_model=None)
async def chat(body: ChatIn, server: ServerDep, http: Request) -> Response | dict:
    if (bad := check_model(server, body.model)) is not None:
        return bad
    # the tiny zoo has no chat template: a plain transcript
    prompt = "".join(f"{message.role}: {message.text()}\n" for message in body.messages) + "assistant:"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = generation_request(server, body, prompt, max_tokens, "messages",
                                 (body.top_logprobs or 0) if body.logprobs else None)
    if isinstance(request, JSONResponse):
        return request
    jobs = submit_choices(server, [request], body)
    return jobs if isinstance(jobs, JSONResponse) else await respond(server, jobs, body, http, chat=True)


def submit_choices(server: EngineServer, requests: list[GenerationRequest],
                   body: SamplingIn) -> list[ServeRequest] | JSONResponse:
    """`n` choices of each request, each its own engine job, in OpenAI's order (prompt by prompt,
    each prompt's choices together); choice i samples with seed + i. A full queue: a 429."""
    n = body.n or 1
    alternatives = "top_logprobs" if isinstance(body, ChatIn) else "logprobs"  # the field each API names them by
    if (refused := too_many(server, requests, n, alternatives)) is not None:
        return refused
    choices = [replace(request, request_id=f"{request.request_id}-{i}" if i else request.request_id,
                       seed=(request.seed + i) % (2**63))
               for request in requests for i in range(n)]
    try:
        jobs = server.submit_all(choices, stream=bool(body.stream))
    except ServeQueueFull as e:
        return error(429, str(e), "RateLimitError")
    except ShuttingDown as e:
        return error(503, str(e), "ServiceUnavailableError")
    for _ in requests:
        server.metrics.params_n.observe(n)
    return jobs


def too_many(server: EngineServer, requests: list[GenerationRequest], n: int,
             logprobs_param: str = "logprobs") -> JSONResponse | None:
    """A request bigger than the server ever admits (a 400 naming the field to shrink, not a 429:
    retrying cannot help): more sequences (prompts × n) than --max-queue, or more generated
    log-probs (sequences × max_tokens × (1 + logprobs)) than --max-logprob-entries."""
    sequences = len(requests) * n
    if sequences > server.max_queue:
        return error(400, f"this request asks for {len(requests)} prompt(s) × n={n} = {sequences} sequences; the "
                          f"server queues at most {server.max_queue} (--max-queue). Send fewer prompts or a smaller n",
                     param="n" if n > 1 else "prompt")
    entries = sum(r.max_new_tokens * (1 + r.logprobs) for r in requests if r.logprobs is not None) * n
    if entries > server.max_logprob_entries:
        return error(400, f"this request asks for {entries} generated log-probs (prompts × n × max_tokens × (1 + "
                          f"logprobs)); the server returns at most {server.max_logprob_entries} in one response "
                          f"(--max-logprob-entries). Ask fewer alternatives, fewer tokens or fewer prompts",
                     param=logprobs_param)
    return None


def check_model(server: EngineServer, model: str | None, required: bool = True) -> JSONResponse | None:
    if (model is not None or required) and model != server.model_name:
        return error(404, f"The model `{model}` does not exist. This server serves `{server.model_name}`.",
                     "NotFoundError", "model")
    return None


def too_long(server: EngineServer, n_prompt: int, max_tokens: int, param: str) -> JSONResponse | None:
    ctx, spec_extra = server.max_model_len, server.speculative_extra_tokens
    if n_prompt + max_tokens + spec_extra > ctx:
        extra = f" (+{spec_extra} for speculative decoding)" if spec_extra else ""
        return error(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                          f"{n_prompt + max_tokens + spec_extra} tokens ({n_prompt} in the prompt, {max_tokens} in the "
                          f"completion{extra}). Please reduce the length of the prompt or the completion.", param=param)
    return None


def generation_request(server: EngineServer, body: SamplingIn, prompt: str | list[int], max_tokens: int | None,
                       param: str, logprobs: int | None = None) -> GenerationRequest | JSONResponse:
    """The engine request for one prompt: text, or token ids used as given (vLLM's TokensPrompt)."""
    if (bad := body.unsupported()) is not None:
        return error(400, bad[1], param=bad[0])
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < server.vocab_size:
            return error(400, f"logit_bias: '{key}' is not a token id of this model (0 to {server.vocab_size - 1}); "
                              f"keys are token ids as strings, as /tokenize gives them", param="logit_bias")
        bias.append((int(key), value))
    if logprobs is not None and body.stream:
        return error(400, "logprobs of generated tokens are returned without stream only; drop `stream` or "
                          "`logprobs`", param="logprobs")
    max_tokens = 16 if max_tokens is None else max_tokens
    if max_tokens < 1:
        return error(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    ids = None if isinstance(prompt, str) else tuple(prompt)
    text = prompt if isinstance(prompt, str) else server.decode(list(prompt))
    if (refused := too_long(server, server.n_prompt_tokens(text, ids), max_tokens, param)) is not None:
        return refused
    temperature = 1.0 if body.temperature is None else body.temperature
    return GenerationRequest(uuid.uuid4().hex, text, max_tokens, temperature, (body.seed or 0) % (2**63),
                             top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                             logprobs=logprobs, presence_penalty=body.presence_penalty or 0.0,
                             frequency_penalty=body.frequency_penalty or 0.0, logit_bias=tuple(bias), prompt_ids=ids)


async def echo_logprobs(server: EngineServer, body: CompletionIn, http: Request | None = None
                        ) -> JSONResponse | Response | dict:
    """Prompt log-probs, vLLM's echo semantics: for each prompt of the batch, [None, lp(token 1), …]
    over the prompt, `top_logprobs` with the `logprobs` most likely tokens at each position, and
    with max_tokens 1 the greedy next token appended (text, token, log-prob and alternatives), as
    OpenAI and vLLM append one; max_tokens 0 gives the prompt alone."""
    if not server.prompt_logprobs:
        return error(400, "echo with logprobs is not supported by this server", param="echo")
    if body.max_tokens not in (0, 1) or body.logprobs is None or body.stream:
        return error(400, "echo=true is served for prompt log-probs only: logprobs ≥ 0, max_tokens 0 (the prompt) or 1 "
                          "(the prompt and the greedy next token), no stream", param="echo")
    if body.max_tokens == 1 and body.temperature not in (None, 0.0):
        return error(400, "echo with max_tokens 1 appends the greedy next token; set temperature 0",
                     param="temperature")
    if (bad := body.unsupported()) is not None:
        return error(400, bad[1], param=bad[0])
    ctx, vocab, append = server.max_model_len, server.vocab_size, body.max_tokens == 1
    batch: list[list[int]] = []
    for index, prompt in enumerate(body.prompts()):
        where = "prompt" if len(body.prompts()) == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            ids = [server.engine.start_id] + server.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = prompt
            bad_ids = [i for i in ids if not 0 <= i < vocab]
            if bad_ids:
                return error(400, f"{where}: token id {bad_ids[0]} is out of vocabulary (valid ids: 0 to {vocab - 1})",
                             param="prompt")
        if len(ids) + append > ctx:
            return error(400, f"This model's maximum context length is {ctx} tokens. However, {where} has "
                              f"{len(ids)} tokens{' and asks for 1 more' if append else ''}. Please reduce the length "
                              f"of the prompt.", param="prompt")
        batch.append(ids)
    entries = sum(len(ids) + append for ids in batch) * (1 + body.logprobs)
    if entries > server.max_logprob_entries:
        return error(400, f"this echo asks for {entries} prompt log-probs (prompt tokens × (1 + logprobs)); the "
                          f"server returns at most {server.max_logprob_entries} in one response "
                          f"(--max-logprob-entries). Send fewer prompts per request, or ask fewer alternatives",
                     param="prompt" if len(batch) > 1 else "logprobs")
    choices, prompt_tokens = [], 0

    def name(t: int) -> str:  # vLLM's return_tokens_as_token_ids names tokens "token_id:<id>", never by text
        return f"token_id:{t}" if body.return_tokens_as_token_ids else server.token_strings([t])[0]

    for index, ids in enumerate(batch):
        try:
            job = server.submit(None, prompt_ids=ids, top_k=body.logprobs)
        except ShuttingDown as e:
            return error(503, str(e), "ServiceUnavailableError")
        try:
            kind, scores = await Events(http).next(job)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        if kind == "invalid":
            return error(400, scores, param="prompt")
        if kind == "error":
            return error(500, scores, "InternalServerError")
        token_ids = ids + [scores.next_token] if append else ids
        token_lps = [None, *scores.logprobs] + ([scores.next_logprob] if append else [])
        texts = server.token_strings(token_ids)
        offsets = text_offsets(texts)
        tokens = [name(t) for t in token_ids] if body.return_tokens_as_token_ids else texts
        top = None
        if body.logprobs:  # top[t] holds the alternatives for the token at position t + 1
            top = [None] + [{name(t): lp for t, lp in alternatives}
                            for alternatives in scores.top[: len(token_ids) - 1]]
        choices.append({"index": index, "text": "".join(texts), "finish_reason": "length",
                        "logprobs": {"tokens": tokens, "token_logprobs": token_lps, "text_offset": offsets,
                                     "top_logprobs": top}})
        prompt_tokens += len(ids)
    completion_tokens = len(batch) if append else 0
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


async def respond(server: EngineServer, jobs: list[ServeRequest], body: SamplingIn, http: Request | None,
                  chat: bool) -> Response | dict:
    """The `n` generations as one response, or as server-sent events with `stream` (the choices one
    after another, each chunk naming its index), cut at `stop` / `stop_token_ids` (stops.py). Once
    nobody will read a job (the client left, the response failed, or its stop string was reached)
    it is cancelled: it leaves the engine's batch, or its queue."""
    out: Response | dict = Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    try:
        out = await answer(server, jobs, body, http, chat)
    except ClientGone:
        pass
    finally:
        if not isinstance(out, StreamingResponse):  # a stream's generator cancels its jobs when it ends
            server.cancel(jobs)  # finished jobs are untouched; the rest stop
    return out
