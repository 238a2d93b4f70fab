"""The app factory and the `canary engine-serve` command line (options: --help)."""

from __future__ import annotations

import argparse
import hmac
import json
import os
from types import FrameType

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from workers.engine_server.engine_thread import EngineServer
from workers.engine_server.errors import error, param_of
from workers.engine_server.routes import router

MAX_BODY_BYTES = 16 << 20  # a 256-prompt batch of long documents as token ids fits; a bigger body is refused unread
API_KEY_ENV = "CANARY_ENGINE_API_KEY"  # --api-key's default, as vLLM reads VLLM_API_KEY


class Guard:
    """ASGI middleware in front of every route. A body longer than max_body bytes is refused with a
    413 before it is read (by its Content-Length) or as soon as it passes the bound (a chunked one):
    the server holds at most max_body bytes of any request. With an api_key, the /v1 routes ask for
    `Authorization: Bearer <key>` and answer 401 without it, as vLLM's --api-key does (the health,
    metrics and tokenizer routes stay open, as in vLLM)."""

    def __init__(self, app: ASGIApp, max_body: int, api_key: str | None) -> None:
        self.app, self.max_body, self.api_key = app, max_body, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await error(401, "a valid API key is required: send `Authorization: Bearer <key>` (the server was "
                                 "started with --api-key)", "AuthenticationError")(scope, receive, send)
                return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(scope, receive, send, int(declared))
            return
        body, more = bytearray(), True
        while more:  # read the body here, within the bound, and hand it to the route whole
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self._too_large(scope, receive, send, None)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_body} bytes"
        await error(413, f"the body is {size}; this server takes at most {self.max_body} (--max-body-bytes). Send "
                         f"fewer prompts per request", "RequestTooLargeError")(scope, receive, send)


def build_app(server: EngineServer, max_body: int = MAX_BODY_BYTES, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="canary engine-serve", version="1")
    app.state.engine_server = server
    app.add_middleware(Guard, max_body=max_body, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON ({(first.get('ctx') or {}).get('error', 'decode error')} "
                              f"at position {first['loc'][-1]})")
        param = param_of(first.get("loc", ()))
        if param is None:  # no body, or not an object: a list, a string, a form
            return error(400, "the body must be a JSON object (Content-Type: application/json)")
        msg = "; ".join(f"{param_of(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errs[:5])
        return error(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code,
                                                                                              "HTTPError")
        return error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)  # a bug answers JSON, never a dropped connection
    async def crashed(_request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"internal error: {type(exc).__name__}", "InternalServerError")

    app.include_router(router)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from pydantic import ValidationError

    from engines.registry import load_engine
    from engines.spec import KV_CACHE, WEIGHTS, OptimizationSpec
    from engines.zoo import ModelPathError, resolve_model_path

    ap = argparse.ArgumentParser(prog="canary engine-serve",
                                 description="the reference engine behind an OpenAI-compatible API")
    ap.add_argument("--model", default="builtin:pydoc-target", help="builtin:<zoo name> or an HF directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the --model value)")
    ap.add_argument("--weights", default="fp32", choices=WEIGHTS, metavar="WEIGHTS",
                    help=f"weight format (default fp32): {', '.join(WEIGHTS)}")
    ap.add_argument("--kv-cache", default="auto", choices=KV_CACHE, metavar="KV_CACHE",
                    help=f"KV cache format (default auto: the weights' dtype): {', '.join(KV_CACHE)}")
    ap.add_argument("--speculative", default="off", help='"off" or a JSON object, e.g. {"method": "ngram", "k": 4}')
    ap.add_argument("--no-prompt-logprobs", action="store_true",
                    help="refuse echo=true (like servers without prompt log-probs)")
    ap.add_argument("--per-request-spec-decode-metrics", choices=("none", "summary"), default="none",
                    help="summary: each response with speculative decoding carries its own figures under "
                         "metrics.speculative_decoding, as vLLM's flag of this name does (default none)")
    ap.add_argument("--enable-per-request-metrics", action="store_true",
                    help="each response carries its request's own timings under metrics (time_to_first_token_ms "
                         "from scheduling, queue_time_ms, mean_itl_ms, generation_time_ms, tokens_per_second), as "
                         "vLLM's flag of this name does")
    ap.add_argument("--max-num-seqs", type=positive, default=32,
                    help="requests decoded together in one continuous batch, as vLLM's flag of this name (default 32; "
                         "1 decodes one request at a time). A fault drill decodes one at a time")
    ap.add_argument("--max-queue", type=positive, default=256,
                    help="generation requests that may wait beyond the running batch (default 256); a request "
                         "arriving when that many wait is answered 429")
    ap.add_argument("--max-logprob-entries", type=positive, default=1 << 18,
                    help="log-probs one response may carry, counting each token's alternatives (default 262144, "
                         "about 7 MB of JSON); a request asking for more is answered 400")
    ap.add_argument("--max-body-bytes", type=positive, default=MAX_BODY_BYTES,
                    help=f"the largest request body, refused with 413 before it is read (default {MAX_BODY_BYTES})")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                    help=f"ask every /v1 request for `Authorization: Bearer <key>`, as vLLM's flag of this name "
                         f"(default: ${API_KEY_ENV}, else no key; the environment keeps it out of the process list)")
    ap.add_argument("--drain-timeout", type=float, default=5.0,
                    help="on SIGTERM, seconds the requests already taken may go on (new ones get 503); those "
                         "left then end with an error (default 5; 0 ends them at once)")
    ap.add_argument("--threads", type=positive, default=None,
                    help="torch threads for the engine (default: every core but one, at least 1: the HTTP front "
                         "end decodes and streams every request's tokens on a core of its own, as vLLM's CPU engine "
                         "keeps its compute threads apart from its API server)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100)")
    args = ap.parse_args(argv)
    try:
        speculative = {"method": "off"} if args.speculative == "off" else json.loads(args.speculative)
        spec = OptimizationSpec(engine="reference", weights=args.weights, kv_cache=args.kv_cache,
                                speculative=speculative)
        path = resolve_model_path(args.model)
    except json.JSONDecodeError as e:
        ap.error(f"--speculative: not JSON ({e.msg}); give \"off\" or e.g. '{{\"method\": \"ngram\", \"k\": 4}}'")
    except ValidationError as e:
        first = e.errors()[0]
        ap.error(f"--speculative: {'.'.join(str(x) for x in first['loc'][1:])}: {first['msg']}")
    except ModelPathError as e:
        ap.error(f"--model: {e}")
    import torch

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    try:
        engine = load_engine(str(path), spec)
    except ValueError as e:  # a format this machine cannot run, AWQ without calibration text, …
        ap.error(str(e).splitlines()[0])
    server = EngineServer(engine, args.served_model_name or args.model, prompt_logprobs=not args.no_prompt_logprobs,
                          per_request_spec_metrics=args.per_request_spec_decode_metrics == "summary",
                          max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                          per_request_metrics=args.enable_per_request_metrics,
                          max_logprob_entries=args.max_logprob_entries)
    drain = max(0.0, args.drain_timeout)
    config = uvicorn.Config(build_app(server, args.max_body_bytes, args.api_key), host=args.host, port=args.port,
                            log_level="warning",
                            timeout_graceful_shutdown=int(drain) + 5)  # a backstop: the engine ends them by then

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # SIGTERM / SIGINT: uvicorn stops listening and waits for open requests; the engine takes no
            # new one, lets those it holds finish until the drain deadline, then fails the rest
            server.request_stop(drain)
            super().handle_exit(sig, frame)

    Server(config).run()


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
