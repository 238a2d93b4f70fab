"""What one oversized request costs everyone else on `canary engine-serve` (security round 4, N4).

One server with its default bounds (--max-queue 256, --max-logprob-entries 262144,
--max-body-bytes 16 MiB). Each oversized request is sent from a thread while a small greedy
request (8 tokens) is timed from another client; the peer is the same small request with nothing
else in flight, measured in the same run, alternating (quiet, loaded, quiet, loaded, …) over
--repeats rounds. The oversized requests:
  - fanout: 256 prompts × n=128 (32,768 sequences, what the round-4 test admitted);
  - echo:   64 prompts of 1,000 token ids, echo with 20 alternatives each (a 33 MB answer before);
  - body:   a 200 MB body without Content-Length (chunked), and one declaring its 200 MB;
  - admitted_max: the largest request the defaults admit, 256 prompts × n=1 × 16 tokens (it fills
    the queue: a small request behind it waits its turn, first come first served).
Printed: the oversized request's status and seconds to its answer, the small request's latency
(median and min–max) quiet and beside it, the server's peak RSS growth over its RSS before the
request (sampled every 20 ms from /proc), and whether the small answer was the same text in both.

    .venv/bin/python benchmarks/engine_serve_bounds.py [--repeats 3]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from benchmarks._common import parser, spread

MODEL = "m"
BODY_MB = 200


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """The process's highest RSS while the block runs, in MB over its RSS when the block began."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def __enter__(self) -> PeakRss:
        self.before = rss_mb(self.pid)
        self.peak = self.before
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> float:
        return round(self.peak - self.before, 1)


def small(base: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/completions", timeout=600,
                   json={"model": MODEL, "prompt": "def parse(path):", "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["choices"][0]["text"]


def fanout(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=600,
                      json={"model": MODEL, "prompt": [f"item {i}" for i in range(256)], "n": 128, "max_tokens": 16,
                            "temperature": 1.0, "seed": 1})


def admitted_max(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=600,
                      json={"model": MODEL, "prompt": [f"item {i}" for i in range(256)], "max_tokens": 16,
                            "temperature": 0})


def echo(base: str) -> httpx.Response:
    ids = [[(7 * i + j) % 500 + 1 for j in range(1000)] for i in range(64)]
    return httpx.post(base + "/v1/completions", timeout=600,
                      json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 0})


def body_chunks() -> object:
    chunk = b"x" * (1 << 20)
    for _ in range(BODY_MB):
        yield chunk


def body_chunked(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=600, content=body_chunks(),
                      headers={"Content-Type": "application/json"})


def body_declared(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=600, content=body_chunks(),
                      headers={"Content-Type": "application/json", "Content-Length": str(BODY_MB << 20)})


def loaded(base: str, pid: int, send) -> dict:
    """Send the oversized request from a thread; time a small one beside it."""
    out: dict = {}

    def big() -> None:
        t0 = time.perf_counter()
        try:
            out["status"] = send(base).status_code
        except httpx.HTTPError as e:  # the server answered 413 and closed while the client still wrote
            out["status"] = f"{type(e).__name__} (connection closed by the server)"
        out["answered_s"] = round(time.perf_counter() - t0, 3)

    with PeakRss(pid) as rss:
        thread = threading.Thread(target=big, daemon=True)
        thread.start()
        time.sleep(0.05)  # the oversized request is in before the small one
        latency, text = small(base)
        thread.join(600)
    return {**out, "small_s": latency, "text": text, "rss_growth_mb": rss.growth}


def main() -> None:
    args = parser(__doc__).parse_args()
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (a median and a spread need three)")
    from tests.http.conftest import start_engine_serve

    flags = ("--threads", str(args.threads)) if args.threads else ()
    proc, base = start_engine_serve("--served-model-name", MODEL, *flags)
    try:
        small(base)  # warm
        report: dict = {"server_flags": list(flags) or "defaults", "cases": {}}
        equal = True
        for name, send in (("fanout", fanout), ("echo", echo), ("body_chunked", body_chunked),
                           ("body_declared", body_declared), ("admitted_max", admitted_max)):
            quiet, rounds = [], []
            for _ in range(args.repeats):
                latency, quiet_text = small(base)
                quiet.append(latency)
                rounds.append(loaded(base, proc.pid, send))
                equal = equal and rounds[-1]["text"] == quiet_text
            report["cases"][name] = {
                "oversized_status": sorted({str(r["status"]) for r in rounds}),
                "oversized_answered_s": spread([r["answered_s"] for r in rounds], digits=3),
                "small_quiet_s": spread(quiet, digits=3),
                "small_beside_it_s": spread([r["small_s"] for r in rounds], digits=3),
                "rss_growth_mb_max": max(r["rss_growth_mb"] for r in rounds),
            }
            print(name, json.dumps(report["cases"][name]), flush=True)
        report["small_answers_equal"] = equal
        print(json.dumps(report, indent=2))
        if not equal:
            sys.exit(1)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
