"""The engine behind the routes: requests are queued and decoded one at a time by a single engine
thread (the reference engine is not thread-safe); each request's tokens go back to its route's
event loop as events: ("tokens", ids), ("done", GenerationResult), ("scored", (logprobs, greedy)),
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
    def __init__(self, engine, model_name: str, prompt_logprobs: bool = True):
        self.engine = engine
        self.model_name = model_name
        self.prompt_logprobs = prompt_logprobs
        self.metrics = ServeMetrics(model_name)
        self.max_model_len = engine.args.max_seq_len  # tokens of context
        self.vocab_size = engine.args.vocab_size
        spec = getattr(engine, "spec", None)  # the engine's OptimizationSpec
        # speculative decoding holds k draft tokens (+1) past the answer in the cache
        self.speculative_extra_tokens = (spec.speculative.k + 1 if spec is not None
                                         and getattr(spec.speculative, "method", "off") != "off" else 0)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine")
        self.thread.start()

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        metrics, name = self.metrics, self.model_name
        while True:
            job = self.jobs.get()
            metrics.waiting.labels(name).dec()
            metrics.running.labels(name).inc()
            try:
                if job.prompt_ids is not None:
                    scores = self.engine.prompt_logprobs(job.prompt_ids, job.top_k)
                    metrics.prompt_tokens.labels(name).inc(len(job.prompt_ids))  # echo requests count too
                    metrics.e2e.labels(name).observe(time.perf_counter() - job.arrived)
                    self._emit(job, ("scored", scores))
                else:
                    self._generate(job)
            except ValueError as e:  # the engine refuses this input (e.g. over the context): the client's error, a 400
                self._emit(job, ("invalid", str(e)))
            except Exception as e:  # noqa: BLE001 — the request fails, the server stays up
                self._emit(job, ("error", str(e)))
            finally:
                metrics.running.labels(name).dec()
                metrics.kv_usage.labels(name).set(0)

    def _generate(self, job: Job) -> None:
        metrics, name = self.metrics, self.model_name
        n_prompt = self.n_prompt_tokens(job.request.prompt)
        metrics.prompt_tokens.labels(name).inc(n_prompt)
        held = [n_prompt]  # tokens in the KV cache

        def on_tokens(request_id, tokens, spec_decode):
            now = time.perf_counter()
            if not job.stamps:
                metrics.ttft.labels(name).observe(now - job.arrived)
            else:
                metrics.itl.labels(name).observe(now - job.stamps[-1])
            job.stamps.append(now)
            held[0] += len(tokens)
            metrics.kv_usage.labels(name).set(min(1.0, held[0] / self.max_model_len))
            metrics.generation_tokens.labels(name).inc(len(tokens))
            if spec_decode is not None:
                metrics.drafts.labels(name).inc(spec_decode.num_drafts)
                metrics.draft_tokens.labels(name).inc(spec_decode.num_draft_tokens)
                metrics.accepted.labels(name).inc(spec_decode.num_accepted_tokens)
                for pos, accepted in enumerate(spec_decode.accepted_per_position):
                    metrics.accepted_pos.labels(name, str(pos)).inc(accepted)
            self._emit(job, ("tokens", tokens))

        result = self.engine.generate([job.request], on_tokens=on_tokens)[0]
        metrics.e2e.labels(name).observe(time.perf_counter() - job.arrived)
        self._emit(job, ("done", result))

    @staticmethod
    def _emit(job: Job, event) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def submit(self, request: GenerationRequest | None, prompt_ids: list[int] | None = None, top_k: int = 0) -> Job:
        job = Job(request or GenerationRequest("echo", ""), asyncio.get_running_loop(), asyncio.Queue(),
                  time.perf_counter(), prompt_ids, top_k)
        self.metrics.waiting.labels(self.model_name).inc()
        self.jobs.put(job)
        return job

    # -- helpers for the routes -------------------------------------------------------------------------
    def n_prompt_tokens(self, prompt: str) -> int:
        """Tokens of a text prompt in the cache: its tokens and the start token."""
        return len(self.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 1

    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.engine.tokenizer.decode([i]) for i in ids]
