"""The API's request limits against a real `canary serve` process in production mode (keys
required), over real sockets (app/api/limits.py):

- a chunked body (no Content-Length) is cut off with 413 at CANARY_MAX_BODY_BYTES, before the
  key is checked, and the server's memory does not grow with what the client keeps sending;
- clients that trickle a body hold no place among the CANARY_API_THREADS: /healthz and other
  tenants are answered at once, and the trickling requests get 408 at CANARY_BODY_TIMEOUT_SECONDS,
  with a key or without;
- the rate limit is keyed on the key's id: whitespace and case variants of a drained key are
  limited too; failed authentications are limited per client address (a flood of bogus keys
  gets 429), and a valid key from that address is not; the bucket maps stay under their cap
  however many clients there are (127.0.0.0/8 is all loopback on Linux: each test client binds
  its own source address);
- X-Forwarded-For is honoured only from the proxies in CANARY_FORWARDED_ALLOW_IPS (none by
  default, loopback included)."""

from __future__ import annotations

import json
import os
import re
import select
import socket
import threading
import time

import httpx

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


def settled_rss_kib(pid: int, timeout: float = 60.0) -> int:
    """The process's RSS once it stops growing: after start, `canary serve` with in-process tasks
    goes on importing its task modules in the background for a few seconds (about 300 MiB, more
    under load), which a measurement of one request's memory must not count."""
    last, deadline = rss_kib(pid), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss_kib(pid)
        if abs(now - last) < 1024:
            return now
        last = now
    raise AssertionError(f"the API's RSS was still moving after {timeout:.0f} s: {last} KiB")


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
        before = settled_rss_kib(proc.pid)
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


class Tricklers:
    """Raw connections that send a POST's headers (Content-Length `declared`) and then one byte of
    the body every `every` seconds, from a background thread, until the server answers or closes.
    `answers[i]` is (seconds from connecting to the answer, status, body), or None."""

    def __init__(self, base: str, path: str, n: int, declared: int = 1000, every: float = 2.0, auth: str | None = None):
        host, port = base.removeprefix("http://").split(":")
        self.socks, self.opened = [], []
        for _ in range(n):
            sock = socket.create_connection((host, int(port)), timeout=5)
            head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            head += f"Authorization: {auth}\r\n" if auth else ""
            sock.sendall((head + f"Content-Length: {declared}\r\n\r\n{{").encode())
            self.socks.append(sock)
            self.opened.append(time.monotonic())
        self.answers: list[tuple[float, int, bytes] | None] = [None] * n
        self.raw = [b""] * n
        self.every, self.stop = every, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        next_byte = time.monotonic() + self.every
        while not self.stop.is_set() and any(a is None for a in self.answers):
            open_ = [s for i, s in enumerate(self.socks) if self.answers[i] is None]
            for sock in select.select(open_, [], [], 0.05)[0]:
                i = self.socks.index(sock)
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                self.raw[i] += data
                head, sep, body = self.raw[i].partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                if not data or (sep and length and len(body) >= int(length.group(1))):
                    status = int(self.raw[i].split(b" ", 2)[1]) if self.raw[i].startswith(b"HTTP/1.1 ") else 0
                    self.answers[i] = (time.monotonic() - self.opened[i], status, body)
            if time.monotonic() >= next_byte:
                for i, sock in enumerate(self.socks):
                    if self.answers[i] is None:
                        try:
                            sock.sendall(b" ")
                        except OSError:
                            pass
                next_byte += self.every

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


def timed_get(url: str, **kwargs) -> tuple[float, int]:
    """(seconds, status) of one GET on a fresh connection; (inf, 0) when no answer came in 5 s."""
    start = time.monotonic()
    try:
        status = httpx.get(url, timeout=5, **kwargs).status_code
    except httpx.TimeoutException:
        return float("inf"), 0
    return time.monotonic() - start, status


def test_clients_trickling_a_body_take_no_place_in_the_api_and_get_408_at_the_deadline(tmp_path):
    # H2 (docs/security-round3 H2): api_threads + 2 keyless connections that trickle a body took
    # every in-flight place before their bodies arrived; /healthz and every tenant got no answer
    from app.settings import Settings

    threads = Settings.model_fields["api_threads"].default
    env = production_env(tmp_path, CANARY_BODY_TIMEOUT_SECONDS="8")
    r = cli(env, "keys", "create", "--project", "beta", "--read-only")
    assert r.returncode == 0, r.stderr
    beta = {"Authorization": f"Bearer {r.stdout.strip()}"}
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        assert httpx.get(base + "/api/v1/projects/beta/models", headers=beta).status_code == 200  # warm
        attack = Tricklers(base, "/api/v1/projects/alpha/models", threads + 2, every=3.0)
        try:
            time.sleep(1.5)  # every trickler is in, a byte or so of its body sent
            health = timed_get(base + "/healthz")
            tenant = timed_get(base + "/api/v1/projects/beta/models", headers=beta)
            said = [f"{code} in {took * 1000:.0f} ms" if code else "no answer in 5 s" for took, code in (health, tenant)]
            print(f"\n{threads + 2} connections trickling a body (1 byte / 3 s), no key: /healthz {said[0]}, "
                  f"another tenant's GET {said[1]}")
            assert health[1] == 200 and health[0] < 1
            assert tenant[1] == 200 and tenant[0] < 1
            assert all(a is None for a in attack.answers)  # still trickling: the answers came while they hold sockets
            attack.wait(15)
            answers = attack.answers
        finally:
            attack.close()
        print(f"the trickling connections' answers: {sorted((round(a[0], 1), a[1]) for a in answers if a)}")
        assert all(a is not None and a[1] == 408 and 8 <= a[0] < 12 for a in answers), answers
        detail = json.loads(answers[0][2])["detail"]
        assert "request body not received within the deadline of 8 s" in detail
        assert "CANARY_BODY_TIMEOUT_SECONDS" in detail
        assert httpx.get(base + "/healthz").status_code == 200


def test_the_body_deadline_holds_for_requests_with_a_key_too(tmp_path):
    env = production_env(tmp_path, CANARY_BODY_TIMEOUT_SECONDS="2")
    r = cli(env, "keys", "create", "--project", "beta")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        with_key = Tricklers(base, "/api/v1/projects/beta/models", 2, every=1.0, auth=f"Bearer {key}")
        keyless = Tricklers(base, "/api/v1/projects/beta/models", 1, every=1.0)
        try:
            with_key.wait(8)
            keyless.wait(8)
        finally:
            with_key.close()
            keyless.close()
        answers = with_key.answers + keyless.answers
        print(f"\ndeadline 2 s, 1 byte / s: answers {[(round(a[0], 1), a[1]) for a in answers if a]}")
        assert all(a is not None and a[1] == 408 and 2 <= a[0] < 4 for a in answers), answers
        assert "deadline of 2 s" in json.loads(answers[0][2])["detail"]
        # the deadline is for the whole body, not per read: a body in pieces that all arrive in time passes
        host, port = base.removeprefix("http://").split(":")
        body = json.dumps({"name": "m", "path": "builtin:pydoc-target"}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /api/v1/projects/beta/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            for piece in (body[:10], body[10:20], body[20:]):
                sock.sendall(piece)
                time.sleep(0.5)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 201"), answer[:300]


def test_bad_keys_from_an_address_do_not_lock_out_a_valid_key_from_it(tmp_path):
    # L2: the failed-authentication bucket is taken from only by requests that fail authentication
    env = production_env(tmp_path, CANARY_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE="10")
    r = cli(env, "keys", "create", "--project", "p")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        with client_from(base, "127.0.0.6") as c:
            bogus = [c.get("/api/v1/projects", headers={"Authorization": f"Bearer cnry_bogus{i}"}).status_code
                     for i in range(20)]
            assert bogus == [401] * 10 + [429] * 10
            assert c.get("/api/v1/projects").status_code == 429  # no key: a failure too
            valid = [c.get("/api/v1/projects", headers={"Authorization": f"Bearer {key}"}).status_code for _ in range(10)]
            metrics = c.get("/metrics", headers={"Authorization": f"Bearer {key}"}).status_code  # not a metrics key
            again = c.get("/api/v1/projects", headers={"Authorization": "Bearer cnry_bogus"}).status_code
        print(f"\none address: 20 bad keys -> {bogus.count(401)} x 401, {bogus.count(429)} x 429; then a valid key: {valid}")
        assert valid == [200] * 10
        assert metrics == 403  # looked up and refused for its scope, not limited
        assert again == 429  # and the bad keys are still limited


def xff_codes(base: str, n: int) -> list[int]:
    """n bad-key requests from 127.0.0.1, each with a random X-Forwarded-For."""
    codes = []
    for i in range(n):
        forwarded = f"203.0.113.{i % 250 + 1}, 198.51.100.{(i * 7) % 250 + 1}"
        codes.append(httpx.get(base + "/api/v1/projects", headers={"Authorization": f"Bearer cnry_bogus{i}",
                                                                    "X-Forwarded-For": forwarded}).status_code)
    return codes


def test_x_forwarded_for_is_not_trusted_from_loopback_by_default(tmp_path):
    # L3: uvicorn trusts X-Forwarded-For from 127.0.0.1 unless told otherwise: any local client
    # (a sidecar, a local TCP proxy) could pick a fresh address per request
    env = production_env(tmp_path, CANARY_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE="10")
    env.pop("FORWARDED_ALLOW_IPS", None)
    env.pop("CANARY_FORWARDED_ALLOW_IPS", None)
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        codes = xff_codes(base, 30)
    print(f"\ndefault, 30 bad keys with a random X-Forwarded-For: {codes.count(401)} x 401, {codes.count(429)} x 429")
    assert codes == [401] * 10 + [429] * 20


def test_x_forwarded_for_is_honoured_from_the_proxies_named(tmp_path):
    env = production_env(tmp_path, CANARY_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE="10",
                         CANARY_FORWARDED_ALLOW_IPS="127.0.0.1")
    env.pop("FORWARDED_ALLOW_IPS", None)
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        codes = xff_codes(base, 30)
        # another address is no proxy: its X-Forwarded-For is ignored
        with client_from(base, "127.0.0.7") as c:
            other = [c.get("/api/v1/projects", headers={"Authorization": f"Bearer cnry_b{i}",
                                                        "X-Forwarded-For": f"192.0.2.{i + 1}"}).status_code for i in range(12)]
    print(f"\nCANARY_FORWARDED_ALLOW_IPS=127.0.0.1, 30 bad keys with a random X-Forwarded-For: {codes.count(401)} x 401; "
          f"from 127.0.0.7: {other}")
    assert codes == [401] * 30  # each forwarded client address has its own failure bucket
    assert other == [401] * 10 + [429] * 2


def test_one_keys_large_bodies_queue_behind_each_other_not_in_front_of_other_tenants(tmp_path):
    """Security round 3, M4: eight legal 60 MB uploads of one tenant took another's p99 from 13 ms
    to 10 s. A body over CANARY_LARGE_BODY_BYTES is read only while it holds its key's one place
    (and one of the process's): here alpha trickles a 2000-byte body (the large threshold 1000),
    so alpha's second large upload waits until the first ends (its 408 at the 6 s deadline), while
    beta's small GET is answered at once."""
    env = production_env(tmp_path, CANARY_BODY_TIMEOUT_SECONDS="6", CANARY_LARGE_BODY_BYTES="1000",
                         CANARY_LARGE_BODIES_IN_FLIGHT="2")
    keys = {}
    for project in ("alpha", "beta"):
        r = cli(env, "keys", "create", "--project", project)
        assert r.returncode == 0, r.stderr
        keys[project] = f"Bearer {r.stdout.strip()}"
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        first = Tricklers(base, "/api/v1/projects/alpha/models", 1, declared=2000, every=1.0, auth=keys["alpha"])
        try:
            time.sleep(1.0)
            # while alpha's first large body holds its place
            small = timed_get(base + "/api/v1/projects/beta/models", headers={"Authorization": keys["beta"]})
            body = json.dumps({"name": "m", "path": "builtin:pydoc-target", "pad": "x" * 1500})
            start = time.monotonic()
            second = httpx.post(base + "/api/v1/projects/alpha/models", content=body, timeout=30,
                                headers={"Authorization": keys["alpha"], "Content-Type": "application/json"})
            waited = time.monotonic() - start
            first.wait(10)
        finally:
            first.close()
    (took, status, _), = first.answers
    print(f"\nalpha's trickled upload: {status} at {took:.1f} s; alpha's second large upload answered "
          f"{second.status_code} after waiting {waited:.1f} s; beta's small GET {small[1]} in {small[0] * 1000:.0f} ms")
    assert status == 408 and 6 <= took < 9
    assert waited >= 4.0, waited  # behind the first: it started at 1 s, the place freed at about 6 s
    assert second.status_code == 422 and "pad" in second.text  # then read and handled like any body
    assert small[1] == 200 and small[0] < 1


def test_made_up_keys_hold_no_large_body_place(tmp_path):
    """Security round 4, N2: four clients with made-up keys trickling 2000-byte bodies (the large
    threshold 1000, two places in the process) are answered 401 at once, before a byte is read and
    without a place, so alpha's legitimate large upload is answered at once, not after their deadline."""
    env = production_env(tmp_path, CANARY_BODY_TIMEOUT_SECONDS="6", CANARY_LARGE_BODY_BYTES="1000",
                         CANARY_LARGE_BODIES_IN_FLIGHT="2")
    r = cli(env, "keys", "create", "--project", "alpha")
    assert r.returncode == 0, r.stderr
    alpha = f"Bearer {r.stdout.strip()}"
    with canary_serve_process(env, str(tmp_path / "api.log")) as (base, _):
        attackers = [Tricklers(base, "/api/v1/projects/alpha/models", 1, declared=2000, every=1.0,
                               auth=f"Bearer made-up-{i}") for i in range(4)]
        try:
            time.sleep(1.0)
            body = json.dumps({"name": "m", "path": "builtin:pydoc-target", "pad": "x" * 1500})
            start = time.monotonic()
            upload = httpx.post(base + "/api/v1/projects/alpha/models", content=body, timeout=30,
                                headers={"Authorization": alpha, "Content-Type": "application/json"})
            took = time.monotonic() - start
            for attacker in attackers:
                attacker.wait(5)
        finally:
            for attacker in attackers:
                attacker.close()
    answers = [a.answers[0] for a in attackers]
    print(f"\nalpha's large upload answered {upload.status_code} in {took:.2f} s; the made-up keys: "
          f"{[(round(t, 1), s) for t, s, _ in answers]}")
    assert all(status == 401 and t < 2 for t, status, _ in answers), answers  # at once, unread
    assert upload.status_code == 422 and "pad" in upload.text and took < 2, (upload.status_code, took)
