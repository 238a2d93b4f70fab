"""A perturbing OpenAI-compatible proxy on loopback, for seeding faults through the public
interface: every request goes to the upstream server (`canary engine-serve`) as it is, and the
JSON answer of a non-streaming POST /v1/completions passes through `fault` on its way back.
Streaming answers and every other route (/v1/models, /metrics) pass through untouched."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request, Response


def zero_logprobs(answer: dict) -> dict:
    """Every token log-prob 0 (probability 1): a server that does not really score prompts."""
    for choice in answer.get("choices", []):
        lp = choice.get("logprobs") or {}
        lp["token_logprobs"] = [None if x is None else 0.0 for x in lp.get("token_logprobs") or []]
    return answer


def proxy_app(upstream: str, fault: Callable[[dict], dict]) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=120)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        answer = await client.request(request.method, "/" + path, content=body,
                                      headers={"content-type": request.headers.get("content-type", "application/json")})
        content = answer.content
        if (path == "v1/completions" and answer.status_code == 200
                and answer.headers.get("content-type", "").startswith("application/json")):
            import json

            content = json.dumps(fault(answer.json())).encode()
        return Response(content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    return app
