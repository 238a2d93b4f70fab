"""`canary engine-serve` with continuous batching against serial decoding, over HTTP.

Servers started here (the tiny target model): fp32 with continuous batching (the default
--max-num-seqs 32), its peer fp32 with --max-num-seqs 1 (serial decoding: one request at a time,
the rest queued), and bf16 weights with batching. Requests: --prompts prompts cut from the
held-out docs (the first 24 words of each), --max-tokens tokens each, greedy, non-streamed, sent
by a client pool of 1, 8 and 32 threads. Throughput: generated tokens (the responses'
completion_tokens) per wall-clock second over the whole set; batched and serial alternate over
--repeats rounds at each concurrency (A B, B A, …), reported as median and min–max, with the
speedup per round (serial time / batched time). --threads N starts every server with --threads N
(torch threads; default the server's own: every core but one, which it leaves to its HTTP front
end; on a 2-core machine two compute threads contend with the front end and the client).

Outputs: every fp32 output (text and token count) at every concurrency is compared with the
serial server's at concurrency 1; exit 1 when a batched one differs. bf16: the outputs at
concurrency 8 and 32 (decoded in batches) are compared with the same server's at concurrency 1
(each request decoded alone), a measurement of whether bf16 numerics depend on the batch's
composition; the compute dtype is what the engine uses for bf16 weights on this machine
(engines/reference/engine.py compute_dtype_for). One JSON object at the end.

--kv-cache KV runs the fp32 pair with that KV format (a lossy one batches with a compressed
cache per row, rows.DecoderRows) and leaves out the bf16 server. --speculative JSON runs the
fp32 pair with that speculative decoding (rows draft on their own, one pass verifies every row's
drafts) and leaves out the bf16 server; the serial peer is the same speculative server at
--max-num-seqs 1. Both together run speculative decoding over that KV format (rows.SpeculativeRows).

--vllm adds the real vLLM (its CPU build, in the environment `make test-vllm` creates) serving the
same model in fp32 with its own batching defaults: timed in the same rounds as the fp32 pair (the
three sides' order rotating), its outputs compared with the serial server's at concurrency 1 (sent
as the reference engine's token ids: vLLM adds no start token to this model's prompts), and
engine-serve's throughput over vLLM's per round. vLLM runs its compute on every core it finds
(its OpenMP threads); engine-serve on --threads, or its default.

--peer DIR adds engine-serve from another checkout (`git worktree add DIR COMMIT`), batched with the
same flags, as one more side of the same rounds: its throughput, this checkout's over it per
round, and its outputs against this checkout's serial server at concurrency 1.

    .venv/bin/python benchmarks/engine_serve_batching.py [--repeats 3] [--prompts 64] [--max-tokens 32] [--threads 1]
    .venv/bin/python benchmarks/engine_serve_batching.py --kv-cache turbo-3
    .venv/bin/python benchmarks/engine_serve_batching.py --speculative '{"method": "ngram", "k": 4}'
    .venv/bin/python benchmarks/engine_serve_batching.py --vllm [--peer DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from benchmarks._common import TARGET, host, parser, prompts, spread, start_vllm

CONCURRENCY = (1, 8, 32)
MODEL = "m"


def start(*flags: str, root: Path | None = None) -> tuple[subprocess.Popen, str]:
    """An engine-serve process with these flags (from the checkout at `root`, default this one),
    once /health answers (the tests' launcher)."""
    from tests.http.conftest import start_engine_serve

    return start_engine_serve("--served-model-name", MODEL, *flags, **({"root": root} if root else {}))


def run_set(base: str, texts: list[str] | list[list[int]], concurrency: int,
            max_tokens: int) -> tuple[float, int, list[tuple]]:
    """Every prompt (a text, or token ids) through a pool of `concurrency` client threads: (wall
    seconds, generated tokens, each output as (text, completion_tokens) in prompt order)."""
    with httpx.Client(base_url=base, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        def one(prompt: str | list[int]) -> tuple[str, int]:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0})
            r.raise_for_status()
            body = r.json()
            return body["choices"][0]["text"], body["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(one, texts))
        wall = time.perf_counter() - t0
    return wall, sum(n for _, n in outs), outs


def rates(runs: list[tuple[float, int, list]]) -> dict:
    return spread([tokens / wall for wall, tokens, _ in runs], digits=1)


def equal(outs: list[tuple], reference: list[tuple]) -> int:
    return sum(a == b for a, b in zip(outs, reference, strict=True))


def start_ids(texts: list[str]) -> list[list[int]]:
    """The prompts as the reference engine encodes them: its start token, then the tokenizer's ids
    without special tokens (engines/reference/engine.py). vLLM's tokenizer adds no start token to
    this model's prompts, so vLLM is sent these ids: both servers then decode from the same ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return [[start, *tok(text, add_special_tokens=False)["input_ids"]] for text in texts]


def fp32_figures(batched: str, serial: str, texts: list[str], max_tokens: int, repeats: int,
                 vllm: str | None = None, peer: str | None = None) -> dict:
    """Per concurrency: batched and serial throughput (alternating), the speedup per round, and
    how many batched outputs equal the serial server's at concurrency 1; with `vllm`, vLLM's
    throughput in the same rounds (the sides' order rotating), engine-serve's over vLLM's
    per round, and how many of vLLM's outputs equal the serial server's; with `peer` (another
    checkout's batched engine-serve) the same for it."""
    reference = run_set(serial, texts, 1, max_tokens)[2]
    bases = {"batched": batched, "serial": serial, **({"vllm": vllm} if vllm else {}),
             **({"peer": peer} if peer else {})}
    asked: dict[str, list[str] | list[list[int]]] = {"batched": texts, "serial": texts, "peer": texts}
    if vllm:
        asked["vllm"] = start_ids(texts)
    out: dict = {}
    for c in CONCURRENCY:
        runs: dict[str, list] = {side: [] for side in bases}
        order = list(bases)
        for r in range(repeats):
            for side in order[r % len(order):] + order[: r % len(order)]:
                runs[side].append(run_set(bases[side], asked[side], c, max_tokens))
        out[str(c)] = {
            "batched_tokens_per_s": rates(runs["batched"]),
            "serial_tokens_per_s": rates(runs["serial"]),
            "speedup": spread([s[0] / b[0] for b, s in zip(runs["batched"], runs["serial"], strict=True)], digits=2),
            "batched_equal_to_serial": min(equal(o, reference) for _, _, o in runs["batched"]),
            "serial_equal_to_serial": min(equal(o, reference) for _, _, o in runs["serial"]),
        }
        if vllm:
            out[str(c)] |= {
                "vllm_tokens_per_s": rates(runs["vllm"]),
                "engine_serve_over_vllm": spread([v[0] / b[0] for b, v in zip(runs["batched"], runs["vllm"],
                                                                              strict=True)], digits=2),
                "vllm_equal_to_serial": min(equal(o, reference) for _, _, o in runs["vllm"])}
        if peer:
            out[str(c)] |= {
                "peer_tokens_per_s": rates(runs["peer"]),
                "batched_over_peer": spread([p[0] / b[0] for b, p in zip(runs["batched"], runs["peer"], strict=True)],
                                            digits=2),
                "peer_equal_to_serial": min(equal(o, reference) for _, _, o in runs["peer"])}
    return out


def bf16_figures(base: str, texts: list[str], max_tokens: int) -> dict:
    """bf16 weights, batched: throughput per concurrency and the outputs that differ from the
    same server's at concurrency 1 (every request decoded alone)."""
    import torch
    from engines.reference.engine import compute_dtype_for

    out: dict = {"compute_dtype": str(compute_dtype_for(torch.bfloat16, torch.device("cpu"))).removeprefix("torch.")}
    reference: list[tuple] = []
    for c in CONCURRENCY:
        wall, tokens, outs = run_set(base, texts, c, max_tokens)
        reference = reference or outs
        out[str(c)] = {"tokens_per_s": round(tokens / wall, 1),
                       "differ_from_concurrency_1": len(texts) - equal(outs, reference)}
    return out


def peer_commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompts", type=int, default=64, help="prompts from the held-out docs (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--kv-cache", default="auto", help="the fp32 servers' KV format (default auto); not auto: no bf16 server")
    p.add_argument("--speculative", default="off",
                   help='the fp32 servers\' speculative decoding, e.g. \'{"method": "ngram", "k": 4}\' (default off); '
                        'not off: no bf16 server')
    p.add_argument("--vllm", action="store_true",
                   help="also vLLM's CPU build (`make test-vllm` installs it) on the same model in fp32, its own "
                        "defaults for batching, timed in the same rounds; with --kv-cache auto and no --speculative only")
    p.add_argument("--peer", type=Path, help="a checkout of another commit: its batched engine-serve, the same flags, "
                                             "timed in the same rounds")
    args = p.parse_args()
    if args.vllm and (args.kv_cache != "auto" or args.speculative != "off"):
        raise SystemExit("--vllm: the peer serves the plain fp32 model; leave out --kv-cache and --speculative")
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (a median and a spread need three)")
    texts = prompts(args.prompts)
    threads = ("--threads", str(args.threads)) if args.threads else ()  # the servers' torch threads
    kv = ("--kv-cache", args.kv_cache, "--speculative", args.speculative)
    servers = {"batched": start(*threads, *kv), "serial": start(*threads, *kv, "--max-num-seqs", "1")}
    if args.kv_cache == "auto" and args.speculative == "off":
        servers["bf16"] = start(*threads, "--weights", "bf16")
    if args.peer:
        servers["peer"] = start(*threads, *kv, root=args.peer.resolve())
    if args.vllm:
        servers["vllm"] = start_vllm(Path(tempfile.mkdtemp(prefix="vllm-")) / "vllm.log", MODEL)
    try:
        for side, (_, base) in servers.items():  # warm-up: first-call allocations stay out of the timings
            run_set(base, start_ids(texts[:8]) if side == "vllm" else texts[:8], 8, 4)
        t0 = time.perf_counter()
        fp32 = fp32_figures(servers["batched"][1], servers["serial"][1], texts, args.max_tokens, args.repeats,
                            servers["vllm"][1] if "vllm" in servers else None,
                            servers["peer"][1] if "peer" in servers else None)
        bf16 = bf16_figures(servers["bf16"][1], texts, args.max_tokens) if "bf16" in servers else None
        seconds = round(time.perf_counter() - t0, 1)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    fp32_equal = all(f["batched_equal_to_serial"] == len(texts) for f in fp32.values())
    print(json.dumps({"benchmark": "engine_serve_batching", "kv_cache": args.kv_cache,
                      "speculative": json.loads(args.speculative) if args.speculative != "off" else "off",
                      "prompts": len(texts),
                      "max_tokens": args.max_tokens,
                      "repeats": args.repeats, "fp32": fp32, "bf16": bf16, "fp32_batched_equals_serial": fp32_equal,
                      "speedup_at_8_median": fp32["8"]["speedup"]["median"], "target_at_8": 3.0,
                      "server_threads": args.threads or "engine-serve default (cores - 1)", "seconds": seconds,
                      **({"peer": peer_commit(args.peer)} if args.peer else {}), **host()}))
    sys.exit(0 if fp32_equal else 1)


if __name__ == "__main__":
    main()
