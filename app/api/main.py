"""FastAPI application: thin routes over app.repo and app.services."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import anyio
import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from sqlalchemy import text
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from app import __version__
from app.api.deps import get_key
from app.api.limits import BodyLimit, InFlightLimit, RateLimited
from app.api.routes import router
from app.auth import Forbidden, Unauthorized
from app.corpus import CorpusError
from app.dispatch import RECONCILE, REFRESH_ALERTS, TICK_SCHEDULES, WARM_UP, get_dispatcher
from app.repo import Conflict, NotFound, QueueFull
from app.schemas import error_responses
from app.settings import get_settings
from app.ssrf import hide_url_logs

log = logging.getLogger(__name__)
hide_url_logs()


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    # Embedded default: no Celery beat, so the API process runs the reconciler itself — once at
    # start (runs left queued by a previous process) and then every CANARY_RECONCILE_SECONDS. With Celery, the
    # single beat (`canary worker --beat` on one worker) schedules it instead.
    stop = threading.Event()
    # the sync routes' worker threads (anyio's default limiter, 40): a few, so that concurrent
    # requests queue in arrival order instead of all slowing each other down on the interpreter lock
    anyio.to_thread.current_default_thread_limiter().total_tokens = get_settings().api_threads
    if get_settings().execution_mode == "inline":
        def loop() -> None:
            while True:
                try:
                    get_dispatcher(background=True).send(RECONCILE)
                    get_dispatcher(background=True).send(TICK_SCHEDULES)
                except Exception:
                    log.exception("reconciler could not be scheduled")
                if stop.wait(get_settings().reconcile_seconds):
                    return

        def refresher() -> None:  # Alertmanager resolves a firing alert that is not re-sent
            while not stop.wait(get_settings().alertmanager_resend_seconds):
                try:
                    get_dispatcher(background=True).send(REFRESH_ALERTS)
                except Exception:
                    log.exception("alert refresh could not be scheduled")

        try:  # first in the executor's queue: the engine imports overlap the server's first requests
            get_dispatcher(background=True).send(WARM_UP)
        except Exception:
            log.exception("engine warm-up could not be scheduled")
        threading.Thread(target=loop, name="canary-reconciler", daemon=True).start()
        threading.Thread(target=refresher, name="canary-alert-refresh", daemon=True).start()
    yield
    stop.set()


app = FastAPI(title="inference-canary", version=__version__, lifespan=lifespan,
              description="Quality canary for optimized LLM inference: configs vs an fp16 baseline, with paired "
                          "statistics.")
# every /api route can answer these (auth, body deadline and limit, validation, rate limit); routers
# add their own. get_key on every route: it checks the key and takes from the rate-limit buckets
# (app/api/limits.py)
app.include_router(router, prefix="/api/v1", responses=error_responses(401, 408, 413, 422, 429),
                   dependencies=[Depends(get_key)])


# outermost: bodies are read (counted as they arrive, bounded in size and time) before routing and
# before the key is checked; then at most CANARY_API_THREADS requests whose body has arrived go on
# into the app at once (app/api/limits.py)
app.add_middleware(InFlightLimit)
app.add_middleware(BodyLimit)


@app.exception_handler(RateLimited)
async def _rate_limited(_: Request, exc: RateLimited) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})


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


@app.exception_handler(QueueFull)
async def _queue_full(_: Request, exc: QueueFull) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": "60"})


@app.exception_handler(DataError)
async def _unstorable(_: Request, exc: DataError) -> JSONResponse:
    # PostgreSQL refuses what SQLite stores: a NUL character (\u0000) in a string, a number out of
    # a column's range. The transaction rolled back; nothing was stored.
    return JSONResponse({"detail": f"a value cannot be stored ({type(exc.orig).__name__}): remove NUL characters "
                                   "(\\u0000) from strings and keep numbers within range"}, status_code=422)


@app.exception_handler(IntegrityError)
async def _integrity(_: Request, exc: IntegrityError) -> JSONResponse:
    # Two concurrent creates of the same name (or key): the loser of the race gets a 409.
    return JSONResponse({"detail": "conflict: an object with the same unique name or key was written concurrently; "
                                   "retry"}, status_code=409)


@app.exception_handler(RequestValidationError)
async def _request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Name the field and what is wrong, never echo the input: a rejected channel body carries its
    # webhook URL and signing secret, and NaN or Infinity cannot be written back as JSON anyway.
    detail = [{key: error[key] for key in ("type", "loc", "msg") if key in error} for error in exc.errors()]
    return JSONResponse({"detail": detail}, status_code=422)


@app.exception_handler(CorpusError)
@app.exception_handler(ValueError)
async def _invalid(_: Request, exc: ValueError) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=422)


@app.get("/metrics", tags=["health"], include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus exposition (app/prometheus.py). Without a key: only figures with no project in them.
    With a `metrics` key: its project's figures too; with a `metrics-all` key: every project's.
    Prometheus sends the key with `authorization: {credentials_file: …}` (docs/api.md)."""
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        generate_latest,
    )

    from app.api import limits
    from app.auth import METRICS_SCOPES, authenticate
    from app.db import session_scope
    from app.prometheus import CanaryCollector, PublicCollector

    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    buckets = {"requests": (len(limits.requests), limits.requests.max_entries),
               "auth_failures": (len(limits.auth_failures), limits.auth_failures.max_entries)}
    registry.register(PublicCollector(__version__, buckets))
    authorization = request.headers.get("authorization")
    if authorization:
        try:
            with session_scope() as session:
                key = authenticate(session, authorization, True)
                key_id, scope, project_id = key.id, key.scope, key.project_id
        except Unauthorized:
            limits.authentication_failed(limits.client_address(request))
            raise
        limits.take_request(("key", key_id))
        if scope not in METRICS_SCOPES:
            raise Forbidden("/metrics with a key needs one with the metrics scope: an operator runs "
                            "`canary keys create --project P --scope metrics` (or --scope metrics-all for every "
                            "project)")
        registry.register(CanaryCollector(session_scope, None if scope == "metrics-all" else project_id))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class HealthOut(BaseModel):
    status: Literal["ok", "unavailable"]
    version: str
    down: dict[str, str] = Field(default_factory=dict, description="what cannot be reached (database, broker) and why")


def _first_line(e: BaseException) -> str:
    return (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])[0][:300]


# /healthz is outside the in-flight limit (app/api/limits.py) and runs its checks on threads of its
# own: a probe is answered while every one of the CANARY_API_THREADS is busy
_health_threads: anyio.CapacityLimiter | None = None


@app.get("/healthz", tags=["health"], response_model=HealthOut, responses={503: {"model": HealthOut}})
async def healthz() -> Response:
    """200 when the database (and, with Celery, the broker) answers; else a JSON 503 naming what is down."""
    global _health_threads
    if _health_threads is None:  # made in the server's event loop
        _health_threads = anyio.CapacityLimiter(2)
    return await anyio.to_thread.run_sync(_health, limiter=_health_threads)


def _health() -> Response:
    from app.db import get_engine

    down = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001 - any failure to reach it is "down", with its reason
        down["database"] = _first_line(e)
    settings = get_settings()
    if settings.execution_mode == "celery" and settings.broker_url:
        from kombu import Connection

        try:
            with Connection(settings.broker_url, connect_timeout=2) as conn:
                conn.ensure_connection(max_retries=1, timeout=2)
        except Exception as e:  # noqa: BLE001
            down["broker"] = _first_line(e)
    body = HealthOut(status="unavailable" if down else "ok", version=__version__, down=down)
    return JSONResponse(body.model_dump(), status_code=503 if down else 200)


@app.exception_handler(OperationalError)
async def _database_down(_: Request, exc: OperationalError) -> JSONResponse:
    log.error("database unavailable: %s", _first_line(exc))
    return JSONResponse({"detail": "the database is unavailable; GET /healthz says what is down"}, status_code=503)
