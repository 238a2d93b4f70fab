"""A perturbing OpenAI-compatible proxy on loopback, for seeding faults through the public
interface: every request goes to the upstream server (`canary engine-serve`) as it is, and the
answer of POST /v1/completions passes through a fault on its way back: `fault` on a JSON answer
(prompt log-probs), `stream_fault` on each event of a streamed one (generated text), relayed
event by event as the upstream sends it so that the client sees the server's timing. `delay_ms`
holds each streamed completion that long before sending it upstream: a TTFT regression of
exactly that much (and the proxy's own hop, which a baseline behind an identity proxy shares).
Every other route (/v1/models, /metrics) passes through untouched.

`generation` replaces the generation of a streamed greedy POST /v1/completions (temperature 0,
one choice, no stop, no logprobs) by a seeded server behaviour of known truth (a `Generation`:
near_tie_flips, confident_flips, empty_answers, loops, phrase loops, truncation, unrelated text,
corrupt_when_batched, and any of them only under load: WhenBatched): the
proxy computes the whole answer through the upstream's public API (greedy completions with
`logprobs: 2`, continuations, /detokenize), then streams it back in engine-serve's shape: one
event per token piece, a final event with `finish_reason`, a usage chunk when
`stream_options.include_usage` asks for it, `[DONE]`. Whether a request is affected depends only
on the behaviour's seed and the request's prompt (`random.Random(f"{seed}:{prompt}")`), never on
arrival order; unaffected requests get the upstream's own greedy answer."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse


def zero_logprobs(answer: dict) -> dict:
    """Every token log-prob 0 (probability 1): a server that does not really score prompts."""
    for choice in answer.get("choices", []):
        lp = choice.get("logprobs") or {}
        lp["token_logprobs"] = [None if x is None else 0.0 for x in lp.get("token_logprobs") or []]
    return answer


def shift_logprobs(nats: float) -> Callable[[dict], dict]:
    """Every prompt token's log-prob lowered by `nats`: a candidate whose perplexity is exactly
    exp(nats) times the baseline's (a known-size quality loss)."""

    def fault(answer: dict) -> dict:
        for choice in answer.get("choices", []):
            lp = choice.get("logprobs") or {}
            lp["token_logprobs"] = [None if x is None else x - nats for x in lp.get("token_logprobs") or []]
        return answer

    return fault


def garble(rate: float, seed: int = 0) -> Callable[[dict], dict]:
    """Each streamed piece of generated text replaced, with probability `rate`, by as many random
    letters: a sampler or detokenizer bug after verification. Prompt log-probs are untouched."""
    rng = random.Random(seed)

    def fault(event: dict) -> dict:
        for choice in event.get("choices", []):
            text = choice.get("text") or ""
            if text.strip() and rng.random() < rate:
                choice["text"] = (" " if text.startswith(" ") else "") + "".join(
                    rng.choice("qxzjvkw") for _ in range(max(1, len(text.strip()))))
        return event

    return fault


# -- seeded generation behaviours ------------------------------------------------------------------


class UpstreamRefused(Exception):
    """The upstream answered an error: relayed to the client with its status and body."""

    def __init__(self, response: httpx.Response):
        super().__init__(response.status_code)
        self.response = response


@dataclass
class Answer:
    """A whole generated answer, ready to stream: the token pieces (concatenating to the text)."""

    pieces: list[str]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class Greedy:
    """The upstream's greedy answer with the top-2 log-probs at each generated position; `tokens`
    holds the end-of-text token when the answer stopped on it, `pieces` never does."""

    id: str
    model: str
    text: str
    tokens: list[str]
    top: list[dict[str, float]]
    finish_reason: str
    prompt_tokens: int
    eos: str

    @property
    def pieces(self) -> list[str]:
        return self.tokens[:-1] if self.tokens and self.tokens[-1] == self.eos else list(self.tokens)

    def answer(self) -> Answer:
        pieces = self.pieces if "".join(self.pieces) == self.text else [self.text]  # a split multi-byte character
        return Answer(pieces, self.finish_reason, self.prompt_tokens, len(self.tokens))

    def gaps(self) -> list[tuple[int, float, str]]:
        """(position, top-1 minus top-2 log-prob, the other of the top two) at each position whose
        two alternatives are distinct strings and include the greedy token."""
        out = []
        for position, (token, top) in enumerate(zip(self.tokens, self.top, strict=True)):
            if len(top) < 2 or token not in top:
                continue
            (first, lp1), (second, lp2) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
            if token not in (first, second):
                continue
            out.append((position, lp1 - lp2, second if token == first else first))
        return out


class Upstream:
    """The upstream engine-serve as the behaviours use it: its public API only."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client
        self._info: dict | None = None

    async def info(self) -> dict:
        if self._info is None:
            response = await self.client.get("/tokenizer_info")
            if response.status_code != 200:
                raise UpstreamRefused(response)
            self._info = response.json()
        return self._info

    async def greedy(self, request: dict, prompt: str | list[int], max_tokens: int) -> Greedy:
        """A non-streamed greedy completion of `prompt` with the request's other fields."""
        body = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        body.update(prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)
        response = await self.client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise UpstreamRefused(response)
        answer, eos = response.json(), (await self.info())["eos_token"]
        (choice,) = answer["choices"]
        lp = choice.get("logprobs") or {}
        return Greedy(answer.get("id") or f"cmpl-{uuid.uuid4().hex}", answer.get("model") or request.get("model"),
                      choice["text"], list(lp.get("tokens") or []), list(lp.get("top_logprobs") or []),
                      choice.get("finish_reason") or "length", int(answer["usage"]["prompt_tokens"]), eos)

    async def extend(self, prompt: str | list[int], text: str) -> str | list[int]:
        """The prompt with `text` after it: text to text, token ids to ids (the text tokenized alone)."""
        if isinstance(prompt, str):
            return prompt + text
        response = await self.client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        if response.status_code != 200:
            raise UpstreamRefused(response)
        return list(prompt) + response.json()["tokens"]

    async def token_text(self, token_id: int) -> str:
        response = await self.client.post("/detokenize", json={"tokens": [token_id]})
        if response.status_code != 200:
            raise UpstreamRefused(response)
        return response.json()["prompt"]


def prompt_key(prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class Generation:
    """A seeded server behaviour on streamed greedy completions. Each request is affected with
    probability `rate`, decided by `random.Random(f"{seed}:{prompt}")` (the same prompt, the same
    decision, whatever the arrival order); an unaffected one gets the upstream's greedy answer.
    `affected` lists the prompts (token-id prompts as JSON) whose answers were changed: drawn,
    and given an answer whose text or finish reason differs from the greedy one."""

    name = "greedy"

    def __init__(self, rate: float = 0.0, seed: int = 0, per_request: bool = False):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.rate, self.seed = rate, seed
        self.affected: list[str] = []
        self.asked: set[str] = set()  # every prompt this behaviour answered
        # per_request: each request of a prompt draws anew (its RNG keyed on the prompt and how many
        # times the prompt came before), as a server that is not batch-invariant answers the same
        # prompt differently from one request to the next; still reproducible for a seed
        self.per_request = per_request
        self.seen: dict[str, int] = {}
        # per prompt answered: (the upstream's greedy answer's tokens, the answer's), the latest request's
        self.lengths: dict[str, tuple[int, int]] = {}

    def rng(self, prompt: str | list[int], draw: bool = False) -> random.Random:
        key = prompt_key(prompt)
        if not self.per_request:
            return random.Random(f"{self.seed}:{key}")
        nth = self.seen.get(key, 0)
        if draw:
            self.seen[key] = nth + 1
        return random.Random(f"{self.seed}:{key}:{nth}")

    def hits(self, prompt: str | list[int]) -> bool:
        """Whether this behaviour changes the answer to `prompt` (the first draw of its RNG)."""
        return self.rng(prompt).random() < self.rate

    @staticmethod
    def handles(request: dict) -> bool:
        """A streamed greedy completion of one prompt, one choice, no stop, no logprobs, no echo."""
        prompt = request.get("prompt")
        single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                             and all(isinstance(t, int) for t in prompt))
        return bool(request.get("stream")) and single and request.get("temperature") == 0 and (
            request.get("n") in (None, 1) and not request.get("stop") and not request.get("stop_token_ids")
            and request.get("logprobs") is None and not request.get("echo") and request.get("best_of") in (None, 1))

    def share(self) -> float | None:
        """The share of the prompts answered whose answer this behaviour changed: a fault's realized
        size, which on n prompts drawn at `rate` is Binomial(n, rate) / n."""
        return len(set(self.affected) & self.asked) / len(self.asked) if self.asked else None

    def length_ratio(self) -> float | None:
        """Σ tokens answered ÷ Σ tokens of the upstream's greedy answers, over the prompts answered."""
        greedy = sum(g for g, _ in self.lengths.values())
        return sum(a for _, a in self.lengths.values()) / greedy if greedy else None

    def forget(self) -> None:
        """Start counting `share` anew (a new run through the same proxy)."""
        self.affected.clear()
        self.asked.clear()
        self.lengths.clear()

    async def answer(self, upstream: Upstream, request: dict) -> tuple[Greedy, Answer]:
        """(the upstream's greedy answer, the answer to stream)."""
        prompt, max_tokens = request["prompt"], request.get("max_tokens") or 16
        self.asked.add(prompt_key(prompt))
        rng = self.rng(prompt, draw=True)
        greedy = await upstream.greedy(request, prompt, max_tokens)
        if not rng.random() < self.rate:
            return greedy, self.answered(prompt, greedy, greedy.answer())
        return greedy, await self.changed(upstream, request, greedy, rng)

    async def changed(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        """The changed answer to a request drawn, counted in `affected` when it differs from the greedy one
        (drawn but not changed, as with no top-two gap to flip or an answer already empty: not counted)."""
        changed, unchanged = await self.change(upstream, request, greedy, rng), greedy.answer()
        if (changed.text, changed.finish_reason) != (unchanged.text, unchanged.finish_reason):
            self.affected.append(prompt_key(request["prompt"]))
        return self.answered(request["prompt"], greedy, changed)

    def answered(self, prompt: str | list[int], greedy: Greedy, answer: Answer) -> Answer:
        self.lengths[prompt_key(prompt)] = (len(greedy.tokens), answer.completion_tokens)
        return answer

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        return greedy.answer()


@dataclass(frozen=True)
class Flip:
    """One flipped answer: the greedy token at `position` replaced by `replacement`, the other of
    its top two, whose log-probs were `gap` apart; `gaps[i]` is the gap at each position of the
    greedy answer (None where its top two are not two distinct strings with the greedy token)."""

    prompt: str
    position: int
    gap: float
    token: str
    replacement: str
    gaps: tuple[float | None, ...] = field(repr=False)


class _Flips(Generation):
    """The answer flips at one position to the other of its top-two tokens, then goes on greedily
    from there (the upstream's greedy continuation of the prompt, the answer before it and the
    flipped token, for the tokens left). `records` holds one Flip per affected request."""

    largest = False

    def __init__(self, rate: float = 0.0, seed: int = 0, per_request: bool = False,
                 window: tuple[float, float] = (0.0, 1.0), max_gap: float | None = None):
        super().__init__(rate, seed, per_request)
        self.records: list[Flip] = []
        # the share of the answer's positions a flip may fall in: (0, 0.5) early, (0.5, 1) late
        self.window = window
        # flip only where the top two are at most this many nats apart (None: wherever the pick falls); an
        # answer with no such position is left as it is
        self.max_gap = max_gap

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        lo, hi = (round(edge * len(greedy.tokens)) for edge in self.window)
        gaps = [g for g in greedy.gaps() if lo <= g[0] < max(hi, lo + 1)
                and (self.max_gap is None or g[1] <= self.max_gap)]
        if not gaps:
            return greedy.answer()
        pick = max if self.largest else min  # the earliest of equal gaps
        position, gap, replacement = pick(gaps, key=lambda g: g[1])
        prompt, max_tokens = request["prompt"], request.get("max_tokens") or 16
        every: list[float | None] = [None] * len(greedy.tokens)
        for at, g, _ in gaps:
            every[at] = g
        self.records.append(Flip(prompt_key(prompt), position, gap, greedy.tokens[position], replacement, tuple(every)))
        before = greedy.tokens[:position]  # never the end-of-text token: only the last can be
        if replacement == greedy.eos:
            return Answer(before, "stop", greedy.prompt_tokens, position + 1)
        left = max_tokens - position - 1
        if left <= 0:
            return Answer([*before, replacement], "length", greedy.prompt_tokens, position + 1)
        rest = await upstream.greedy(request, await upstream.extend(prompt, "".join(before) + replacement), left)
        return Answer([*before, replacement, *rest.pieces], rest.finish_reason, greedy.prompt_tokens,
                      position + 1 + len(rest.tokens))


class NearTieFlips(_Flips):
    """Flips at the answer's nearest near-tie (smallest top-1/top-2 gap): a nondeterministic GPU server."""

    name = "near_tie_flips"


class ConfidentFlips(_Flips):
    """Flips at the answer's most confident token (largest top-1/top-2 gap): a real bug."""

    name = "confident_flips"
    largest = True


class EmptyAnswers(Generation):
    name = "empty_answers"

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        return Answer([], "stop", greedy.prompt_tokens, 0)


class Loops(Generation):
    """From token `after` on (0: the whole answer), the answer's token there repeated up to
    max_tokens (at position 0 the runner-up when the first is the end of text; past the answer's
    end, its last token)."""

    name = "loops"

    def __init__(self, rate: float = 0.0, seed: int = 0, after: int = 0):
        super().__init__(rate, seed)
        self.after = after

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        max_tokens = request.get("max_tokens") or 16
        pieces = greedy.pieces
        keep = min(self.after, len(pieces), max_tokens - 1)
        if keep < len(pieces):
            unit = pieces[keep]
        elif pieces:
            unit = pieces[-1]
        else:  # the answer is the end of text alone: its runner-up
            unit = next((t for t in sorted(greedy.top[0], key=lambda t: -greedy.top[0][t]) if t != greedy.eos), " ")
        return Answer([*pieces[:keep], *[unit] * (max_tokens - keep)], "length", greedy.prompt_tokens, max_tokens)


class PhraseLoops(Generation):
    """After the answer's first `after` tokens, its last `n` of those repeated back to back up to
    max_tokens: a loop of a short phrase that starts mid-answer (an answer shorter than `after`
    loops its own last `n` tokens; one shorter than `n`, all of them)."""

    name = "phrase_loops"

    def __init__(self, rate: float = 0.0, seed: int = 0, n: int = 3, after: int = 6):
        super().__init__(rate, seed)
        if n < 1 or after < 0:
            raise ValueError(f"n must be ≥ 1 and after ≥ 0, got n={n}, after={after}")
        self.n, self.after = n, after

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        max_tokens = request.get("max_tokens") or 16
        head = greedy.pieces[: max(self.after, self.n)] or [" "]
        phrase = head[-self.n:]
        out = list(head)
        while len(out) < max_tokens:
            out.extend(phrase)
        return Answer(out[:max_tokens], "length", greedy.prompt_tokens, max_tokens)


class Truncation(Generation):
    """The answer cut to the first `keep` share of its tokens (default a quarter; at least one),
    finish_reason "stop"."""

    name = "truncation"

    def __init__(self, rate: float = 0.0, seed: int = 0, keep: float = 0.25):
        super().__init__(rate, seed)
        if not 0.0 < keep < 1.0:
            raise ValueError(f"keep must be in (0, 1), got {keep}")
        self.keep = keep

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        keep = max(1, int(len(greedy.tokens) * self.keep))
        return Answer([t for t in greedy.tokens[:keep] if t != greedy.eos], "stop", greedy.prompt_tokens, keep)


# openings of text that no prompt of the project's corpora continues: an answer to one of them, in
# place of the answer asked for, is an unrelated answer (a cache that serves another prompt's text)
UNRELATED_PROMPTS = ("The recipe calls for two cups of flour and", "On the third day of the voyage the captain",
                     "Photosynthesis converts light energy into", "The referee blew the whistle and the crowd")


class UnrelatedText(Generation):
    """The answer replaced by the upstream's greedy answer to an unrelated prompt
    (UNRELATED_PROMPTS, one drawn per affected request), of the same max_tokens."""

    name = "unrelated_text"

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        other = await upstream.greedy(request, rng.choice(UNRELATED_PROMPTS), request.get("max_tokens") or 16)
        return Answer(other.answer().pieces, other.finish_reason, greedy.prompt_tokens, len(other.tokens))


@dataclass(eq=False)
class _InFlight:
    prompt: str | list[int]
    met: list[_InFlight] = field(default_factory=list)  # requests in flight at some moment of this one's life


class _Overlaps:
    """The generation requests in flight at the proxy: `enter` one, and its `met` fills with every
    request in flight at some moment of its life (one arrived while the other was in flight)."""

    def __init__(self) -> None:
        self.in_flight: list[_InFlight] = []

    def enter(self, prompt: str | list[int]) -> _InFlight:
        me = _InFlight(prompt, list(self.in_flight))
        for other in self.in_flight:
            other.met.append(me)
        self.in_flight.append(me)
        return me

    def leave(self, me: _InFlight) -> None:
        self.in_flight.remove(me)

    async def greedy(self, upstream: Upstream, request: dict) -> tuple[Greedy, _InFlight]:
        """The upstream's greedy answer to the request, in flight here while it is computed, and the
        request's record of whom it met."""
        prompt, max_tokens = request["prompt"], request.get("max_tokens") or 16
        me = self.enter(prompt)
        try:
            return await upstream.greedy(request, prompt, max_tokens), me
        finally:
            self.leave(me)


class CorruptWhenBatched(Generation):
    """Batch-row crosstalk: a request that shared the proxy with another generation request at any
    moment of its life (one arrived while the other was in flight) gets the greedy answer of one of
    those requests' prompts instead of its own (chosen by its seeded RNG among those whose greedy
    answer differs from its own; random vocabulary tokens when none does). A request alone at the
    proxy passes through untouched. At `rate` < 1, only that share of the batched requests (drawn by
    prompt). `records` holds (prompt, the partner's prompt or None)."""

    name = "corrupt_when_batched"

    def __init__(self, seed: int = 0, rate: float = 1.0):
        super().__init__(rate, seed)
        self.overlaps = _Overlaps()
        self.records: list[tuple[str, str | None]] = []

    async def answer(self, upstream: Upstream, request: dict) -> tuple[Greedy, Answer]:
        prompt, max_tokens = request["prompt"], request.get("max_tokens") or 16
        self.asked.add(prompt_key(prompt))
        greedy, me = await self.overlaps.greedy(upstream, request)
        key, rng = prompt_key(prompt), self.rng(prompt)
        if not me.met or not rng.random() < self.rate:  # alone, or batched but not drawn (at rate < 1)
            return greedy, self.answered(prompt, greedy, greedy.answer())
        self.affected.append(key)
        partners = sorted({prompt_key(o.prompt): o.prompt for o in me.met if prompt_key(o.prompt) != key}.items())
        rng.shuffle(partners)
        for partner_key, partner in partners:
            other = await upstream.greedy(request, partner, max_tokens)
            if other.text != greedy.text:
                self.records.append((key, partner_key))
                return greedy, self.answered(prompt, greedy, Answer(other.answer().pieces, other.finish_reason,
                                                                    greedy.prompt_tokens, len(other.tokens)))
        info = await upstream.info()
        vocabulary = [t for t in range(int(info["vocab_size"])) if t != info.get("eos_token_id")]
        ids = [rng.choice(vocabulary) for _ in range(max_tokens)]
        self.records.append((key, None))
        pieces = list(await asyncio.gather(*(upstream.token_text(t) for t in ids)))
        return greedy, self.answered(prompt, greedy, Answer(pieces, "length", greedy.prompt_tokens, max_tokens))


class WhenBatched(Generation):
    """Another behaviour (`inner`) only for a request that shared the proxy with another generation
    request at some moment of its life; a request alone passes through untouched: a fault, or a
    nondeterminism, that shows only under load. `affected` lists the prompts it changed; the inner
    behaviour keeps its own records."""

    def __init__(self, inner: Generation):
        super().__init__(inner.rate, inner.seed, inner.per_request)
        self.inner, self.name = inner, f"{inner.name}_when_batched"
        self.overlaps = _Overlaps()

    async def answer(self, upstream: Upstream, request: dict) -> tuple[Greedy, Answer]:
        prompt = request["prompt"]
        self.asked.add(prompt_key(prompt))
        greedy, me = await self.overlaps.greedy(upstream, request)
        rng = self.inner.rng(prompt, draw=True)
        if not me.met or not rng.random() < self.inner.rate:
            return greedy, self.answered(prompt, greedy, greedy.answer())
        return greedy, await self.changed(upstream, request, greedy, rng)

    async def change(self, upstream: Upstream, request: dict, greedy: Greedy, rng: random.Random) -> Answer:
        return await self.inner.change(upstream, request, greedy, rng)

    def forget(self) -> None:
        super().forget()
        self.inner.forget()


def near_tie_flips(p: float, seed: int = 0, per_request: bool = False) -> NearTieFlips:
    """per_request: each request draws anew, so a prompt sent twice may come back two ways (a GPU
    server's nondeterminism); else one decision per prompt."""
    return NearTieFlips(p, seed, per_request)


def confident_flips(p: float, seed: int = 0) -> ConfidentFlips:
    return ConfidentFlips(p, seed)


def empty_answers(p: float, seed: int = 0) -> EmptyAnswers:
    return EmptyAnswers(p, seed)


def loops(p: float, seed: int = 0) -> Loops:
    return Loops(p, seed)


def truncation(p: float, seed: int = 0) -> Truncation:
    return Truncation(p, seed)


def corrupt_when_batched(seed: int = 0, rate: float = 1.0) -> CorruptWhenBatched:
    return CorruptWhenBatched(seed, rate)


def stream_answer(greedy: Greedy, answer: Answer, include_usage: bool):
    """The answer as engine-serve streams it: one event per piece, the finish, usage if asked, [DONE]."""
    head = {"id": greedy.id, "object": "text_completion", "model": greedy.model}

    def event(payload: dict) -> bytes:
        return f"data: {json.dumps({**head, **payload})}\n\n".encode()

    for piece in answer.pieces:
        if piece:
            yield event({"choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}]})
    yield event({"choices": [{"index": 0, "text": "", "finish_reason": answer.finish_reason, "logprobs": None,
                              "stop_reason": None}]})
    if include_usage:
        total = answer.prompt_tokens + answer.completion_tokens
        yield event({"choices": [], "usage": {"prompt_tokens": answer.prompt_tokens,
                                              "completion_tokens": answer.completion_tokens, "total_tokens": total}})
    yield b"data: [DONE]\n\n"


def proxy_app(upstream: str, fault: Callable[[dict], dict] = lambda x: x,
              stream_fault: Callable[[dict], dict] = lambda x: x, delay_ms: float = 0.0,
              generation: Generation | None = None,
              refuse: Callable[[dict], tuple[int, str] | None] = lambda asked: None) -> FastAPI:
    """`generation`: a seeded behaviour that computes the answer of each streamed greedy completion
    (Generation.handles); other completions are relayed (through `stream_fault`) as before.
    `refuse`: given a completion's body, (status, message) to answer it with instead of the
    server's answer (an OpenAI-style error body), or None to relay it."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=120)
    engine = Upstream(client)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        asked = json.loads(body or b"{}") if path == "v1/completions" else {}
        refusal = refuse(asked) if isinstance(asked, dict) and asked else None
        if refusal is not None:
            status, message = refusal
            return JSONResponse({"error": {"message": message, "type": "BadRequestError" if status < 500
                                           else "InternalServerError", "code": status}}, status_code=status)
        if generation is not None and isinstance(asked, dict) and generation.handles(asked):
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            try:
                greedy, answer = await generation.answer(engine, asked)
            except UpstreamRefused as refused:
                return Response(refused.response.content, status_code=refused.response.status_code,
                                media_type=refused.response.headers.get("content-type"))
            include_usage = bool((asked.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream_answer(greedy, answer, include_usage), media_type="text/event-stream")
        if path == "v1/completions" and isinstance(asked, dict) and asked.get("stream"):
            # streamed through as the upstream sends it, event by event, so that the timing the
            # client sees is the server's (plus `delay_ms` before the first byte)
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            upstream_request = client.build_request("POST", "/" + path, content=body, headers=headers)
            answer = await client.send(upstream_request, stream=True)

            async def relay():
                pending = ""
                try:
                    async for text in answer.aiter_text():
                        pending += text
                        while "\n" in pending:
                            line, pending = pending.split("\n", 1)
                            if line.startswith("data: {"):
                                line = "data: " + json.dumps(stream_fault(json.loads(line[len("data: "):])))
                            yield (line + "\n").encode()
                    if pending:
                        yield pending.encode()
                finally:
                    await answer.aclose()

            return StreamingResponse(relay(), status_code=answer.status_code,
                                     media_type=answer.headers.get("content-type"))
        answer = await client.request(request.method, "/" + path, content=body,
                                      headers={"content-type": request.headers.get("content-type", "application/json")})
        content, kind = answer.content, answer.headers.get("content-type", "")
        if path == "v1/completions" and answer.status_code == 200:
            if kind.startswith("application/json"):
                content = json.dumps(fault(answer.json())).encode()
        return Response(content, status_code=answer.status_code, media_type=kind or None)

    return app
