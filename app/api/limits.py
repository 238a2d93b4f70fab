"""Request limits of the API (docs/reference.md §10), all held in this API process.

- Body size and time: a pure ASGI wrapper around the whole app reads each request's body before
  the app sees it, counting the bytes actually received (chunked bodies carry no Content-Length,
  and a Content-Length can lie): 413 as soon as the count passes CANARY_MAX_BODY_BYTES (64 KiB
  without a key where keys are required), 408 when the body is not complete within
  CANARY_BODY_TIMEOUT_SECONDS — before routing and before the key is checked.
- Requests inside the app: at most CANARY_API_THREADS at once, and a request takes its place only
  once its body has arrived, so clients that trickle a body hold a socket, never a place (/healthz
  is not counted).
- Request rate: a token bucket per API key *id* (after the key is parsed and checked, so
  whitespace or case variants of one key share its bucket), or per client address when no key
  is sent and none is required.
- Failed authentication: a separate bucket per client address, taken from by requests whose key
  is missing, unknown or revoked; when it is empty they get 429 instead of 401. A valid key is
  looked up first and never counted or limited here, so a flood of bad keys from a shared
  address (a proxy, a NAT) does not lock out the valid keys behind it. (Keys hold 256 random
  bits: the limit bounds the cost of failures, not the odds of guessing; each bad key costs one
  indexed lookup of its hash.)
- The bucket maps are bounded (least recently used entries go first; entries idle long enough
  to be full again are dropped before any other).

Several API replicas each hold their own buckets: the limits are per replica (docs/api.md).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict, deque

import anyio
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import Settings, get_settings


class RateLimited(Exception):
    def __init__(self, detail: str, retry_after: float):
        super().__init__(detail)
        self.retry_after = max(1, math.ceil(retry_after))


class TokenBuckets:
    """Token buckets keyed by any hashable, at most `max_entries` of them (LRU). A bucket holds a
    burst of `per_minute` tokens, refilled at per_minute / 60 per second."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.buckets: OrderedDict[object, tuple[float, float, int]] = OrderedDict()  # who -> (tokens, last, per_minute)
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.buckets)

    @staticmethod
    def _refill(entry: tuple[float, float, int], now: float) -> float:
        tokens, last, per_minute = entry
        return min(float(per_minute), tokens + (now - last) * per_minute / 60.0)

    def _get(self, who: object, per_minute: int, now: float) -> float:
        entry = self.buckets.get(who)
        if entry is None:
            return float(per_minute)
        self.buckets.move_to_end(who)
        return self._refill(entry, now)

    def _put(self, who: object, tokens: float, per_minute: int, now: float) -> None:
        if who not in self.buckets and len(self.buckets) >= max(1, self.max_entries):
            self._make_room(now)
        self.buckets[who] = (tokens, now, per_minute)
        self.buckets.move_to_end(who)

    def _make_room(self, now: float) -> None:
        # entries that have refilled completely carry no state: drop them (oldest first); if the
        # map is still full, the least recently used entry goes
        for who in [w for w, e in self.buckets.items() if self._refill(e, now) >= e[2]]:
            del self.buckets[who]
        while len(self.buckets) >= max(1, self.max_entries):
            self.buckets.popitem(last=False)

    def take(self, who: object, per_minute: int, now: float | None = None) -> float:
        """Take a token: 0 when the request may pass, else seconds until one is available."""
        now = time.monotonic() if now is None else now
        with self.lock:
            tokens = self._get(who, per_minute, now)
            if tokens >= 1:
                self._put(who, tokens - 1, per_minute, now)
                return 0.0
            self._put(who, tokens, per_minute, now)
            return (1 - tokens) * 60.0 / per_minute

    def wait(self, who: object, per_minute: int, now: float | None = None) -> float:
        """Seconds until `who` has a token (0 = has one now); takes nothing."""
        now = time.monotonic() if now is None else now
        with self.lock:
            entry = self.buckets.get(who)
            tokens = float(per_minute) if entry is None else self._refill(entry, now)
            return 0.0 if tokens >= 1 else (1 - tokens) * 60.0 / per_minute


requests = TokenBuckets(get_settings().rate_limit_max_buckets)
auth_failures = TokenBuckets(get_settings().rate_limit_max_buckets)


def client_address(request: Request) -> str:
    # the peer address as uvicorn sees it; behind a reverse proxy, CANARY_FORWARDED_ALLOW_IPS names
    # the proxy (`canary serve`), and this is then the client's address from X-Forwarded-For
    return request.client.host if request.client else "?"


def _limit(buckets: TokenBuckets, who: object, per_minute: int, take: bool, message: str) -> None:
    """Raise RateLimited(message + the wait) when `who` has no token in `buckets` (taking one if
    `take`); per_minute 0 turns the limit off."""
    if per_minute > 0:
        buckets.max_entries = get_settings().rate_limit_max_buckets
        wait = buckets.take(who, per_minute) if take else buckets.wait(who, per_minute)
        if wait > 0:
            raise RateLimited(message.format(per_minute=per_minute, wait=math.ceil(wait)), wait)


def authentication_failed(address: str) -> None:
    """Count a failed authentication (a missing, unknown or revoked key) from `address`, after its
    key was looked up: 429 when the address's failure bucket is empty, else the caller's 401."""
    _limit(auth_failures, address, get_settings().rate_limit_auth_failures_per_minute, True,
           "too many failed authentications from this address (limit {per_minute} per minute, "
           "CANARY_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE); retry after {wait} s with a valid key")


def take_request(who: object) -> None:
    """429 when `who` (("key", id) or ("address", host)) has used up its requests per minute."""
    _limit(requests, who, get_settings().rate_limit_per_minute, True,
           "rate limit of {per_minute} requests per minute exceeded; retry after {wait} s")


UNAUTHENTICATED_MAX_BYTES = 64 * 1024
# paths served outside the in-flight limit: a probe answers while every place is taken
UNLIMITED_PATHS = ("/healthz",)


def _json_error(status: int, detail: str) -> tuple[dict, dict]:
    """The two ASGI messages of a JSON error that closes the connection (the rest of the request
    body, if any, is never read)."""
    import json

    body = json.dumps({"detail": detail}).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body})


class InFlightLimit:
    """Pure ASGI middleware: at most CANARY_API_THREADS requests inside the app at once; the rest
    wait here, in arrival order, holding nothing. Inside, a request takes a pooled database
    connection (the key check) before its handler gets one of the CANARY_API_THREADS threads:
    without this cap, more requests than the pool holds could leave every thread waiting for a
    connection while every connection's holder waits for a thread.

    It sits inside BodyLimit, which has read each request's whole body (bounded in size and time)
    before the request gets here: a client that trickles its body never holds a place. /healthz
    is not counted (it has its own threads, app/api/main.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        if self._slots is None:  # made in the server's event loop, on its first request
            self._slots = asyncio.Semaphore(get_settings().api_threads)
        async with self._slots:
            await self.app(scope, receive, send)


class BodyLimit:
    """Pure ASGI middleware: reads each request's whole body before the app (and InFlightLimit)
    sees the request, then hands the app the buffered body.

    - Size: at most `max_bytes` (default: CANARY_MAX_BODY_BYTES) — and at most
      UNAUTHENTICATED_MAX_BYTES from a request with no Authorization header where keys are
      required. A declared Content-Length over the limit is refused without reading; otherwise
      the bytes received are counted, and the first chunk past the limit ends the request with 413.
    - Time: the whole body must arrive within CANARY_BODY_TIMEOUT_SECONDS of the request's headers,
      or the request ends with 408 (every request, with a key or without).

    The buffer is what the app would have read into memory anyway (a JSON body is parsed whole),
    bounded by the same limit."""

    def __init__(self, app: ASGIApp, max_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._large: asyncio.Semaphore | None = None  # large bodies in this process (made in its event loop)
        self._large_by_sender: dict[object, list] = {}  # sender → [its semaphore, requests holding or waiting]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = get_settings()
        declared = next((int(value) for name, value in scope.get("headers", ())
                         if name == b"content-length" and value.strip().isdigit()), 0)
        if declared > settings.large_body_bytes and declared <= self._limit(scope, settings):
            await self._one_large_body(scope, receive, send, settings)
            return
        await self._read_then_app(scope, receive, send, settings)

    async def _one_large_body(self, scope: Scope, receive: Receive, send: Send, settings: Settings) -> None:
        """A large body waits for a place in the process and its sender's one place, before a byte
        of it is read: while it waits it holds a socket, no memory and no thread. The sender is the
        API key the header names, looked up first (one indexed hash lookup), so a made-up or revoked
        key holds no place: where keys are required it is answered 401 unread, elsewhere it counts
        as no key (the client's address)."""
        headers = dict(scope.get("headers", ()))
        key_id = await self._key_id(headers.get(b"authorization"))
        if key_id is None and b"authorization" in headers and settings.auth_required:
            start, body = _json_error(401, "invalid or revoked API key")
            await send(start)
            await send(body)
            return
        sender = ("key", key_id) if key_id is not None else ("address", (scope.get("client") or ("?",))[0])
        if self._large is None:
            self._large = asyncio.Semaphore(settings.large_bodies_in_flight)
        entry = self._large_by_sender.setdefault(sender, [asyncio.Semaphore(1), 0])
        entry[1] += 1
        try:
            try:
                with anyio.fail_after(settings.body_timeout_seconds):
                    await entry[0].acquire()
            except TimeoutError:
                await self._busy(send, settings)
                return
            try:
                try:
                    with anyio.fail_after(settings.body_timeout_seconds):
                        await self._large.acquire()
                except TimeoutError:
                    await self._busy(send, settings)
                    return
                try:
                    await self._read_then_app(scope, receive, send, settings)
                finally:
                    self._large.release()
            finally:
                entry[0].release()
        finally:
            entry[1] -= 1
            if not entry[1]:
                self._large_by_sender.pop(sender, None)

    @staticmethod
    async def _key_id(authorization: bytes | None) -> int | None:
        """The id of the live API key the header names (however it is spaced), else None."""
        if not authorization:
            return None

        def lookup() -> int | None:
            from app.auth import Unauthorized, authenticate
            from app.db import session_scope

            try:
                with session_scope() as session:
                    key = authenticate(session, authorization.decode("latin-1"), False)
                    return key.id if key is not None else None
            except Unauthorized:
                return None

        return await anyio.to_thread.run_sync(lookup)

    @staticmethod
    async def _busy(send: Send, settings: Settings) -> None:
        message = (f"too many large request bodies in flight (over {settings.large_body_bytes} bytes: one per API key, "
                   f"{settings.large_bodies_in_flight} per API process); retry after the others finish")
        start, body = _json_error(429, message)
        start["headers"].append((b"retry-after", b"10"))
        await send(start)
        await send(body)

    def _limit(self, scope: Scope, settings: Settings) -> int:
        limit = self.max_bytes if self.max_bytes is not None else settings.max_body_bytes
        if settings.auth_required and not any(name == b"authorization" for name, _ in scope.get("headers", ())):
            # no key where one is required: the answer is a 401 whatever the body holds, so at most
            # a small body is read before it (an unauthenticated client costs the API ~nothing)
            limit = min(limit, UNAUTHENTICATED_MAX_BYTES)
        return limit

    async def _read_then_app(self, scope: Scope, receive: Receive, send: Send, settings: Settings) -> None:
        limit = self._limit(scope, settings)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.strip().isdigit() and int(value) > limit:
                await self._refuse(send, limit)
                return
        deadline = settings.body_timeout_seconds
        messages: deque[Message] = deque()
        received = 0
        try:
            with anyio.fail_after(deadline):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client went away (http.disconnect): nobody to answer
                    messages.append(message)
                    received += len(message.get("body", b""))
                    if received > limit or not message.get("more_body", False):
                        break
        except TimeoutError:
            for reply in _json_error(408, f"request body not received within the deadline of {deadline:g} s "
                                          f"(CANARY_BODY_TIMEOUT_SECONDS; {received} bytes arrived): send the "
                                          "whole body at once, or have the operator raise the deadline"):
                await send(reply)
            return
        if received > limit:
            await self._refuse(send, limit)
            return

        async def buffered_receive() -> Message:
            # the body as it was received, then (a streaming answer listening for the client
            # leaving) the server's own messages
            return messages.popleft() if messages else await receive()

        await self.app(scope, buffered_receive, send)

    @staticmethod
    async def _refuse(send: Send, limit: int) -> None:
        for reply in _json_error(413, f"request body exceeds the limit of {limit} bytes: send a smaller body (split a "
                                      "suite's documents over several suites, or name a server-side corpus) or have "
                                      "the operator raise CANARY_MAX_BODY_BYTES"):
            await send(reply)
