"""An OpenAI-compatible server as an engine (vLLM, SGLang, TGI, llama.cpp server, Ollama, or
`canary engine-serve`). The config's weights / kv_cache / speculative are labels of what the
server runs; the server decides.

- generate: streaming completions at `concurrency` requests in flight; TTFT = request sent →
  first non-empty text chunk; ITL = gaps between later chunks (one per delivery, like vLLM).
- loglikelihood_rolling: prompt log-probs through completions `echo=true, logprobs=1,
  max_tokens=0|1` (docs/reference.md §7); windows are cut from the server's own tokens (`/tokenize`)
  so a long document is scored exactly once per token, as on the reference engine.
- server_stats: a scrape of the server's Prometheus /metrics before and after each generate
  call (vLLM names): spec-decode counter deltas → acceptance rate; KV-cache usage and queue
  depth sampled while requests are in flight.
- per-request acceptance: where the server reports each request's own speculative-decoding
  figures (vLLM's `--per-request-spec-decode-metrics summary|detailed`: `metrics.
  speculative_decoding` at the top of the response, in the final usage chunk of a stream;
  `canary engine-serve` does the same), each generation carries them, and no other traffic on
  the server can move them (spec_from_response).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import cast

import httpx

from engines.device import EngineLoadError
from engines.endpoint import error_message, origin, redact_url
from engines.protocol import (
    EngineDescription,
    GenerationRequest,
    GenerationResult,
    RollingRequest,
    RollingResult,
    ServerStats,
    ServerTiming,
    SpeculativeStats,
    count_words,
    strided_windows,
)
from engines.server_metrics import metric_sum, parse_metrics, spec_delta, spec_from_response, timing_from_response
from engines.spec import OptimizationSpec


class EndpointError(EngineLoadError):
    """The endpoint is unreachable, not OpenAI-compatible, or lacks what a scorer needs. Its text
    quotes what the server said (model ids, error bodies): control characters in it are escaped
    (a newline as \\n), so a server cannot forge a line of the worker's log or of a config-run's error."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(escape_controls(str(message)), *args)


def escape_controls(text: str) -> str:
    """Control characters (newlines, carriage returns, escape sequences) as Python escapes; the rest unchanged."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


class NoTokenizer(EndpointError):
    """The server has no tokenizer endpoint (/tokenize, or llama-cpp-python's /extras/tokenize)."""


class NoDistributions(EndpointError):
    """The server cannot give next-token top-k (kld_mean): it takes text prompts only, names
    tokens by text, caps top log-probs below k, or refuses them (HTTP 400, 422). Not raised for a
    server error (5xx), a 429 or an unreachable server: those fail the pass as any other echo would."""


# the server's gauges (KV use, requests waiting and running) are read while a generate call's requests are in
# flight, first after 0.1 s, then twice as far apart up to every 2 s: a /metrics scrape costs the server it
# measures. Scraped every 0.1 s throughout, it put the canary's TTFT p50 45 % over `vllm bench serve`'s on
# vLLM's CPU build (39.7 against 27.4 ms, benchmarks/production_path.py); scraped every 5 s, −1.5 %
GAUGE_FIRST_S, GAUGE_MAX_S = 0.1, 2.0


class OpenAIEngine:
    """``transport`` / ``async_transport``: factories of the httpx transports every request goes
    through (the service passes ones that check each URL against its outbound policy and pin the
    checked address); ``secret``: how api_key_env is read (the service passes one that refuses
    variables off its allow-list). The defaults are plain httpx and os.environ, for library use.
    ``tokenizer``: a local model directory whose own tokenizer names the start token where the
    server names none (the service passes the config's model directory once it has checked it
    against the project's model root); default: the model itself when it is a builtin zoo model."""

    def __init__(self, model: str, spec: OptimizationSpec, *,
                 transport: Callable[[], httpx.BaseTransport] | None = None,
                 async_transport: Callable[[], httpx.AsyncBaseTransport] | None = None,
                 secret: Callable[[str], str | None] = os.environ.get, tokenizer: str | None = None):
        spec.check_available()
        self._transport, self._async_transport = transport, async_transport
        opts = spec.engine_options
        if "base_url" not in opts:
            raise EndpointError("engine_options.base_url: required for engine 'openai', e.g. http://vllm.internal:8000/v1")
        self.spec = spec
        self.model = str(spec.option("served_model") or model)
        self.base_url = str(opts["base_url"]).rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        self.shown = redact_url(self.base_url)  # errors end up in a config-run's reason, shown by the API
        self.metrics_url = str(spec.option("metrics_url") or self.root + "/metrics")
        self.concurrency = int(spec.option("concurrency"))
        self.timeout_s = float(spec.option("timeout_s"))
        key = secret(str(opts["api_key_env"])) if "api_key_env" in opts else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        # the key goes to the server's own origin only, never to a metrics_url elsewhere
        self.metrics_headers = self.headers if origin(self.metrics_url) == origin(self.base_url) else {}
        self._server_stats: ServerStats | None = None  # over the last generate call
        # llama-cpp-python's server takes text prompts only (set when its /extras/tokenize answers)
        self._text_prompts = False
        self._bos_id: int | None = None
        self._start: int | None = None  # the start token the canary prepends (_start_token)
        self._start_known = False
        self.tokenizer_dir = tokenizer or (model if model.startswith("builtin:") else None)
        self.notes: list[str] = []  # what describe() says beyond the fixed note (where the start token came from)
        self.max_model_len = self._check_model()

    # -- checks ------------------------------------------------------------------------------------
    def _client(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout_s, headers=self.headers, follow_redirects=False,
                            transport=self._transport() if self._transport else None)

    def _check_model(self) -> int | None:
        url = f"{self.base_url}/models"
        try:
            with self._client() as client:
                response = client.get(url)
        except httpx.HTTPError as e:
            raise EndpointError(f"engine_options.base_url: {redact_url(url)} is unreachable "
                                f"({type(e).__name__}: {str(e).replace(self.base_url, self.shown)})") from e
        try:
            served = {model["id"]: model for model in response.json()["data"]}
        except (ValueError, KeyError, TypeError) as e:
            raise EndpointError(f"engine_options.base_url: {redact_url(url)} answered HTTP {response.status_code} "
                                f"without an OpenAI model list; is this an OpenAI-compatible server "
                                f"(base_url usually ends in /v1)?") from e
        if self.model not in served:
            raise EndpointError(f"model: '{self.model}' is not served at {self.shown}; "
                                f"it serves: {', '.join(sorted(served)) or 'nothing'}")
        return served[self.model].get("max_model_len")

    # -- perplexity --------------------------------------------------------------------------------
    def loglikelihood_rolling(self, requests: Sequence[RollingRequest]) -> list[RollingResult]:
        return [result for result, _, _ in self._rolling(requests, None)]

    def next_token_topk(self, requests: Sequence[RollingRequest], k: int) -> list[tuple[RollingResult, list, list]]:
        """The rolling pass with each scored token's k most likely next tokens, as the server
        returns them (echo with `logprobs: k` and vLLM's `return_tokens_as_token_ids`): per
        document, its result and (ids [T][k], log-probs [T][k]), most likely first, row i the
        distribution token i was drawn from (evals/distribution.py doc_distribution_topk)."""
        return self._rolling(requests, k)

    def _rolling(self, requests: Sequence[RollingRequest], k: int | None) -> list[tuple[RollingResult, list, list]]:
        """Per document, its strided windows' prompt log-probs (echo) as a RollingResult; with k,
        also each scored token's top k (ids, log-probs), else two empty lists."""
        out = []
        with self._client() as client:
            for req in requests:
                seq = self._prompt_ids(client, req.text)  # [start] + the document's tokens
                ids = seq[1:]
                if not ids:
                    raise ValueError(f"document '{req.doc_id}' has no tokens")
                if k is not None and self._text_prompts:
                    raise NoDistributions(f"{self.shown}: next-token distributions need token-id prompts and "
                                        f"/tokenize (vLLM, engine-serve); drop perplexity.distribution_samples for "
                                        f"this config")
                logprobs: list[float] = []
                top_ids: list[list[int]] = []
                top_lps: list[list[float]] = []
                greedy: list[tuple[str, float] | None] = []  # the top-1 (its text, log p) at each scored token
                texts: list[str] = []
                for begin, end, n in strided_windows(len(ids), req.window):
                    # window seq[begin:end] predicts seq[begin+1 : end+1]; echo scores the tokens it is
                    # given, so send the window plus its last target: [None, lp(seq[begin+1]), …, lp(seq[end])]
                    token_lps, top, tokens = self._echo(client, seq[begin : end + 1], req.doc_id, k)
                    if k is not None:
                        for row in top[len(top) - n :]:
                            ranked = self._ranked(row, k, req.doc_id)
                            top_ids.append([i for i, _ in ranked])
                            top_lps.append([lp for _, lp in ranked])
                    else:
                        greedy += [max(row.items(), key=lambda kv: kv[1]) if row else None
                                   for row in top[len(top) - n :]]
                        texts += [str(t) for t in tokens[len(tokens) - n :]]
                    logprobs += cast("list[float]", token_lps[len(token_lps) - n :])  # the None is before the window
                if self._text_prompts:  # llama-cpp-python: no log-prob for the first token (_echo_text)
                    ids, logprobs, greedy, texts = ids[1:], logprobs[1:], greedy[1:], texts[1:]
                # the top-1 of each position: from the top k, or the server's top_logprobs (texts asked)
                best = [row[0] for row in top_lps] if k is not None else [g[1] for g in greedy if g is not None]
                known = len(best) == len(ids)  # a server that leaves out a position's top_logprobs gives none
                asked = req.texts and known and len(texts) == len(ids)
                out.append((RollingResult(req.doc_id, tuple(ids), tuple(logprobs), (), len(req.text.encode("utf-8")),
                                          count_words(req.text), greedy_logprobs=tuple(best) if known else (),
                                          token_texts=tuple(texts) if asked else (),
                                          greedy_texts=tuple(str(g[0]) for g in greedy if g is not None) if asked
                                          else ()), top_ids, top_lps))
        return out

    def _ranked(self, row: dict | None, k: int, doc_id: str) -> list[tuple[int, float]]:
        """One position's top_logprobs as (token id, log-prob), most likely first, k of them (vLLM
        adds the prompt's own token to the k)."""
        ranked = sorted(((self._token_id(key), lp) for key, lp in (row or {}).items()), key=lambda pair: -pair[1])[:k]
        if len(ranked) < k:
            raise NoDistributions(f"{self.shown}/completions returned {len(ranked)} of {k} top log-probs for document "
                                f"'{doc_id}'; the server caps them (vLLM: --max-logprobs)")
        return ranked

    def _token_id(self, key: str) -> int:
        if not key.startswith("token_id:"):
            raise NoDistributions(f"{self.shown}/completions named top log-prob tokens by text ({key!r}), not "
                                f"'token_id:<id>'; next-token distributions need a server that honours "
                                f"return_tokens_as_token_ids (vLLM, engine-serve)")
        return int(key.removeprefix("token_id:"))

    def _prompt_ids(self, client: httpx.Client, text: str) -> list[int]:
        """A prompt's token ids as the in-process engines make them: the start token, then the text's
        tokens. The server's tokenizer makes them; where it adds no start token of its own (vLLM
        with a tokenizer that adds none, as for Qwen or GPT-2-style models), the canary prepends
        the model's (`_start_token`)."""
        start = self._start_token(client)
        if start is None:
            return self._tokenize(client, text)
        return [start, *self._tokenize(client, text, special=False)]

    def _start_token(self, client: httpx.Client) -> int | None:
        """None where the server's tokenizer adds the start token itself (found once, on a probe);
        else the id to prepend: engine_options.start_token_id, or the BOS (else EOS) token the
        server names on /tokenizer_info, or the one the model's own tokenizer names (tokenizer_dir)
        when the server names none and reads that token as the same id. An EndpointError naming the
        option when none of them says."""
        if self._start_known:
            return self._start
        special = self._tokenize(client, "a")
        if self._text_prompts or len(special) > len(self._tokenize(client, "a", special=False)):
            self._start = None  # llama-cpp-python's /extras/tokenize includes its BOS
        elif self.spec.option("start_token_id") is not None:
            self._start = int(self.spec.option("start_token_id"))
        else:
            self._start = self._start_from_tokenizer_info(client)
        self._start_known = True
        return self._start

    def _start_from_tokenizer_info(self, client: httpx.Client) -> int:
        response = client.get(f"{self.root}/tokenizer_info")
        info = response.json() if response.status_code == 200 else {}
        for key in ("bos_token", "eos_token"):
            token = info.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and token:
                ids = self._tokenize(client, token, special=False)
                if len(ids) == 1:
                    return ids[0]
        own = self._start_from_own_tokenizer(client)
        if own is not None:
            return own
        raise EndpointError(f"engine_options.start_token_id: {self.shown}'s tokenizer adds no start token to a prompt "
                            f"and {redact_url(self.root)}/tokenizer_info does not name one (vLLM serves it with "
                            f"--enable-tokenizer-info-endpoint), nor is the config's model a local directory whose "
                            f"tokenizer could; set start_token_id to the id of the model's BOS token (its EOS where it "
                            f"has none), which the in-process engines prepend")

    def _start_from_own_tokenizer(self, client: httpx.Client) -> int | None:
        """The BOS (else EOS) token of the config's model's own tokenizer (tokenizer_dir), where the
        server reads that token's text as the same single id; None where there is no local tokenizer.
        A server that reads it otherwise serves another tokenizer: an EndpointError says so."""
        if self.tokenizer_dir is None:
            return None
        from transformers import AutoTokenizer

        from engines.zoo import ModelPathError, resolve_model_path

        try:
            tok = AutoTokenizer.from_pretrained(str(resolve_model_path(self.tokenizer_dir)), local_files_only=True)
        except (ModelPathError, OSError, ValueError):
            return None
        for token, token_id in ((tok.bos_token, tok.bos_token_id), (tok.eos_token, tok.eos_token_id)):
            if not token or token_id is None:
                continue
            served = self._tokenize(client, str(token), special=False)
            if served != [int(token_id)]:
                raise EndpointError(f"engine_options.start_token_id: the model's own tokenizer starts prompts with "
                                    f"{str(token)!r} (id {token_id}), which {self.shown} reads as {served}: does it "
                                    f"serve this model's tokenizer? Set start_token_id to the id its prompts start "
                                    f"with")
            self.notes.append(f"start token {token_id} ({str(token)!r}) from the model's own tokenizer: "
                              f"{redact_url(self.root)}/tokenizer_info names none (engine_options.start_token_id "
                              f"overrides)")
            return int(token_id)
        return None

    def _tokenize(self, client: httpx.Client, text: str, special: bool = True) -> list[int]:
        response = client.post(f"{self.root}/tokenize",
                               json={"model": self.model, "prompt": text, "add_special_tokens": special})
        if response.status_code == 404:  # llama-cpp-python's server: /extras/tokenize, BOS included
            response = client.post(f"{self.root}/extras/tokenize", json={"model": self.model, "input": text})
            if response.status_code == 200:
                self._text_prompts = True
        if response.status_code == 404:
            raise NoTokenizer(f"{redact_url(self.root)}/tokenize is missing: perplexity over an "
                              f"OpenAI-compatible server needs the server's tokenizer "
                              f"(vLLM and engine-serve expose /tokenize, llama-cpp-python /extras/tokenize)")
        if response.is_error:
            raise EndpointError(f"{redact_url(self.root)}/tokenize: HTTP {response.status_code}: "
                                f"{error_message(response)}")
        return list(response.json()["tokens"])

    def _echo(self, client: httpx.Client, prompt_ids: list[int], doc_id: str, top_k: int | None = None
              ) -> tuple[list[float | None], list[dict | None], list[str]]:
        """(the prompt's log-probs [None, lp(token 1), …], each position's top alternatives (its
        top_logprobs: the top_k most likely keyed "token_id:<id>", else the most likely keyed by
        its text; None first), each token's text (empty where the server names none))."""
        if self._text_prompts:
            return self._echo_text(client, prompt_ids, doc_id)
        body = {"model": self.model, "prompt": prompt_ids, "echo": True, "logprobs": top_k or 1, "max_tokens": 0,
                "temperature": 0,
                # tokens by text for a plain echo, whatever the server's default (vLLM --return-tokens-as-token-ids)
                "return_tokens_as_token_ids": bool(top_k)}
        response = client.post(f"{self.base_url}/completions", json=body)
        if response.status_code == 400 and "max_tokens" in response.text:  # servers that need at least one new token
            response = client.post(f"{self.base_url}/completions", json={**body, "max_tokens": 1})
        if top_k and response.status_code in (400, 422):  # a refusal, e.g. vLLM past its --max-logprobs
            raise NoDistributions(f"{self.shown}/completions refused {top_k} prompt top log-probs for document "
                                  f"'{doc_id}' (HTTP {response.status_code}: {error_message(response)})")
        if response.status_code >= 400:
            raise EndpointError(f"{self.shown}/completions refused prompt log-probs for document '{doc_id}' "
                                f"(HTTP {response.status_code}: {error_message(response)}); perplexity needs a server "
                                f"that returns them with echo=true (vLLM does), or drop perplexity from this "
                                f"config's scorers")
        lps = response.json()["choices"][0].get("logprobs") or {}
        token_lps = lps.get("token_logprobs")
        if not token_lps or len(token_lps) < len(prompt_ids):
            raise EndpointError(f"{self.shown}/completions returned no prompt log-probs for document '{doc_id}'; "
                                f"perplexity needs echo=true support")
        top = lps.get("top_logprobs") or []
        if top_k and len(top) < len(prompt_ids):
            raise NoDistributions(f"{self.shown}/completions returned no prompt top_logprobs for document "
                                f"'{doc_id}'; next-token distributions need them with echo=true (vLLM does)")
        n = len(prompt_ids)
        return token_lps[:n], top[:n], [str(t) for t in (lps.get("tokens") or [])[:n]]

    def _echo_text(self, client: httpx.Client, prompt_ids: list[int], doc_id: str
                   ) -> tuple[list[float | None], list[dict | None], list[str]]:
        """Prompt log-probs from a server that takes text prompts only (llama-cpp-python): the
        window is detokenized and sent as text, which the server tokenizes again after its BOS.
        That is exact only for a window that starts at the document's BOS (a later window would be
        read after a BOS it does not have), so a document must fit one window. The server also
        nulls the first prompt token's log-prob (as OpenAI's legacy API does), so a document is
        scored from its second token on: compare such a config with a baseline served the same
        way (an F32 or F16 GGUF file on the same kind of server), whose documents lose the same
        token."""
        if prompt_ids[0] != self._bos(client):
            raise EndpointError(f"document '{doc_id}' spans several perplexity windows, but {self.shown} takes text "
                                f"prompts only (llama-cpp-python), which cannot score a window that does not start "
                                f"at the document's start; raise the suite's perplexity.window to cover its documents")
        text = self._detokenize(client, prompt_ids[1:])
        lps = self._completion_logprobs(client, text, doc_id)
        token_lps = lps.get("token_logprobs") or []
        n = len(prompt_ids) - 1
        if len(token_lps) < n or any(x is None for x in token_lps[1:n]):
            raise EndpointError(f"{self.shown}/completions returned {len(token_lps)} prompt log-probs for document "
                                f"'{doc_id}' where its {n} tokens were sent; the server's tokenizer does not read "
                                f"back the text it wrote")
        # the first token's log-prob is not given: dropped by the caller
        top, tokens = lps.get("top_logprobs") or [], [str(t) for t in lps.get("tokens") or []]
        return ([None, None, *token_lps[1:n]], [None, None, *top[1:n]] if len(top) >= n else [],
                ["", "", *tokens[1:n]] if len(tokens) >= n else [])

    def _bos(self, client: httpx.Client) -> int:
        if self._bos_id is None:
            self._bos_id = self._tokenize(client, "")[0]
        return self._bos_id

    def _detokenize(self, client: httpx.Client, ids: list[int]) -> str:
        response = client.post(f"{self.root}/extras/detokenize", json={"model": self.model, "tokens": ids})
        if response.is_error:
            raise EndpointError(f"{redact_url(self.root)}/extras/detokenize: HTTP {response.status_code}: "
                                f"{error_message(response)}")
        return str(response.json()["text"])

    def _completion_logprobs(self, client: httpx.Client, prompt: str, doc_id: str) -> dict:
        # max_tokens 1: llama-cpp-python reads 0 as "until the context is full"
        body = {"model": self.model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        response = client.post(f"{self.base_url}/completions", json=body)
        if response.status_code >= 400:
            raise EndpointError(f"{self.shown}/completions refused prompt log-probs for document '{doc_id}' "
                                f"(HTTP {response.status_code}: {error_message(response)})")
        return response.json()["choices"][0].get("logprobs") or {}

    # -- generation --------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Streams each request. A text prompt goes as the token ids `_prompt_ids` makes (the start
        token included, as in-process engines begin it) where the server takes ids; a server that
        takes text only (llama-cpp-python) gets the text, after the BOS it adds itself."""
        requests = list(requests)
        if any(req.prompt_ids is None for req in requests):
            with self._client() as client:
                try:
                    start = self._start_token(client)
                except NoTokenizer:  # a server without /tokenize (a hosted API): its own reading of the text
                    start = None
                if start is not None:  # None also for a server that takes text only (_start_token)
                    requests = [req if req.prompt_ids is not None else
                                dataclasses.replace(req, prompt_ids=tuple(self._prompt_ids(client, req.prompt)))
                                for req in requests]
        return asyncio.run(self._generate_all(requests))

    async def _generate_all(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False,
                                     transport=self._async_transport() if self._async_transport else None) as client:
            before = await self._scrape(client)
            sampled: dict[str, list[float]] = {"kv_cache_usage_perc": [], "num_requests_waiting": [],
                                               "num_requests_running": []}
            done = asyncio.Event()

            gauges = tuple(f"vllm:{k}" for k in sampled)

            async def sample() -> None:
                # gauges while requests are in flight (only theirs parsed: the loop reads streams)
                interval = GAUGE_FIRST_S
                while not done.is_set():
                    snap = await self._scrape(client, gauges)
                    for k in sampled:
                        v = metric_sum(snap, f"vllm:{k}")
                        if v is not None:
                            sampled[k].append(v)
                    try:
                        await asyncio.wait_for(done.wait(), interval)
                    except TimeoutError:
                        pass
                    interval = min(2 * interval, GAUGE_MAX_S)

            sampler = asyncio.create_task(sample()) if before else None
            sem = asyncio.Semaphore(self.concurrency)

            async def one(req: GenerationRequest) -> GenerationResult:
                async with sem:
                    return await self._stream(client, req)

            try:
                results = await asyncio.gather(*(one(request) for request in requests))
            finally:
                done.set()
                if sampler:
                    await sampler
            after = await self._scrape(client)
        peak = {name: (max(values) if values else None) for name, values in sampled.items()}
        self._server_stats = ServerStats(metrics_url=redact_url(self.metrics_url) if before else None,
                                         spec=spec_delta(before, after) if before else None,
                                         max_kv_cache_usage=peak["kv_cache_usage_perc"],
                                         max_num_requests_waiting=peak["num_requests_waiting"],
                                         max_num_requests_running=peak["num_requests_running"])
        return results

    def server_stats(self) -> ServerStats | None:
        return self._server_stats

    def reset_peaks(self) -> None:
        """Nothing to reset: the server's gauges are sampled per generate call."""

    async def _scrape(self, client: httpx.AsyncClient, only: tuple[str, ...] | None = None) -> dict:
        try:
            response = await client.get(self.metrics_url, headers=self.metrics_headers)
            return parse_metrics(response.text, only) if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    async def _stream(self, client: httpx.AsyncClient, req: GenerationRequest) -> GenerationResult:
        prompt = list(req.prompt_ids) if req.prompt_ids is not None else req.prompt
        body = {"model": self.model, "prompt": prompt, "max_tokens": req.max_new_tokens,
                "temperature": req.temperature, "seed": req.seed, "stream": True,
                **({"top_p": req.top_p} if req.top_p < 1 else {}), **({"top_k": req.top_k} if req.top_k > 0 else {}),
                **({"presence_penalty": req.presence_penalty} if req.presence_penalty else {}),
                **({"frequency_penalty": req.frequency_penalty} if req.frequency_penalty else {}),
                **({"logit_bias": {str(t): b for t, b in req.logit_bias}} if req.logit_bias else {}),
                "stream_options": {"include_usage": True}}
        text: list[str] = []
        stamps: list[float] = []
        usage: dict = {}
        spec: SpeculativeStats | None = None
        timing: ServerTiming | None = None
        finish: str | None = None
        t0 = time.perf_counter()
        async with client.stream("POST", f"{self.base_url}/completions", json=body, headers=self.headers) as response:
            if response.status_code >= 400:
                await response.aread()
                raise EndpointError(f"{self.shown}/completions: HTTP {response.status_code} "
                                    f"for request '{req.request_id}': {error_message(response)}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise EndpointError(f"{self.shown}/completions: stream error for '{req.request_id}': "
                                        f"{chunk['error']}")
                usage = chunk.get("usage") or usage
                spec = spec_from_response(chunk) or spec
                timing = timing_from_response(chunk) or timing
                finish = next((ch["finish_reason"] for ch in chunk.get("choices") or [] if ch.get("finish_reason")),
                              finish)
                piece = "".join(ch.get("text") or "" for ch in chunk.get("choices") or [])
                if piece:
                    text.append(piece)
                    stamps.append(time.perf_counter())
        if not stamps:
            stamps = [time.perf_counter()]
        n_out = int(usage.get("completion_tokens") or len(text))
        return GenerationResult(
            request_id=req.request_id,
            text="".join(text),
            token_ids=(),  # the server's token ids are not streamed; completion_tokens counts them
            completion_tokens=n_out,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            ttft_ms=(stamps[0] - t0) * 1000,
            itl_ms=tuple((b - a) * 1000 for a, b in pairwise(stamps)),
            total_ms=(stamps[-1] - t0) * 1000,
            spec=spec,
            finish_reason=finish,
            server_timing=timing,
        )

    def describe(self) -> EngineDescription:
        spec = self.spec
        return EngineDescription(
            engine="openai", model=self.model, weights=spec.weights, kv_cache=spec.kv_cache,
            speculative=spec.speculative.method,
            device=self.base_url, compute_dtype="server", parameters=0, weight_bytes=0, kv_bytes_per_token=0,
            versions={"httpx": httpx.__version__},
            notes=("figures measured over HTTP; memory is the server's (see its /metrics)", *self.notes),
        )
