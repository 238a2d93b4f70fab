"""The OpenAI-compatible routes. Each reads the EngineServer from the app (ServerDep); every
refusal is a response in vLLM's error shape (errors.py), never an exception."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.protocol import GenerationRequest, SpecStats
from workers.engine_server.engine_thread import EngineServer, Job, QueueFull
from workers.engine_server.errors import error
from workers.engine_server.schemas import ChatIn, CompletionIn, DetokenizeIn, SamplingIn, TokenizeIn
from workers.engine_server.stops import StopScanner


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


@router.get("/v1/models/{model_id:path}")
def model(model_id: str, server: ServerDep):
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


@router.post("/detokenize")
async def detokenize(body: DetokenizeIn, server: ServerDep):
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


@router.post("/tokenize")
async def tokenize(body: TokenizeIn, server: ServerDep):
    if (bad := check_model(server, body.model, required=False)) is not None:
        return bad
    ids = server.engine.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
    if body.add_special_tokens:
        ids = [server.engine.start_id] + ids
    return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}


@router.post("/v1/completions")
async def completions(body: CompletionIn, server: ServerDep, http: Request):
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


@router.post("/v1/chat/completions")
async def chat(body: ChatIn, server: ServerDep, http: Request):
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
                   body: SamplingIn) -> list[Job] | JSONResponse:
    """`n` choices of each request, each its own engine job, in OpenAI's order (prompt by prompt,
    each prompt's choices together); choice i samples with seed + i. A full queue: a 429."""
    n = body.n or 1
    choices = [replace(request, request_id=f"{request.request_id}-{i}" if i else request.request_id,
                       seed=(request.seed + i) % (2**63))
               for request in requests for i in range(n)]
    try:
        jobs = server.submit_all(choices, stream=bool(body.stream))
    except QueueFull as e:
        return error(429, str(e), "RateLimitError")
    for _ in requests:
        server.metrics.params_n.observe(n)
    return jobs


class ClientGone(Exception):
    """The client of a request that is not streamed disconnected while it waited."""


class Events:
    """Reads jobs' events for one request, asking every half second whether its client has gone
    (ClientGone): a request that is not streamed learns it no other way (a streamed one does from
    Starlette, which closes its generator)."""

    def __init__(self, http: Request | None):
        self.http, self.checked = http, time.monotonic()

    async def next(self, job: Job) -> tuple:
        while True:
            if self.http is not None and time.monotonic() - self.checked >= 0.5:
                self.checked = time.monotonic()
                if await self.http.is_disconnected():
                    raise ClientGone
            if not job.events.empty():
                return job.events.get_nowait()
            getter = asyncio.ensure_future(job.events.get())
            try:
                done, _ = await asyncio.wait({getter}, timeout=0.5)
                if done:
                    return getter.result()
            finally:
                getter.cancel()  # a pending get takes nothing from the queue


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
    choices, prompt_tokens = [], 0
    for index, ids in enumerate(batch):
        job = server.submit(None, prompt_ids=ids, top_k=body.logprobs)
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
        tokens = server.token_strings(token_ids)
        offsets = text_offsets(tokens)
        top = None
        if body.logprobs:  # top[t] holds the alternatives for the token at position t + 1
            top = [None] + [{server.token_strings([t])[0]: lp for t, lp in alternatives}
                            for alternatives in scores.top[: len(token_ids) - 1]]
        choices.append({"index": index, "text": "".join(tokens), "finish_reason": "length",
                        "logprobs": {"tokens": tokens, "token_logprobs": token_lps, "text_offset": offsets,
                                     "top_logprobs": top}})
        prompt_tokens += len(ids)
    completion_tokens = len(batch) if append else 0
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


async def respond(server: EngineServer, jobs: list[Job], body: SamplingIn, http: Request | None, chat: bool):
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


async def answer(server: EngineServer, jobs: list[Job], body: SamplingIn, http: Request | None, chat: bool):
    name = server.model_name
    rid = ("chatcmpl-" if chat else "cmpl-") + jobs[0].request.request_id
    obj = "chat.completion" if chat else "text_completion"
    eos_id = server.engine.tokenizer.eos_token_id
    stopping = bool(body.stops() or body.stop_token_ids)

    def scanner() -> StopScanner | None:
        return StopScanner(body.stops(), body.stop_token_ids or [], server.decode) if stopping else None

    def choice(index: int, text: str, finish: str | None, delta: bool, stop_reason=None) -> dict:
        if chat:
            out = {"index": index, ("delta" if delta else "message"): {"role": "assistant", "content": text},
                   "finish_reason": finish, "logprobs": None}
        else:
            out = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        if finish is not None:
            out["stop_reason"] = stop_reason  # vLLM: the stop string or token id, None at EOS or the length
        return out

    def finish_of(result) -> str:
        return "stop" if result.token_ids and result.token_ids[-1] == eos_id else "length"

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    results: list = []  # each job's GenerationResult, once done

    def per_request_metrics() -> dict:
        """vLLM's per-request speculative-decoding figures, for one generation (vLLM leaves them out for n > 1)."""
        spec = results[0].spec if len(jobs) == 1 and results else None
        if not server.per_request_spec_metrics or spec is None:
            return {}
        return {"metrics": {"speculative_decoding": spec_decode_metrics(spec)}}

    def failure(kind: str, payload: str) -> JSONResponse:
        return error(400, payload, param="prompt") if kind == "invalid" else error(500, payload, "InternalServerError")

    if body.stream:
        # the first event decides the status: a refusal before any token is still a 400
        first = await Events(http).next(jobs[0])
        if first[0] in ("invalid", "error"):
            return failure(*first)

        async def events():
            try:
                async for event in stream_events():
                    yield event
            finally:  # the stream ended, or Starlette closed it when the client disconnected
                server.cancel(jobs)

        async def stream_events():
            prompt_tokens = completion_tokens = 0
            for index, job in enumerate(jobs):
                scan = scanner()
                event = first if index == 0 else await job.events.get()
                while True:
                    kind, payload = event
                    chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "model": name}
                    if kind == "tokens":
                        text, stopped = scan.feed(payload) if scan is not None else (server.decode(payload), False)
                        if text:
                            yield f"data: {json.dumps({**chunk, 'choices': [choice(index, text, None, True)]})}\n\n"
                        if stopped:  # the client has its answer: the job leaves the batch
                            assert scan is not None  # only a scanner stops a job early
                            server.cancel([job], "stop")
                            completion_tokens += len(scan.ids)
                            final = choice(index, "", "stop", True, scan.reason)
                            yield f"data: {json.dumps({**chunk, 'choices': [final]})}\n\n"
                            prompt_tokens += server.n_prompt_tokens(job.request.prompt, job.request.prompt_ids)
                            break
                    elif kind == "done":
                        rest = scan.finish() if scan is not None else ""
                        if rest:
                            yield f"data: {json.dumps({**chunk, 'choices': [choice(index, rest, None, True)]})}\n\n"
                        final = choice(index, "", finish_of(payload), True)
                        yield f"data: {json.dumps({**chunk, 'choices': [final]})}\n\n"
                        results.append(payload)
                        prompt_tokens += payload.prompt_tokens
                        completion_tokens += len(payload.token_ids)
                        break
                    else:
                        code = 400 if kind == "invalid" else 500
                        kind_name = "BadRequestError" if code == 400 else "InternalServerError"
                        failed = {"error": {"message": payload, "type": kind_name, "param": None, "code": code}}
                        yield f"data: {json.dumps(failed)}\n\n"
                        return
                    event = await job.events.get()
            last = {"id": rid, "object": obj + (".chunk" if chat else ""), "model": name, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens), **per_request_metrics()}
            yield f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    choices, prompt_tokens, completion_tokens = [], 0, 0
    job_events = Events(http)
    for index, job in enumerate(jobs):
        while True:
            kind, payload = await job_events.next(job)
            if kind == "done":
                break
            if kind in ("invalid", "error"):
                return failure(kind, payload)
        scan = scanner()
        if scan is not None and scan.feed(payload.token_ids)[1]:
            choices.append(choice(index, scan.text(), "stop", False, scan.reason))
            kept = len(scan.ids)
        else:
            choices.append(choice(index, payload.text, finish_of(payload), False))
            kept = len(payload.token_ids)
        if job.request.logprobs is not None:
            choices[-1]["logprobs"] = generated_logprobs(server, payload, kept, chat)
        completion_tokens += kept
        prompt_tokens += payload.prompt_tokens
        results.append(payload)
    return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens), **per_request_metrics()}


def spec_decode_metrics(spec: SpecStats) -> dict:
    """A request's counters in vLLM's `metrics.speculative_decoding` summary (vLLM PR #48915):
    acceptance_histogram[j] = verification steps that accepted exactly j draft tokens. Drafts are
    accepted from the front, so the steps that accepted at least i + 1 are accepted_per_position[i],
    and exactly j is the difference of two neighbours (all drafts for j = 0, none past k)."""
    at_least = [spec.num_drafts, *spec.accepted_per_position, 0]
    histogram = [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]
    return {"mean_acceptance_length": spec.mean_acceptance_length or 0.0,
            "draft_acceptance_rate": spec.acceptance_rate or 0.0, "acceptance_histogram": histogram,
            "num_spec_steps": spec.num_drafts, "num_accepted_draft_tokens": spec.num_accepted_tokens,
            "num_draft_tokens": spec.num_draft_tokens, "num_spec_tokens": len(spec.accepted_per_position)}


def generated_logprobs(server: EngineServer, result, kept: int, chat: bool) -> dict:
    """The generated tokens' log-probs in OpenAI's shape: for a completion, {tokens, token_logprobs,
    top_logprobs, text_offset}; for chat, {content: [{token, logprob, bytes, top_logprobs}]}."""
    ids = list(result.token_ids[:kept])
    scored = result.token_logprobs[:kept]
    strings = server.token_strings(ids)
    if chat:
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(text, lp), "top_logprobs": [entry(server.token_strings([t])[0], x)
                                                                  for t, x in top]}
                            for text, (lp, top) in zip(strings, scored, strict=True)]}
    return {"tokens": strings, "token_logprobs": [lp for lp, _ in scored],
            "top_logprobs": [{server.token_strings([t])[0]: x for t, x in top} for _, top in scored],
            "text_offset": text_offsets(strings)}


def text_offsets(tokens: list[str]) -> list[int]:
    """OpenAI's text_offset: where each token's text starts in the tokens' text joined."""
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets
