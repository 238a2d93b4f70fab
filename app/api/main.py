"""FastAPI application: thin routes over app.repo and app.services."""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text
from sqlalchemy.exc import DataError, IntegrityError

from app import __version__
from app.api.deps import SessionDep
from app.auth import Forbidden, Unauthorized
from app.api.routes import router
from app.corpus import CorpusError
from app.dispatch import RECONCILE, TICK_SCHEDULES, get_dispatcher
from app.settings import get_settings
from app.ssrf import hide_url_logs
from app.repo import Conflict, NotFound
from app.schemas import error_responses

log = logging.getLogger(__name__)
hide_url_logs()
MAX_BODY_BYTES = 64 * 1024 * 1024


@asynccontextmanager
async def lifespan(_: FastAPI):
    # Embedded default: no Celery beat, so the API process runs the reconciler itself — once at
    # start (runs left queued by a previous process) and then every CANARY_RECONCILE_SECONDS. With Celery, the
    # single beat (`canary worker --beat` on one worker) schedules it instead.
    stop = threading.Event()
    if get_settings().execution_mode == "inline":
        def loop() -> None:
            while True:
                try:
                    get_dispatcher(background=True).send(RECONCILE)
                    get_dispatcher(background=True).send(TICK_SCHEDULES)
                except Exception:  # noqa: BLE001
                    log.exception("reconciler could not be scheduled")
                if stop.wait(get_settings().reconcile_seconds):
                    return

        threading.Thread(target=loop, name="canary-reconciler", daemon=True).start()
    yield
    stop.set()


app = FastAPI(title="inference-canary", version=__version__, lifespan=lifespan,
              description="Quality canary for optimized LLM inference: configs vs an fp16 baseline, with paired statistics.")
# every /api route can answer these (auth, body limit, validation, rate limit); routers add their own
app.include_router(router, prefix="/api/v1", responses=error_responses(401, 413, 422, 429))


class RateLimiter:
    """A token bucket per API key (per client address without one), in this process: a burst of
    `per_minute` requests, refilled at per_minute / 60 per second. Several API replicas each
    hold their own buckets (put a shared limiter in front for a global limit)."""

    def __init__(self):
        self.buckets: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def take(self, who: str, per_minute: int, now: float) -> float:
        """0 when the request may pass, else seconds until a token is available."""
        rate = per_minute / 60.0
        with self.lock:
            tokens, last = self.buckets.get(who, (float(per_minute), now))
            tokens = min(float(per_minute), tokens + (now - last) * rate)
            if tokens >= 1:
                self.buckets[who] = (tokens - 1, now)
                return 0.0
            self.buckets[who] = (tokens, now)
            return (1 - tokens) / rate


limiter = RateLimiter()


@app.middleware("http")
async def rate_limit(request: Request, call_next):
    import hashlib
    import math
    import time

    per_minute = get_settings().rate_limit_per_minute
    if per_minute > 0 and request.url.path.startswith("/api/"):
        auth = request.headers.get("authorization") or ""
        who = "key:" + hashlib.sha256(auth.encode()).hexdigest() if auth else "ip:" + (request.client.host if request.client else "?")
        wait = limiter.take(who, per_minute, time.monotonic())
        if wait > 0:
            return JSONResponse({"detail": f"rate limit of {per_minute} requests per minute exceeded; retry after {math.ceil(wait)} s"},
                                status_code=429, headers={"Retry-After": str(math.ceil(wait))})
    return await call_next(request)


@app.middleware("http")
async def limit_body(request: Request, call_next):
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        return JSONResponse({"detail": f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}; split the upload"}, status_code=413)
    return await call_next(request)


@app.exception_handler(Unauthorized)
async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


@app.exception_handler(Forbidden)
async def _forbidden(_: Request, exc: Forbidden) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=403)


@app.exception_handler(NotFound)
async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=404)


@app.exception_handler(Conflict)
async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=409)


@app.exception_handler(DataError)
async def _unstorable(_: Request, exc: DataError) -> JSONResponse:
    # PostgreSQL refuses what SQLite stores: a NUL character (\u0000) in a string, a number out of
    # a column's range. The transaction rolled back; nothing was stored.
    return JSONResponse({"detail": f"a value cannot be stored ({type(exc.orig).__name__}): remove NUL characters "
                                   "(\\u0000) from strings and keep numbers within range"}, status_code=422)


@app.exception_handler(IntegrityError)
async def _integrity(_: Request, exc: IntegrityError) -> JSONResponse:
    # Two concurrent creates of the same name (or key): the loser of the race gets a 409.
    return JSONResponse({"detail": "conflict: an object with the same unique name or key was written concurrently; retry"}, status_code=409)


@app.exception_handler(RequestValidationError)
async def _request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Name the field and what is wrong, never echo the input: a rejected channel body carries its
    # webhook URL and signing secret, and NaN or Infinity cannot be written back as JSON anyway.
    return JSONResponse({"detail": [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()]}, status_code=422)


@app.exception_handler(CorpusError)
@app.exception_handler(ValueError)
async def _invalid(_: Request, exc: ValueError) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=422)


_registry = None


@app.get("/metrics", tags=["health"], include_in_schema=False)
def metrics() -> Response:
    """Prometheus exposition: service and canary metrics, read from the database (app/metrics.py)."""
    global _registry
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from app.db import session_scope
    from app.metrics import CanaryCollector

    if _registry is None:
        _registry = CollectorRegistry()
        _registry.register(CanaryCollector(session_scope))
    return Response(generate_latest(_registry), media_type=CONTENT_TYPE_LATEST)


@app.get("/healthz", tags=["health"])
def healthz(session: SessionDep) -> dict:
    session.execute(text("SELECT 1"))
    return {"status": "ok", "version": __version__}
