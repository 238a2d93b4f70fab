"""LLM-as-judge over any OpenAI-compatible chat endpoint (docs/reference.md §5).

- pairwise: baseline vs candidate judged in both orders; a win counts only when both orders
  agree, otherwise a tie; the position-consistency rate is reported (MT-Bench).
- rubric: single-answer score 1–5; when the endpoint returns top log-probs, the
  probability-weighted score Σ p(s)·s over the score token's digits (G-Eval), else the stated one.
- reference-guided: either mode shows the reference answer to the judge when the sample has one.
- robust by construction: structured JSON output parsed strictly, re-asked up to max_parse_retries
  times; what still fails is a *parse failure* — counted and surfaced, never a 0 and never dropped
  silently. HTTP 429 (Retry-After honoured), 5xx and timeouts are retried with backoff + jitter;
  other 4xx fail at once. Replies are cached by content hash; requests run `concurrency` at a time
  under a requests-per-second limit; prompt and completion tokens are counted.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import httpx

from evals.stats import wilson_interval


class JudgeError(RuntimeError):
    """The judge endpoint refused or failed (after retries); the message names the endpoint."""


@dataclass(frozen=True)
class JudgeConfig:
    base_url: str  # OpenAI base URL, e.g. http://judge.internal:8000/v1
    model: str
    api_key: str | None = None  # the value; callers read it from the environment
    concurrency: int = 4
    requests_per_second: float | None = None
    timeout_s: float = 30.0
    max_http_retries: int = 4
    max_parse_retries: int = 2
    backoff_s: float = 0.5  # first backoff; doubles per retry, with ±50 % jitter
    max_backoff_s: float = 30.0
    top_logprobs: int = 20
    temperature: float = 0.0


@dataclass(frozen=True)
class ChatReply:
    text: str
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...] | None  # per output token: (token, logprob) alternatives
    prompt_tokens: int
    completion_tokens: int
    cached: bool = False


@dataclass
class Usage:
    requests: int = 0
    cached: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    http_retries: int = 0
    parse_retries: int = 0


class JudgeClient:
    """``transport``: the httpx transport requests go through (the service passes one that checks
    the URL against its outbound policy and pins the checked address); default plain httpx."""

    def __init__(self, cfg: JudgeConfig, cache: dict | None = None, sleep: Callable[[float], None] = time.sleep,
                 transport: httpx.BaseTransport | None = None):
        self.cfg = cfg
        self.cache: dict[str, ChatReply] = cache if cache is not None else {}
        self.usage = Usage()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_start = 0.0
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.Client(timeout=cfg.timeout_s, headers=headers, follow_redirects=False, transport=transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> JudgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def cache_key(body: dict) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def _pace(self) -> None:
        rps = self.cfg.requests_per_second
        if not rps:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + 1.0 / rps
        if start > now:
            self._sleep(start - now)

    def chat(self, messages: list[dict], *, logprobs: bool = False, attempt: int = 0) -> ChatReply:
        body = {"model": self.cfg.model, "messages": messages, "temperature": self.cfg.temperature, "max_tokens": 512}
        if logprobs:
            body.update(logprobs=True, top_logprobs=self.cfg.top_logprobs)
        if attempt:
            body["seed"] = attempt  # a re-ask after a parse failure is a different request
        key = self.cache_key(body)
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.usage.cached += 1
                return ChatReply(hit.text, hit.top_logprobs, hit.prompt_tokens, hit.completion_tokens, cached=True)
        reply = self._post(body)
        with self._lock:
            self.cache[key] = reply
        return reply

    def _post(self, body: dict) -> ChatReply:
        url = f"{self.cfg.base_url.rstrip('/')}/chat/completions"
        last = ""
        for retry in range(self.cfg.max_http_retries + 1):
            self._pace()
            wait = None
            try:
                r = self.http.post(url, json=body)
            except httpx.TimeoutException:
                last = f"timed out after {self.cfg.timeout_s:g} s"
            except httpx.HTTPError as e:
                last = f"unreachable ({type(e).__name__})"
            else:
                if r.status_code == 200:
                    return self._reply(r, _shown(url))
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code == 429 or r.status_code >= 500:
                    wait = _retry_after(r)
                else:
                    raise JudgeError(f"judge {_shown(url)} refused the request ({last}); not retried")
            if retry == self.cfg.max_http_retries:
                break
            with self._lock:
                self.usage.http_retries += 1
            if wait is None:
                base = min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2**retry)
                wait = base * random.uniform(0.5, 1.5)
            self._sleep(min(wait, self.cfg.max_backoff_s))  # a Retry-After of an hour does not stall a run
        raise JudgeError(f"judge {_shown(url)} failed after {self.cfg.max_http_retries + 1} attempts: {last}")

    def _reply(self, r: httpx.Response, url: str) -> ChatReply:
        try:
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"judge {url} answered 200 without an OpenAI chat completion: {r.text[:200]}") from e
        content = ((choice.get("logprobs") or {}).get("content")) or None
        top = None
        if content:
            top = tuple(tuple((alt["token"], float(alt["logprob"])) for alt in (tok.get("top_logprobs") or []))
                        for tok in content)
        usage = data.get("usage") or {}
        pt, ct = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        with self._lock:
            self.usage.requests += 1
            self.usage.prompt_tokens += pt
            self.usage.completion_tokens += ct
        return ChatReply(text, top, pt, ct)

    def ask_json(self, messages: list[dict], validate: Callable[[dict], object], *, logprobs: bool = False
                 ) -> tuple[Any, Any, int]:
        """(parsed value, reply, parse failures) — re-asks up to max_parse_retries times; returns
        (None, last reply, failures) when every answer was malformed."""
        failures, reply = 0, None
        for attempt in range(self.cfg.max_parse_retries + 1):
            reply = self.chat(messages, logprobs=logprobs, attempt=attempt)
            try:
                return validate(extract_json(reply.text)), reply, failures
            except (ValueError, KeyError, TypeError):
                failures += 1
                if attempt < self.cfg.max_parse_retries:
                    with self._lock:
                        self.usage.parse_retries += 1
        return None, reply, failures

    def map(self, fn: Callable, items: Sequence) -> list:
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            return list(pool.map(fn, items))


def _retry_after(r: httpx.Response) -> float | None:
    value = r.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def extract_json(text: str) -> dict:
    """The first JSON object in a reply (models wrap it in prose or ``` fences). Each '{' is tried
    with the JSON decoder itself, so braces inside the object's strings ("uses {x}") are text."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    raise ValueError(f"no JSON object in judge reply: {text[:120]!r}")


# -- pairwise ------------------------------------------------------------------------------------
PAIRWISE_PROMPT = """You are comparing two answers to the same question. Judge correctness first, then helpfulness.
Ignore the answers' order and length.{reference}

Question:
{question}

Answer A:
{a}

Answer B:
{b}

Reply with only a JSON object: {{"winner": "A" | "B" | "tie", "reason": "<one sentence>"}}"""


@dataclass(frozen=True)
class PairwiseVerdict:
    sample_id: str
    winner: str  # "baseline" | "candidate" | "tie" | "parse_failure"
    consistent: bool | None  # both orders gave the same verdict (None after a parse failure)
    orders: tuple[str | None, str | None]  # verdict in order (baseline first), (candidate first)
    parse_failures: int
    rationale: str = ""


def _winner(d: dict) -> tuple[str, str]:
    w = str(d["winner"]).strip().upper()
    if w not in ("A", "B", "TIE"):
        raise ValueError(f"winner {w!r} is not A, B or tie")
    return w, str(d.get("reason", ""))


def pairwise(client: JudgeClient, sample_id: str, question: str, baseline: str, candidate: str,
             reference: str | None = None) -> PairwiseVerdict:
    ref = (f"\nA reference answer is given; an answer that contradicts it is wrong.\n\nReference answer:\n{reference}"
           if reference else "")
    verdicts: list[str | None] = []
    reasons: list[str] = []
    failures = 0
    for a, b, a_is in ((baseline, candidate, "baseline"), (candidate, baseline, "candidate")):
        msg = [{"role": "user", "content": PAIRWISE_PROMPT.format(reference=ref, question=question, a=a, b=b)}]
        parsed, _, f = client.ask_json(msg, _winner)
        failures += f
        if parsed is None:
            verdicts.append(None)
            continue
        w, reason = parsed
        other = "candidate" if a_is == "baseline" else "baseline"
        verdicts.append({"A": a_is, "B": other, "TIE": "tie"}[w])
        reasons.append(reason)
    both = (verdicts[0], verdicts[1])  # one verdict per order
    if None in verdicts:
        return PairwiseVerdict(sample_id, "parse_failure", None, both, failures, " | ".join(reasons))
    consistent = verdicts[0] == verdicts[1]
    winner = cast(str, verdicts[0]) if consistent else "tie"  # not None: checked above
    return PairwiseVerdict(sample_id, winner, consistent, both, failures, " | ".join(reasons))


@dataclass(frozen=True)
class PairwiseSummary:
    n: int  # samples judged (parse failures excluded, and counted below)
    candidate_wins: int
    baseline_wins: int
    ties: int
    parse_failures: int  # samples whose verdict could not be parsed after retries
    position_consistency: float | None  # share of judged samples whose two orders agreed
    candidate_win_rate: float | None  # (wins + ties/2) / n: 0.5 = parity
    ci: tuple[float, float]  # Wilson interval of the win rate (ties as half a win)


def summarize_pairwise(verdicts: Sequence[PairwiseVerdict]) -> PairwiseSummary:
    """Win rate = (candidate wins + ½·ties) / judged samples; its CI is the Wilson interval with
    ties counted as half a success (a conservative approximation)."""
    judged = [v for v in verdicts if v.winner != "parse_failure"]
    n = len(judged)
    cw = sum(v.winner == "candidate" for v in judged)
    bw = sum(v.winner == "baseline" for v in judged)
    ties = n - cw - bw
    rate = (cw + ties / 2) / n if n else None
    ci = wilson_interval(round(cw + ties / 2), n) if n else (float("nan"), float("nan"))
    position_consistency = (sum(bool(v.consistent) for v in judged) / n) if n else None
    return PairwiseSummary(n, cw, bw, ties, len(verdicts) - n, position_consistency, rate, ci)


# -- rubric ----------------------------------------------------------------------------------------
RUBRIC_PROMPT = """Rate the answer to the question on a 1-5 scale: 1 = wrong or useless, 3 = partly correct,
5 = fully correct and helpful.{reference}

Question:
{question}

Answer:
{answer}

Reply with only a JSON object whose first key is the score: {{"score": <1-5>, "reason": "<one sentence>"}}"""


@dataclass(frozen=True)
class RubricScore:
    sample_id: str
    score: float | None  # None only with parse_failure
    stated: int | None
    weighted: bool  # probability-weighted from the score token's log-probs
    parse_failures: int
    rationale: str = ""


def _score(d: dict) -> tuple[int, str]:
    s = d["score"]
    if isinstance(s, bool) or not isinstance(s, (int, float)) or int(s) != s or not 1 <= s <= 5:
        raise ValueError(f"score {s!r} is not an integer 1-5")
    return int(s), str(d.get("reason", ""))


def probability_weighted(top: tuple[tuple[tuple[str, float], ...], ...] | None, stated: int) -> float | None:
    """Σ p(s)·s over the digits 1–5 among the alternatives of the first output token that is the
    stated score (G-Eval); alternatives below 1 % are dropped and the rest renormalised."""
    import math

    if not top:
        return None
    for alts in top:
        if not alts or str(stated) not in {t.strip() for t, _ in alts[:1]}:
            continue
        probs: dict[int, float] = {}
        for tok, lp in alts:
            t = tok.strip()
            if t in {"1", "2", "3", "4", "5"} and math.exp(lp) >= 0.01:
                probs[int(t)] = probs.get(int(t), 0.0) + math.exp(lp)
        total = sum(probs.values())
        return sum(s * p for s, p in probs.items()) / total if total else None
    return None


def rubric(client: JudgeClient, sample_id: str, question: str, answer: str,
           reference: str | None = None) -> RubricScore:
    ref = f"\nGrade against this reference answer:\n{reference}" if reference else ""
    msg = [{"role": "user", "content": RUBRIC_PROMPT.format(reference=ref, question=question, answer=answer)}]
    parsed, reply, failures = client.ask_json(msg, _score, logprobs=True)
    if parsed is None:
        return RubricScore(sample_id, None, None, False, failures)
    stated, reason = parsed
    w = probability_weighted(reply.top_logprobs, stated)
    return RubricScore(sample_id, w if w is not None else float(stated), stated, w is not None, failures, reason)


def _shown(url: str) -> str:
    """The endpoint as errors name it (they reach the API as a scorer's reason): without
    user:password@ and the query string, where credentials live."""
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return "(invalid URL)"
    return str(u.copy_with(userinfo=b"", query=None))
