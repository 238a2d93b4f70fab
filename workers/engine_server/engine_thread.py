"""The engine behind the routes: requests are queued and decoded one at a time by a single engine
thread (the reference engine is not thread-safe); each request's tokens go back to its route's
event loop as events: ("tokens", ids), ("done", GenerationResult), ("scored", PromptScores),
("invalid", message) for input the engine refuses, ("error", message) for anything else."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from engines.protocol import GenerationRequest
from workers.engine_server.metrics import ServeMetrics


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float
    prompt_ids: list[int] | None = None  # echo: score these instead of generating
    top_k: int = 0  # echo: alternatives per position (OpenAI's logprobs)
    stamps: list[float] = field(default_factory=list)


class EngineServer:
    def __init__(self, engine, model_name: str, prompt_logprobs: bool = True, per_request_spec_metrics: bool = False):
        self.engine = engine
        self.model_name = model_name
        self.prompt_logprobs = prompt_logprobs
        # vLLM's --per-request-spec-decode-metrics summary: each response carries its request's own
        # speculative-decoding figures (routes.spec_decode_metrics)
        self.per_request_spec_metrics = per_request_spec_metrics
        self.max_model_len = engine.args.max_seq_len  # tokens of context
        self.vocab_size = engine.args.vocab_size
        spec = getattr(engine, "spec", None)  # the engine's OptimizationSpec
        self.metrics = ServeMetrics(model_name, self.max_model_len, spec.kv_cache if spec is not None else "auto")
        # speculative decoding holds k draft tokens (+1) past the answer in the cache
        self.speculative_extra_tokens = (spec.speculative.k + 1 if spec is not None
                                         and getattr(spec.speculative, "method", "off") != "off" else 0)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine")
        self.thread.start()

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        metrics = self.metrics
        while True:
            job = self.jobs.get()
            started = time.perf_counter()
            metrics.waiting.dec()
            metrics.running.inc()
            metrics.queue_time.observe(started - job.arrived)
            try:
                if job.prompt_ids is not None:
                    scores = self.engine.prompt_logprobs(job.prompt_ids, job.top_k)
                    n = len(job.prompt_ids)  # echo requests count too: a prefill of the prompt
                    metrics.prompt_tokens.inc(n)
                    metrics.iteration_tokens.observe(n)
                    self._finished(job, started, started_decode=time.perf_counter(), n_prompt=n, n_generated=0,
                                   reason="length")
                    self._emit(job, ("scored", scores))
                else:
                    self._generate(job, started)
            except ValueError as e:  # the engine refuses this input (e.g. over the context): the client's error, a 400
                self._emit(job, ("invalid", str(e)))
            except Exception as e:  # noqa: BLE001 — the request fails, the server stays up
                self._emit(job, ("error", str(e)))
            finally:
                metrics.running.dec()
                metrics.kv_usage.set(0)

    def _generate(self, job: Job, started: float) -> None:
        metrics = self.metrics
        n_prompt = self.n_prompt_tokens(job.request.prompt, job.request.prompt_ids)
        metrics.prompt_tokens.inc(n_prompt)
        metrics.params_max_tokens.observe(job.request.max_new_tokens)
        metrics.max_generation_tokens.observe(job.request.max_new_tokens)
        held = [n_prompt]  # tokens in the KV cache

        def on_tokens(request_id, tokens, spec_decode):
            now = time.perf_counter()
            if not job.stamps:
                metrics.ttft.observe(now - job.arrived)
                metrics.iteration_tokens.observe(n_prompt + len(tokens))  # the prefill step
            else:
                metrics.itl.observe(now - job.stamps[-1])
                metrics.tpot.observe((now - job.stamps[-1]) / max(1, len(tokens)))
                metrics.iteration_tokens.observe(len(tokens))
            job.stamps.append(now)
            held[0] += len(tokens)
            metrics.kv_usage.set(min(1.0, held[0] / self.max_model_len))
            metrics.generation_tokens.inc(len(tokens))
            if spec_decode is not None:
                metrics.drafts.inc(spec_decode.num_drafts)
                metrics.draft_tokens.inc(spec_decode.num_draft_tokens)
                metrics.accepted.inc(spec_decode.num_accepted_tokens)
                for pos, accepted in enumerate(spec_decode.accepted_per_position):
                    metrics.accepted_at(pos).inc(accepted)
            self._emit(job, ("tokens", tokens))

        result = self.engine.generate([job.request], on_tokens=on_tokens)[0]
        eos = self.engine.tokenizer.eos_token_id
        reason = "stop" if result.token_ids and result.token_ids[-1] == eos else "length"
        self._finished(job, started, job.stamps[0] if job.stamps else time.perf_counter(), n_prompt,
                       len(result.token_ids), reason)
        self._emit(job, ("done", result))

    def _finished(self, job: Job, started: float, started_decode: float, n_prompt: int, n_generated: int,
                  reason: str) -> None:
        """A request's phases as vLLM splits them: queued (arrival → the engine takes it), prefill
        (→ first token), decode (→ done), inference (prefill + decode), end to end."""
        metrics, now = self.metrics, time.perf_counter()
        metrics.request_success[reason].inc()
        metrics.request_prompt_tokens.observe(n_prompt)
        metrics.request_generation_tokens.observe(n_generated)
        metrics.prefill_time.observe(started_decode - started)
        metrics.prefill_per_token.observe((started_decode - started) / max(1, n_prompt))
        metrics.decode_time.observe(now - started_decode)
        metrics.inference_time.observe(now - started)
        metrics.e2e.observe(now - job.arrived)

    @staticmethod
    def _emit(job: Job, event) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def submit(self, request: GenerationRequest | None, prompt_ids: list[int] | None = None, top_k: int = 0) -> Job:
        job = Job(request or GenerationRequest("echo", ""), asyncio.get_running_loop(), asyncio.Queue(),
                  time.perf_counter(), prompt_ids, top_k)
        self.metrics.waiting.inc()
        self.jobs.put(job)
        return job

    # -- helpers for the routes -------------------------------------------------------------------------
    def n_prompt_tokens(self, prompt: str, ids: tuple[int, ...] | None = None) -> int:
        """Tokens of a prompt in the cache: a text's tokens and the start token, or the ids as given."""
        if ids is not None:
            return len(ids)
        return len(self.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 1

    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.engine.tokenizer.decode([i]) for i in ids]
