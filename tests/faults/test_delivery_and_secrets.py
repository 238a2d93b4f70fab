"""A webhook receiver that is down while alerts fire — and the notifier killed -9 meanwhile —
gets every notification exactly once per idempotency key when it returns. The same run is the
secrets audit: a known API key, webhook URL token and signing secret must appear in no log, no
API response, and no Redis command (task arguments included), in plain text or base64."""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from tests.conftest import ROOT
from tests.faults.conftest import check_results, record, seed_project, start_run
from tests.loopback import free_port, serve_in_thread

HOOK_TOKEN = f"hooktoken{uuid.uuid4().hex}"
SIGNING_SECRET = f"signing{uuid.uuid4().hex}"


def b64_fragments(secret: str) -> list[str]:
    """What `secret` looks like inside any base64 text (kombu base64-encodes message bodies): for
    each of the 3 alignments, the run of base64 characters that depends on the secret alone."""
    s, out = secret.encode(), []
    for i in range(3):
        enc = base64.b64encode(b"\0" * i + s).decode()
        first, last = -(-i // 3), (i + len(s)) // 3
        out.append(enc[first * 4: last * 4])
    return out


class RedisMonitor:
    """Every command the Redis server executes (MONITOR), collected on a thread."""

    def __init__(self, url: str):
        import redis

        self.lines: list[str] = []
        self._monitor = redis.Redis.from_url(url).monitor()
        self._monitor.__enter__()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        try:
            for cmd in self._monitor.listen():
                self.lines.append(cmd["command"])
        except Exception:  # noqa: BLE001 - the connection closes at the end (or on a restart)
            pass

    def close(self) -> None:
        try:
            self._monitor.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            pass


@pytest.mark.parametrize("fault_stack", [{"CANARY_REQUIRE_API_KEYS": "true", "CANARY_SECRET_FAULTS__SIGNING": SIGNING_SECRET}],
                         indirect=True)
def test_receiver_down_then_back_gets_each_notification_once_and_no_secret_leaks(fault_stack):
    from tests.http.receiver import Receiver

    st = fault_stack
    monitor = RedisMonitor(st.redis.url)
    st.responses = responses = []
    try:
        out = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", "faults"], cwd=ROOT,
                             env=st.env, check=True, capture_output=True, text=True).stdout
        api_key = out.strip().splitlines()[-1]
        assert api_key.startswith("cnry_")
        st.headers = {"Authorization": f"Bearer {api_key}"}
        http = st.http
        assert httpx.get(f"{st.api}/api/v1/projects/faults/runs").status_code == 401  # keys are required here

        seed_project(st, candidates=("rtn-int2",))
        P = "/api/v1/projects/faults"
        r = http.put(f"{P}/alert-rules", json={"metric": "ppl_ratio", "warn": 1.01, "critical": 1.03, "min_n": 10})
        assert r.status_code == 200, r.text
        port = free_port()  # nothing listens here yet: the receiver is down
        for name in ("chat-a", "chat-b", "chat-c"):
            r = http.put(f"{P}/channels", json={"name": name, "kind": "webhook", "url": f"http://127.0.0.1:{port}/{name}/{HOOK_TOKEN}",
                                                "signing_secret": "${CANARY_SECRET_FAULTS__SIGNING}"})
            assert r.status_code == 200, r.text
        st.start_worker("gpu-a")
        run_id = start_run(st)
        run = st.wait_run(run_id)
        assert run["status"] == "done" and run["verdict"] == "fail", run
        lost, dup = check_results(st, run_id, ("fp16", "rtn-int2"))
        # int2 fires warn and critical; critical inhibits warn: one message to each of 3 channels
        seen: list = []

        def retried():
            seen[:] = st.sql("SELECT idempotency_key, attempts, status, last_error FROM notifications")
            return seen if len(seen) == 3 and all(a >= 2 and s == "pending" for _, a, s, _ in seen) else None

        try:
            keys = st.wait_for("3 notifications retried while the receiver is down", retried, timeout=90)
        except AssertionError as e:
            raise AssertionError(f"notifications: {seen}\nalerts: {st.sql('SELECT * FROM alerts')}") from e
        st.signal_worker("bookkeeper", signal.SIGKILL)  # the notifier dies too
        st.start_worker("bookkeeper-2", queues="cpu,default,notify", beat=True)
        receiver = Receiver()
        server = serve_in_thread(receiver.app, port)
        try:
            st.wait_for("every notification sent", lambda: all(
                s == "sent" for (s,) in st.sql("SELECT status FROM notifications")), timeout=120)
            time.sleep(3)  # a duplicate, if any, would come with the next notifier passes
        finally:
            server.should_exit = True
        got = collections.Counter(r["headers"]["idempotency-key"] for r in receiver.requests)
        record("webhook receiver down ~20 s, notifier killed -9", 1, int(run["status"] == "done"), lost, dup,
               f"{len(keys)} notifications, each delivered {sorted(set(got.values()))} time(s)")
        assert set(got) == {k for k, _, _, _ in keys} and set(got.values()) == {1}
        for req in receiver.requests:  # the signing secret was resolved at send time from the environment
            want = "sha256=" + hmac.new(SIGNING_SECRET.encode(), req["body"], hashlib.sha256).hexdigest()
            assert req["headers"]["x-canary-signature"] == want
            assert json.loads(req["body"])["status"] == "firing"

        # read everything back through the API, as a user (and the dashboard) would
        assert http.get("/api/v1/projects").status_code == 200
        for path in ("/channels", "/alerts", "/alert-rules", "/runs", f"/runs/{run_id}", f"/runs/{run_id}/worst?config=rtn-int2",
                     f"/runs/{run_id}/samples", "/overview", "/trends", "/configs", "/suites", "/models", "/schedules"):
            assert http.get(P + path).status_code == 200, path
        channels = http.get(f"{P}/channels").json()
        assert {c["url"] for c in channels} == {f"http://127.0.0.1:{port}/***"}  # the path, which holds the token, masked
    finally:
        monitor.close()

    haystacks = {name: open(path, encoding="utf-8", errors="replace").read() for name, path in st.logs.items()}
    haystacks["API responses"] = "\n".join(responses)
    haystacks["Redis commands"] = "\n".join(monitor.lines)
    assert any("canary.execute_config_run" in line for line in monitor.lines)  # the capture saw the task messages
    assert len(responses) > 20
    leaks = [(secret_name, where) for secret_name, secret in (("API key", api_key), ("webhook URL token", HOOK_TOKEN),
                                                              ("signing secret", SIGNING_SECRET))
             for where, text in haystacks.items()
             if secret in text or any(f in text for f in b64_fragments(secret))]
    where = {w: next(line for line in haystacks[w].splitlines() if any(x in line for x in (api_key, HOOK_TOKEN, SIGNING_SECRET)))[:400]
             for _, w in leaks if any(x in haystacks[w] for x in (api_key, HOOK_TOKEN, SIGNING_SECRET))}
    assert leaks == [], where
