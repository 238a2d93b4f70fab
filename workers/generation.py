"""The generation side of a config-run: the baseline model that scores every config's outputs
teacher-forced (gen_nll_ratio, the divergence tests), how many requests go in flight at once,
and the paired timings of the baseline's pass."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

from engines.protocol import Engine, GenerationResult, RollingRequest, RollingResult, WindowSpec
from engines.spec import OptimizationSpec
from evals.health import Scored, greedy_reading
from evals.records import GenerationRecord
from vocabulary.suite import GenerationSettings
from workers import engine_cache
from workers.job import Job, loadable_model, served_model_tokenizer

log = logging.getLogger(__name__)
SERVING_ENGINES = ("openai", "vllm")  # engines that take many requests at once, as a server does


class BaselineScorer:
    """The run's baseline model scoring generated text teacher-forced (gen_nll_ratio): the NLL of
    an output is that of prompt + output minus that of the prompt alone, both by the engine's
    rolling log-likelihood (echo log-probs over HTTP), so it needs no new engine method. An
    engine that cannot score text (a server without prompt log-probs) scores nothing, once, and
    the run says so instead of failing the config-run."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.error: str | None = None
        self._read: dict[str, RollingResult] = {}  # text → its rolling result: each prompt, and each output, read once

    def score(self, generations: Sequence[GenerationResult], prompts: dict[str, str],
              window: WindowSpec) -> list[tuple]:
        """Per generation, in order: (Σ NLL of its tokens, how many, Scored: the tokens and each one's
        log-prob), all None where it could not be scored; an empty answer is (None, None, Scored of
        nothing): no NLL to average, but a divergence at its first token all the same."""
        unscored: list[tuple] = [(None, None, None)] * len(generations)
        if self.error is not None:
            return unscored
        texts = [(prompts[g.request_id] + g.text, prompts[g.request_id]) for g in generations]
        # a text read before (the same prompt; an output equal to one already scored: a lossless
        # config's, the baseline's second pass) is not read again
        todo = list(dict.fromkeys(t for pair in texts for t in pair if t not in self._read))
        try:
            requests = [RollingRequest(str(i), t, window, texts=True) for i, t in enumerate(todo)]
            results = self.engine.loglikelihood_rolling(requests) if requests else []
        except Exception as e:  # noqa: BLE001 - the generations stand; only this figure is missing
            self.error = f"{type(e).__name__}: {e}"
            log.warning("the baseline engine cannot score generated text, no gen_nll_ratio: %s", self.error)
            return unscored
        by_id = {result.doc_id: result for result in results}
        self._read.update({t: by_id[str(i)] for i, t in enumerate(todo)})
        out = []
        for full_text, prompt_text in texts:
            full, prompt = self._read[full_text], self._read[prompt_text]
            start = len(prompt.token_ids)
            read = Scored(tuple(full.token_ids[start:]), tuple(full.logprobs[start:]),
                          *_leaves(full, prompt, window))
            n = len(read.ids)
            out.append((full.nll - prompt.nll, n, read) if n > 0 else (None, None, read))
        return out


def _leaves(full: RollingResult, prompt: RollingResult, window: WindowSpec
            ) -> tuple[tuple[tuple[int, float], ...], bool, int | None]:
    """(where the output after the prompt leaves the baseline model's greedy path, whether the
    engine gave what that takes: each token's text and the top token's, with its log p, and the
    first token read back in other tokens than generated: evals.health.greedy_reading). Not
    known where the prompt's tokens are not the first of the whole text's (the answer's first
    token merged with the prompt's last) or a server named tokens by id; read only up to the end
    of the first window, past which a token is read with less context than it was generated with."""
    n, start = len(full.token_ids), len(prompt.token_ids)
    if not (len(full.token_texts) == len(full.greedy_texts) == len(full.greedy_logprobs) == n):
        return (), False, None
    if tuple(full.token_ids[:start]) != tuple(prompt.token_ids) or any(
            t.startswith("token_id:") for t in full.greedy_texts):
        return (), False, None
    end = max(start, min(n, window.max_length))
    leaves, read_back = greedy_reading(full.token_texts[start:end], full.logprobs[start:end],
                                       full.greedy_texts[start:end], full.greedy_logprobs[start:end])
    return leaves, True, read_back


def scored_rows(kind: type[GenerationRecord], generations: Sequence[GenerationResult], judge: BaselineScorer,
                prompts: dict[str, str], window: WindowSpec, keep_ids: bool) -> list[dict]:
    """Rows of a pass beside the main one (the baseline's second pass, the prompts sent alone),
    each output read by the baseline model as the main pass's are."""
    return [replace(kind.from_result(generation, prompts[generation.request_id], keep_ids), baseline_nll=nll,
                    baseline_nll_tokens=n, scored=read).to_row()
            for generation, (nll, n, read) in zip(generations, judge.score(generations, prompts, window), strict=True)]


def concurrency(engine: Engine, spec: OptimizationSpec, generation: GenerationSettings,
                judge: BaselineScorer | None) -> int:
    """Generation requests in flight at once: engine_options.concurrency where the config sets it;
    else, for an engine that serves requests in parallel (a server: openai, vllm), the suite's
    generation.concurrency, as production traffic has them, given to the baseline's serving engine
    too so that its paired pass runs at the same concurrency; else 1 (the in-process reference
    engine decodes its engine_options.concurrency rows together, 1 by default)."""
    if "concurrency" in spec.engine_options:
        return max(1, int(spec.engine_options["concurrency"]))
    if spec.engine not in SERVING_ENGINES:
        return 1
    step = max(1, generation.concurrency)
    for serving in (engine, judge.engine if judge is not None else None):
        spec_of = getattr(serving, "spec", None)
        if (serving is not None and spec_of is not None and spec_of.engine in SERVING_ENGINES
                and "concurrency" not in spec_of.engine_options and hasattr(serving, "concurrency")):
            serving.concurrency = step
    return step


def timings(generations: Iterable[GenerationResult]) -> dict[str, tuple[float, float | None]]:
    """(TTFT, time per output token after the first) of each request, in ms."""
    return {g.request_id: (g.ttft_ms, sum(g.itl_ms) / len(g.itl_ms) if g.itl_ms else None) for g in generations}


def baseline_scorer(engine: Engine, job: Job) -> BaselineScorer:
    """The engine's own for the baseline config; else the baseline config's engine (cached beside
    this one: a second model in memory while the run's configs execute)."""
    baseline: OptimizationSpec = job.baseline_spec
    if baseline == job.spec:
        return BaselineScorer(engine)
    if baseline.engine == "openai":
        from workers.outbound import check_engine

        check_engine(baseline, job.project)
        return BaselineScorer(engine_cache.get_engine(job.model_path, baseline, tokenizer=served_model_tokenizer(job)))
    path, baseline = loadable_model(job, baseline)  # the baseline's own model (or checkpoint), not the job's
    return BaselineScorer(engine_cache.get_engine(str(path), baseline))
