"""The API's request limits against a real `canary serve` process in production mode (keys
required), over real sockets (app/api/limits.py):

- a chunked body (no Content-Length) is cut off with 413 at CANARY_MAX_BODY_BYTES, before the
  key is checked, and the server's memory does not grow with what the client keeps sending;
- the rate limit is keyed on the key's id: whitespace and case variants of a drained key are
  limited too; failed authentications are limited per client address (a flood of bogus keys
  gets 429); the bucket maps stay under their cap however many clients there are (127.0.0.0/8
  is all loopback on Linux: each test client binds its own source address)."""

from __future__ import annotations

import os
import re
import select
import socket
import time

import httpx
import pytest

from tests.loopback import canary_serve_process
from tests.unit.test_api_keys import cli

MiB = 1024 * 1024


def production_env(tmp_path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'limits.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_REQUIRE_API_KEYS": "true", **extra}
    env.pop("CANARY_BROKER_URL", None)
    return env


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def stream_body(base: str, path: str, total: int, chunk: int = MiB, chunked: bool = True,
                content_length: int | None = None, first: bytes = b"[", auth: str | None = None) -> tuple[int, int, bytes]:
    """POST `total` bytes to path on a raw socket, chunked (or with a declared Content-Length),
    watching for an early answer after every chunk. Returns (bytes of body sent when the answer
    came, status, answer body)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    head += f"Authorization: {auth}\r\n" if auth else ""
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {content_length if content_length is not None else total}\r\n"
    sock.sendall((head + "\r\n").encode())
    payload = first + b" " * (chunk - len(first))  # the start of a JSON document that never ends in time
    sent, answer = 0, b""
    try:
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered early
            piece = payload if sent == 0 else b" " * chunk
            try:
                sock.sendall((f"{len(piece):x}\r\n".encode() + piece + b"\r\n") if chunked else piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        else:
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        sock.settimeout(30)
        while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 4 + int(
                re.search(rb"(?i)content-length: *(\d+)", answer).group(1) if re.search(rb"(?i)content-length: *(\d+)", answer) else 0):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return sent, status, answer.partition(b"\r\n\r\n")[2]


def test_a_chunked_body_without_a_key_is_cut_off_at_the_limit_with_413(tmp_path):
    with canary_serve_process(production_env(tmp_path), str(tmp_path / "api.log")) as (base, proc):
        assert httpx.get(base + "/api/v1/projects").status_code == 401  # warm: every route module is loaded
        before = rss_kib(proc.pid)
        sent, status, body = stream_body(base, "/api/v1/projects/p/suites", 300 * MiB)
        time.sleep(0.5)
        after, peak = rss_kib(proc.pid), rss_kib(proc.pid, "VmHWM")
        print(f"\nchunked 300 MiB, no key: {sent / MiB:.0f} MiB sent before the {status}; API RSS {before / 1024:.0f} MiB before, "
              f"{after / 1024:.0f} MiB after (+{(after - before) / 1024:.1f} MiB), peak {peak / 1024:.0f} MiB")
        assert status == 413, body
        # no key where keys are required: the answer is 401 whatever the body, so only a small
        # body is read (app/api/limits.py UNAUTHENTICATED_MAX_BYTES)
        assert "65536 bytes" in body.decode() and "CANARY_MAX_BODY_BYTES" in body.decode()
        assert sent < 16 * MiB  # the client notices the early answer a few 1 MiB chunks late under load
        assert after - before < 70 * 1024
        # with a key (here a bogus one: it is checked after the body is read), the body limit itself
        before = rss_kib(proc.pid)
        sent, status, body = stream_body(base, "/api/v1/projects/p/suites", 300 * MiB, auth="Bearer cnry_bogus")
        time.sleep(0.5)
        after = rss_kib(proc.pid)
        print(f"chunked 300 MiB, a bogus key: {sent / MiB:.0f} MiB sent before the {status}; API RSS +{(after - before) / 1024:.1f} MiB")
        assert status == 413 and "67108864 bytes" in body.decode()
        assert 64 * MiB <= sent < 80 * MiB  # stopped at the limit, not at the end of the body
        # a declared Content-Length over the limit is refused before a byte of the body is read
        sent, status, _ = stream_body(base, "/api/v1/projects/p/suites", 300 * MiB, chunked=False)
        print(f"Content-Length 300 MiB: {sent / MiB:.0f} MiB sent before the {status}")
        assert status == 413 and sent < 64 * MiB
        # a small chunked body still reaches auth: 401, not 413
        sent, status, _ = stream_body(base, "/api/v1/projects/p/suites", 10, chunk=10, first=b'{"a": 1}')
        assert status == 401
        assert httpx.get(base + "/healthz").status_code == 200  # the server is fine


def client_from(base: str, address: str, key: str | None = None, auth: str | None = None) -> httpx.Client:
    """A client whose connections come from `address` (any 127.x.y.z)."""
    headers = {"Authorization": auth if auth is not None else f"Bearer {key}"} if (key or auth) else {}
    return httpx.Client(base_url=base, headers=headers, timeout=30, transport=httpx.HTTPTransport(local_address=address))


def test_the_rate_limit_is_keyed_on_the_key_and_failed_authentication_is_limited_per_address(tmp_path):
    env = production_env(tmp_path, CANARY_RATE_LIMIT_PER_MINUTE="5", CANARY_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE="10")
    r = cli(env, "keys", "create", "--project", "p")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        with client_from(base, "127.0.0.3", key) as c:
            assert [c.get("/api/v1/projects").status_code for _ in range(5)] == [200] * 5  # the key's bucket, drained
        variants = [f"bearer {key}", f"BEARER {key}", f"Bearer  {key}", f"Bearer   {key}", f"Bearer \t{key}", f"bEaReR {key}"]
        codes = []
        for auth in variants * 4:
            with client_from(base, "127.0.0.3", auth=auth) as c:
                codes.append(c.get("/api/v1/projects").status_code)
        print(f"\nwhitespace and case variants of a drained key: {len(codes)} requests, {codes.count(429)} limited")
        assert codes == [429] * len(codes)

        bogus = []
        with client_from(base, "127.0.0.4") as c:
            for i in range(60):
                bogus.append(c.get("/api/v1/projects", headers={"Authorization": f"Bearer cnry_bogus{i}"}).status_code)
            r = c.get("/api/v1/projects", headers={"Authorization": "Bearer cnry_one-more"})
        print(f"bogus keys from one address: {len(bogus)} requests, {bogus.count(401)} answered 401, {bogus.count(429)} limited")
        assert bogus[:10] == [401] * 10 and bogus[10:] == [429] * 50
        assert "failed authentications" in r.json()["detail"] and 1 <= int(r.headers["retry-after"]) <= 7
        # another address is not affected, and /metrics refuses bogus keys from a limited address too
        with client_from(base, "127.0.0.5") as c:
            assert c.get("/api/v1/projects", headers={"Authorization": "Bearer cnry_bogus"}).status_code == 401
        with client_from(base, "127.0.0.4") as c:
            assert c.get("/metrics", headers={"Authorization": "Bearer cnry_bogus"}).status_code == 429
        assert httpx.get(base + "/healthz").status_code == 200  # probes are never limited


def bucket_counts(base: str) -> dict[str, tuple[float, float]]:
    text = httpx.get(base + "/metrics").text  # project-free figures: no key needed
    got = {}
    for kind in ("requests", "auth_failures"):
        n = float(re.search(rf'^canary_rate_limit_buckets{{kind="{kind}"}} (\S+)$', text, re.M).group(1))
        cap = float(re.search(rf'^canary_rate_limit_buckets_max{{kind="{kind}"}} (\S+)$', text, re.M).group(1))
        got[kind] = (n, cap)
    return got


def test_the_bucket_maps_stay_under_their_cap(tmp_path):
    # keys optional here, so that requests without a key get a bucket per address
    # slow refills (one token per 12 s): no bucket is full again, and so dropped, before the test ends
    env = production_env(tmp_path, CANARY_REQUIRE_API_KEYS="false", CANARY_RATE_LIMIT_MAX_BUCKETS="50",
                         CANARY_RATE_LIMIT_PER_MINUTE="5", CANARY_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE="5")
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        addresses = [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(120)]
        for address in addresses:
            with client_from(base, address) as c:
                assert c.get("/api/v1/projects").status_code == 200
                assert c.get("/api/v1/projects", headers={"Authorization": f"Bearer cnry_{address}"}).status_code == 401
        got = bucket_counts(base)
        print(f"\n{len(addresses)} client addresses, a request without a key and one with a bogus key each: "
              f"buckets held {got['requests'][0]:.0f} (requests) and {got['auth_failures'][0]:.0f} (failed auth), cap 50")
        assert got == {"requests": (50, 50), "auth_failures": (50, 50)}
