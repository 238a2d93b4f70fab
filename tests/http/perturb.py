"""A perturbing OpenAI-compatible proxy on loopback, for seeding faults through the public
interface: every request goes to the upstream server (`canary engine-serve`) as it is, and the
answer of POST /v1/completions passes through a fault on its way back: `fault` on a JSON answer
(prompt log-probs), `stream_fault` on each event of a streamed one (generated text), relayed
event by event as the upstream sends it so that the client sees the server's timing. `delay_ms`
holds each streamed completion that long before sending it upstream: a TTFT regression of
exactly that much (and the proxy's own hop, which a baseline behind an identity proxy shares).
Every other route (/v1/models, /metrics) passes through untouched."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse


def zero_logprobs(answer: dict) -> dict:
    """Every token log-prob 0 (probability 1): a server that does not really score prompts."""
    for choice in answer.get("choices", []):
        lp = choice.get("logprobs") or {}
        lp["token_logprobs"] = [None if x is None else 0.0 for x in lp.get("token_logprobs") or []]
    return answer


def shift_logprobs(nats: float) -> Callable[[dict], dict]:
    """Every prompt token's log-prob lowered by `nats`: a candidate whose perplexity is exactly
    exp(nats) times the baseline's (a known-size quality loss)."""

    def fault(answer: dict) -> dict:
        for choice in answer.get("choices", []):
            lp = choice.get("logprobs") or {}
            lp["token_logprobs"] = [None if x is None else x - nats for x in lp.get("token_logprobs") or []]
        return answer

    return fault


def garble(rate: float, seed: int = 0) -> Callable[[dict], dict]:
    """Each streamed piece of generated text replaced, with probability `rate`, by as many random
    letters: a sampler or detokenizer bug after verification. Prompt log-probs are untouched."""
    rng = random.Random(seed)

    def fault(event: dict) -> dict:
        for choice in event.get("choices", []):
            text = choice.get("text") or ""
            if text.strip() and rng.random() < rate:
                choice["text"] = (" " if text.startswith(" ") else "") + "".join(
                    rng.choice("qxzjvkw") for _ in range(max(1, len(text.strip()))))
        return event

    return fault


def proxy_app(upstream: str, fault: Callable[[dict], dict] = lambda x: x,
              stream_fault: Callable[[dict], dict] = lambda x: x, delay_ms: float = 0.0) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=120)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        if path == "v1/completions" and json.loads(body or b"{}").get("stream"):
            # streamed through as the upstream sends it, event by event, so that the timing the
            # client sees is the server's (plus `delay_ms` before the first byte)
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            upstream_request = client.build_request("POST", "/" + path, content=body, headers=headers)
            answer = await client.send(upstream_request, stream=True)

            async def relay():
                pending = ""
                try:
                    async for text in answer.aiter_text():
                        pending += text
                        while "\n" in pending:
                            line, pending = pending.split("\n", 1)
                            if line.startswith("data: {"):
                                line = "data: " + json.dumps(stream_fault(json.loads(line[len("data: "):])))
                            yield (line + "\n").encode()
                    if pending:
                        yield pending.encode()
                finally:
                    await answer.aclose()

            return StreamingResponse(relay(), status_code=answer.status_code,
                                     media_type=answer.headers.get("content-type"))
        answer = await client.request(request.method, "/" + path, content=body,
                                      headers={"content-type": request.headers.get("content-type", "application/json")})
        content, kind = answer.content, answer.headers.get("content-type", "")
        if path == "v1/completions" and answer.status_code == 200:
            if kind.startswith("application/json"):
                content = json.dumps(fault(answer.json())).encode()
        return Response(content, status_code=answer.status_code, media_type=kind or None)

    return app
