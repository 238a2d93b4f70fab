"""A completion's answer from its jobs' events: one JSON response, or server-sent events with
`stream` (the choices one after another, each chunk naming its index), cut at `stop` /
`stop_token_ids` (stops.py), in OpenAI's shape with vLLM's additions (stop_reason, per-request
speculative-decoding metrics)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.protocol import GenerationResult, SpeculativeStats
from workers.engine_server.engine_thread import EngineServer
from workers.engine_server.errors import error
from workers.engine_server.jobs import ServeRequest
from workers.engine_server.schemas import SamplingIn
from workers.engine_server.stops import StopScanner


class ClientGone(Exception):
    """The client of a request that is not streamed disconnected while it waited."""


class Events:
    """Reads jobs' events for one request, asking every half second whether its client has gone
    (ClientGone): a request that is not streamed learns it no other way (a streamed one does from
    Starlette, which closes its generator)."""

    def __init__(self, http: Request | None):
        self.http, self.checked = http, time.monotonic()

    async def next(self, job: ServeRequest) -> tuple:
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


class _Answer:
    """The pieces of one answer: its id and object names, a choice's shape, the usage block."""

    def __init__(self, server: EngineServer, jobs: list[ServeRequest], body: SamplingIn, http: Request | None,
                 chat: bool):
        self.server, self.jobs, self.body, self.http, self.chat = server, jobs, body, http, chat
        self.rid = ("chatcmpl-" if chat else "cmpl-") + jobs[0].request.request_id
        self.obj = "chat.completion" if chat else "text_completion"
        self.eos_id = server.engine.tokenizer.eos_token_id
        self.stopping = bool(body.stops() or body.stop_token_ids)
        self.results: list = []  # each job's GenerationResult, once done

    def scanner(self) -> StopScanner | None:
        return (StopScanner(self.body.stops(), self.body.stop_token_ids or [], self.server.decode) if self.stopping
                else None)

    def choice(self, index: int, text: str, finish: str | None, delta: bool,
               stop_reason: str | int | None = None) -> dict:
        if self.chat:
            out = {"index": index, ("delta" if delta else "message"): {"role": "assistant", "content": text},
                   "finish_reason": finish, "logprobs": None}
        else:
            out = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        if finish is not None:
            out["stop_reason"] = stop_reason  # vLLM: the stop string or token id, None at EOS or the length
        return out

    def finish_of(self, result: GenerationResult) -> str:
        return "stop" if result.token_ids and result.token_ids[-1] == self.eos_id else "length"

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def per_request_metrics(self) -> dict:
        """vLLM's per-request `metrics` for one generation (vLLM leaves them out for n > 1): its
        timings (--enable-per-request-metrics) and its speculative-decoding figures
        (--per-request-spec-decode-metrics summary), each where the server was started with it."""
        if len(self.jobs) != 1 or not self.results:
            return {}
        out = timing_metrics(self.jobs[0], len(self.results[0].token_ids)) if self.server.per_request_metrics else {}
        spec = self.results[0].spec
        if self.server.per_request_spec_metrics and spec is not None:
            out["speculative_decoding"] = spec_decode_metrics(spec)
        return {"metrics": out} if out else {}

    @staticmethod
    def failure(kind: str, payload: str) -> JSONResponse:
        return error(400, payload, param="prompt") if kind == "invalid" else error(500, payload, "InternalServerError")

    def chunk(self, choices: list[dict], **more: Any) -> str:
        head = {"id": self.rid, "object": self.obj + (".chunk" if self.chat else ""), "model": self.server.model_name}
        return f"data: {json.dumps({**head, 'choices': choices, **more})}\n\n"

    async def stream(self, first: tuple) -> AsyncIterator[str]:
        """The events of every job in turn (`first`: the first job's first event, already read)."""
        server, prompt_tokens, completion_tokens = self.server, 0, 0
        for index, job in enumerate(self.jobs):
            scan = self.scanner()
            event = first if index == 0 else await job.events.get()
            while True:
                kind, payload = event
                if kind == "tokens":
                    text, stopped = scan.feed(payload) if scan is not None else (server.decode(payload), False)
                    if text:
                        yield self.chunk([self.choice(index, text, None, True)])
                    if stopped:  # the client has its answer: the job leaves the batch
                        assert scan is not None  # only a scanner stops a job early
                        server.cancel([job], "stop")
                        completion_tokens += len(scan.ids)
                        yield self.chunk([self.choice(index, "", "stop", True, scan.reason)])
                        prompt_tokens += server.n_prompt_tokens(job.request.prompt, job.request.prompt_ids)
                        break
                elif kind == "done":
                    rest = scan.finish() if scan is not None else ""
                    if rest:
                        yield self.chunk([self.choice(index, rest, None, True)])
                    yield self.chunk([self.choice(index, "", self.finish_of(payload), True)])
                    self.results.append(payload)
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
        yield self.chunk([], usage=self.usage(prompt_tokens, completion_tokens), **self.per_request_metrics())
        yield "data: [DONE]\n\n"

    async def whole(self) -> dict | JSONResponse:
        """Every job's result, waited for, as one response."""
        choices, prompt_tokens, completion_tokens = [], 0, 0
        job_events = Events(self.http)
        for index, job in enumerate(self.jobs):
            while True:
                kind, payload = await job_events.next(job)
                if kind == "done":
                    break
                if kind in ("invalid", "error"):
                    return self.failure(kind, payload)
            scan = self.scanner()
            if scan is not None and scan.feed(payload.token_ids)[1]:
                choices.append(self.choice(index, scan.text(), "stop", False, scan.reason))
                kept = len(scan.ids)
            else:
                choices.append(self.choice(index, payload.text, self.finish_of(payload), False))
                kept = len(payload.token_ids)
            if job.request.logprobs is not None:
                choices[-1]["logprobs"] = generated_logprobs(self.server, payload, kept, self.chat)
            completion_tokens += kept
            prompt_tokens += payload.prompt_tokens
            self.results.append(payload)
        return {"id": self.rid, "object": self.obj, "created": int(time.time()), "model": self.server.model_name,
                "choices": choices, "usage": self.usage(prompt_tokens, completion_tokens),
                **self.per_request_metrics()}


async def answer(server: EngineServer, jobs: list[ServeRequest], body: SamplingIn, http: Request | None,
                 chat: bool) -> dict | JSONResponse | StreamingResponse:
    """The jobs' answer: streamed with `body.stream`, else whole; a refusal before any token is a
    400 either way (a stream's first event decides its status)."""
    reply = _Answer(server, jobs, body, http, chat)
    if not body.stream:
        return await reply.whole()
    first = await Events(http).next(jobs[0])
    if first[0] in ("invalid", "error"):
        return reply.failure(*first)

    async def events() -> AsyncIterator[str]:
        try:
            async for event in reply.stream(first):
                yield event
        finally:  # the stream ended, or Starlette closed it when the client disconnected
            server.cancel(jobs)

    return StreamingResponse(events(), media_type="text/event-stream")


def timing_metrics(job: ServeRequest, n_generated: int) -> dict:
    """A request's own timings as vLLM's build_per_request_timing_metrics gives them, in ms: TTFT
    from scheduling (the engine taking it from the queue) to its first token; the queue wait;
    the decode interval (first to last token) and its mean per gap; output tokens per second from
    scheduling to the last token. A figure whose clock readings are missing is left out."""
    out: dict[str, float] = {}
    first, last = (job.stamps[0], job.stamps[-1]) if job.stamps else (None, None)
    if job.started is not None:
        out["queue_time_ms"] = (job.started - job.arrived) * 1000
        if first is not None and last is not None:
            out["time_to_first_token_ms"] = (first - job.started) * 1000
            if last > job.started:
                out["tokens_per_second"] = n_generated / (last - job.started)
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
        if n_generated > 1:
            out["mean_itl_ms"] = (last - first) / (n_generated - 1) * 1000
    return out


def spec_decode_metrics(spec: SpeculativeStats) -> dict:
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


def generated_logprobs(server: EngineServer, result: GenerationResult, kept: int, chat: bool) -> dict:
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
