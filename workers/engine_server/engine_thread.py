"""The engine behind the routes: one engine thread (the reference engine is not thread-safe) owns
the model. Each request's tokens go back to its route's event loop as events: ("tokens", ids),
("done", GenerationResult), ("scored", PromptScores), ("invalid", message) for input the engine
refuses, ("error", message) for anything else.

Continuous batching (engines/reference/batching.py), as vLLM schedules: generation requests wait
in a bounded queue (`max_queue` sequences, whichever requests they came in; a request that does
not fit is refused whole with ServeQueueFull, a 429), join the running batch between decode steps
while it has a free row (`max_num_seqs`; a request of many prompts takes turns with later ones,
_take_fairly, where vLLM serves first come first served). Over the lossless cache their prompts
are prefilled in the next step's forward, beside the running rows' next tokens (batching.join);
a prompt whose step fails fails alone (batching.PrefillFailed), the running rows go on. Elsewhere
(a lossy or speculative cache) a prompt is prefilled as it joins, then takes part in the next
batched step. Rows leave the batch when they finish or their client goes (ServeRequest.cancel).
Echo jobs (prompt log-probs) run between decode steps. With speculative decoding a step verifies
every row's drafts in one pass and a row may gain several tokens at once, as in vLLM. An engine
that cannot batch (a fault drill: batching.unbatchable) decodes one request at a time with
engine.generate, as before."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engines.protocol import GenerationRequest, SpeculativeStats
from engines.reference.batching import ContinuousBatch, PrefillFailed, unbatchable
from workers.engine_server.jobs import (
    SHUTTING_DOWN,
    Cancelled,
    Running,
    ServeQueueFull,
    ServeRequest,
    ShuttingDown,
)
from workers.engine_server.metrics import ServeMetrics


class EngineServer:
    # engine: the reference engine as load_engine gives it, read beyond engines.protocol.Engine (args, tokenizer, …)
    def __init__(self, engine: Any, model_name: str, prompt_logprobs: bool = True,
                 per_request_spec_metrics: bool = False, max_num_seqs: int = 32, max_queue: int = 256,
                 per_request_metrics: bool = False, max_logprob_entries: int = 1 << 18) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prompt_logprobs = prompt_logprobs
        # vLLM's --per-request-spec-decode-metrics summary: each response carries its request's own
        # speculative-decoding figures (answers.spec_decode_metrics)
        self.per_request_spec_metrics = per_request_spec_metrics
        # vLLM's --enable-per-request-metrics: each response carries its request's own timings
        # (answers.timing_metrics: TTFT from scheduling, queue wait, mean inter-token latency)
        self.per_request_metrics = per_request_metrics
        self.max_model_len = engine.args.max_seq_len  # tokens of context
        self.vocab_size = engine.args.vocab_size
        spec = getattr(engine, "spec", None)  # the engine's OptimizationSpec
        self.metrics = ServeMetrics(model_name, self.max_model_len, spec.kv_cache if spec is not None else "auto")
        # speculative decoding holds k draft tokens (+1) past the answer in the cache
        self.speculative_extra_tokens = (spec.speculative.k + 1 if spec is not None
                                         and getattr(spec.speculative, "method", "off") != "off" else 0)
        self.why_serial = unbatchable(engine)  # None: continuous batching
        self.max_num_seqs = max_num_seqs if self.why_serial is None else 1
        self.max_queue = max_queue  # sequences (prompts × n) waiting, whichever requests they came in
        # log-probs one response may carry (tokens × (1 + alternatives)): a bound on its size
        self.max_logprob_entries = max_logprob_entries
        self.batch = ContinuousBatch(engine, max_num_seqs) if self.why_serial is None else None
        self.rows: dict[int, Running] = {}  # batch row → its job (engine thread only)
        self._lock = threading.Condition()  # guards the two queues
        self._waiting: deque[ServeRequest] = deque()  # generation jobs not started yet
        self._groups = itertools.count(1)  # a request's number (ServeRequest.group)
        self._served: dict[int, int] = {}  # request → its sequences started, while some still wait
        self._scoring: deque[ServeRequest] = deque()  # echo jobs
        # set by request_stop (a signal handler: plain assignments, no lock taken there): the server
        # takes no new request, finishes those it holds, and fails what is left at the deadline
        self.draining = False
        self._stop_at: float | None = None
        self._outbox: list[tuple[ServeRequest, tuple]] = []  # events of this step, sent together (_flush)
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine")
        self.thread.start()

    # -- submitting and cancelling (the routes' event loop) -----------------------------------------------
    def submit(self, request: GenerationRequest | None, prompt_ids: list[int] | None = None,
               top_k: int = 0) -> ServeRequest:
        if request is None:
            return self._enqueue([self._job(GenerationRequest("echo", ""), prompt_ids, top_k)], self._scoring)[0]
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest], stream: bool = True) -> list[ServeRequest]:
        """Jobs for generation requests, queued together. ServeQueueFull when they would take the waiting
        sequences past max_queue (a request is taken whole or not at all). stream:
        the route reads each token as it comes; else it gets the result alone."""
        jobs = [self._job(r, stream=stream) for r in requests]
        group = next(self._groups)
        for job in jobs:
            job.group = group
        return self._enqueue(jobs, self._waiting)

    def _job(self, request: GenerationRequest, prompt_ids: list[int] | None = None, top_k: int = 0,
             stream: bool = True) -> ServeRequest:
        return ServeRequest(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter(), prompt_ids,
                            top_k, stream=stream)

    def _enqueue(self, jobs: list[ServeRequest], into: deque[ServeRequest]) -> list[ServeRequest]:
        """Queue the jobs of one request whole, or none of them. The cap counts sequences (a job is
        one prompt's one choice), whichever requests they came in."""
        with self._lock:
            if self.draining:
                raise ShuttingDown(SHUTTING_DOWN)
            if into is self._waiting and len(self._waiting) + len(jobs) > self.max_queue:
                raise ServeQueueFull(
                    f"The server's queue is full: {len(self._waiting)} sequences wait and this request brings "
                    f"{len(jobs)} (--max-queue {self.max_queue}) beyond the {self.max_num_seqs} being decoded "
                    f"(--max-num-seqs {self.max_num_seqs}). Retry later, or start the server with a larger "
                    f"--max-queue.")
            into.extend(jobs)
            self._gauge_waiting()
            self._lock.notify()
        return jobs

    def cancel(self, jobs: list[ServeRequest], reason: str = "abort") -> None:
        """Nobody reads these jobs any more: a queued one is dropped now, a running one leaves the
        batch before its next step (one-at-a-time: at its next token)."""
        with self._lock:
            for job in jobs:
                if job.cancelled.is_set():
                    continue
                job.cancel(reason)
                if job in self._waiting:  # never started: it counts as aborted, as in vLLM
                    self._waiting.remove(job)
                    self.metrics.request_success["abort"].inc()
                    if not any(other.group == job.group for other in self._waiting):
                        self._served.pop(job.group, None)
            self._gauge_waiting()

    def request_stop(self, drain_s: float = 0.0) -> None:
        """Shutdown (SIGTERM): new requests are refused (503) at once; the jobs queued and running
        go on for up to drain_s seconds, then the engine thread fails those left with an error
        event (their routes answer at once) and ends. Safe in a signal handler: assignments only."""
        self._stop_at = time.monotonic() + max(0.0, drain_s)
        self.draining = True

    def _past_deadline(self) -> bool:
        return self._stop_at is not None and time.monotonic() >= self._stop_at

    def _done_draining(self, taken: list[ServeRequest]) -> bool:
        """Whether the engine thread stops now: past the drain deadline, or draining with no job
        left (`taken`: those just taken from the queues)."""
        if self._stop_at is None:
            return False
        return self._past_deadline() or not (taken or self._waiting or self._scoring or self.rows)

    def _gauge_waiting(self) -> None:
        self.metrics.waiting.set(len(self._waiting) + len(self._scoring))

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            scoring, starting = self._next_jobs()
            if self._done_draining(scoring + starting):
                self._shutdown(scoring + starting)
                return
            for job in scoring:
                self._guarded(job, self._score)
            for job in starting:
                self._guarded(job, self._start)
            if self.rows:
                self._step()

    def _next_jobs(self) -> tuple[list[ServeRequest], list[ServeRequest]]:
        """Every echo job queued, and as many generation jobs as the batch has free rows; waits
        while there is nothing to do (polling so that a stop request is noticed)."""
        with self._lock:
            while not (self.draining or self._scoring or self._waiting or self.rows):
                self._lock.wait(0.2)
            scoring = list(self._scoring)
            self._scoring.clear()
            starting: list[ServeRequest] = []
            while self._waiting and len(self.rows) + len(starting) < self.max_num_seqs:
                starting.append(self._take_fairly(starting))
            self._gauge_waiting()
        return scoring, starting

    def _take_fairly(self, starting: list[ServeRequest]) -> ServeRequest:
        """The next waiting job to start: the oldest of the request that holds the fewest rows and,
        among those, has started the fewest of its sequences. A request of many prompts or
        choices takes turns with those that came after it instead of keeping them out of the
        batch until all of its own have run; requests of one sequence each are served first come,
        first served."""
        holds: dict[int, int] = {}
        for job in [*(r.job for r in self.rows.values()), *starting]:
            holds[job.group] = holds.get(job.group, 0) + 1
        pick = min(self._waiting, key=lambda job: (holds.get(job.group, 0), self._served.get(job.group, 0)))
        self._waiting.remove(pick)  # min keeps the first (the oldest) of equals
        if any(job.group == pick.group for job in self._waiting):
            self._served[pick.group] = self._served.get(pick.group, 0) + 1
        else:
            self._served.pop(pick.group, None)  # its last sequence: nothing left to count
        return pick

    def _guarded(self, job: ServeRequest, run: Callable[[ServeRequest, float], None]) -> None:
        """run(job, started), its refusal or failure sent to the job's route; the server stays up."""
        started = job.started = time.perf_counter()
        self.metrics.queue_time.observe(started - job.arrived)
        try:
            run(job, started)
        except ValueError as e:  # the engine refuses this input (e.g. over the context): the client's error, a 400
            self._emit(job, ("invalid", str(e)))
        except Cancelled:
            self.metrics.request_success[job.stop_reason].inc()
        except Exception as e:  # noqa: BLE001 — the request fails, the server stays up
            self._emit(job, ("error", str(e)))
        finally:
            self.metrics.running.set(len(self.rows))
            if self.batch is None:
                self.metrics.kv_usage.set(0)
            self._flush()

    def _score(self, job: ServeRequest, started: float) -> None:
        metrics = self.metrics
        assert job.prompt_ids is not None
        scores = self.engine.prompt_logprobs(job.prompt_ids, job.top_k)
        n = len(job.prompt_ids)  # echo requests count too: a prefill of the prompt
        metrics.prompt_tokens.inc(n)
        metrics.iteration_tokens.observe(n)
        metrics.request_finished(job, started, started_decode=time.perf_counter(), n_prompt=n, n_generated=0,
                                 reason="length")
        self._emit(job, ("scored", scores))

    def _start(self, job: ServeRequest, started: float) -> None:
        if job.cancelled.is_set():  # its client left between the queue and here
            self.metrics.request_success[job.stop_reason].inc()
            return
        self.metrics.params_max_tokens.observe(job.request.max_new_tokens)
        self.metrics.max_generation_tokens.observe(job.request.max_new_tokens)
        if self.batch is None:
            n_prompt = self.n_prompt_tokens(job.request.prompt, job.request.prompt_ids)
            self.metrics.prompt_tokens.inc(n_prompt)
            self.metrics.running.set(1)
            self._generate(job, started, n_prompt)
            return
        seq = self.batch.join(job.request)  # a row now; its prefill now or with the next step (batching.join)
        run = self.rows[seq.row] = Running(job, seq, started)
        self.metrics.running.set(len(self.rows))
        if not seq.tokens:  # the next step prefills it beside the running rows and picks its first token
            return
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        self._deliver(run, prefill_tokens=len(seq.prompt))
        self.metrics.kv_usage.set(self._kv_usage())
        if seq.done:
            self._retire(run)

    # -- the batch (continuous batching) ------------------------------------------------------------------
    def _step(self) -> None:
        """Retire rows whose client left, then one decode step over the rest."""
        assert self.batch is not None
        for run in [r for r in self.rows.values() if r.job.cancelled.is_set()]:
            self._retire(run, emit=False)
        if not self.rows:
            self.metrics.running.set(0)
            return
        try:
            stepped = self.batch.step()
        except PrefillFailed as e:  # the joining prompts' step: they fail, the running rows go on
            for seq in e.seqs:
                run = self.rows.pop(seq.row)
                self._emit(run.job, ("error", str(e)))
            self.metrics.running.set(len(self.rows))
            self._flush()
            return
        except Exception as e:  # noqa: BLE001 — the batch's requests fail, the server stays up
            for run in list(self.rows.values()):
                self._emit(run.job, ("error", str(e)))
                self._retire(run, emit=False, count=False)
            self._flush()
            return
        # the step's tokens: one per row, or each row's accepted drafts and its correction or bonus
        # token, and the prompts it prefilled (rows that joined: nothing sent yet)
        joined = [seq for seq in stepped if self.rows[seq.row].sent == 0]
        self.metrics.prompt_tokens.inc(sum(len(seq.prompt) for seq in joined))
        self.metrics.iteration_tokens.observe(sum(len(seq.tokens) - self.rows[seq.row].sent for seq in stepped)
                                              + sum(len(seq.prompt) for seq in joined))
        for seq in stepped:
            if seq.last_spec is not None:
                self.metrics.speculative_step(seq.last_spec)
            self._deliver(self.rows[seq.row], prefill_tokens=None)
        self.metrics.kv_usage.set(self._kv_usage())
        for seq in stepped:
            if seq.done:
                self._retire(self.rows[seq.row])
        self._flush()

    def _deliver(self, run: Running, prefill_tokens: int | None = 0) -> None:
        """Emit the row's new token with its metrics (TTFT at the first, inter-token gaps after;
        prefill_tokens None: the step's tokens are counted by the step)."""
        job = run.job
        new = run.seq.tokens[run.sent:]
        run.sent = len(run.seq.tokens)
        self.metrics.tokens_delivered(job, run.seq.stamps[-1], len(new), prefill_tokens)
        if job.stream:
            self._emit(job, ("tokens", new))

    def _retire(self, run: Running, emit: bool = True, count: bool = True) -> None:
        """The row leaves the batch: finished (its result sent) or cancelled (counted as its stop reason)."""
        assert self.batch is not None
        seq, job = run.seq, run.job
        self.batch.remove(seq)
        del self.rows[seq.row]
        self.metrics.running.set(len(self.rows))
        self.metrics.kv_usage.set(self._kv_usage())
        if not count:
            return
        if not emit:
            self.metrics.request_success[job.stop_reason].inc()
            return
        result = self.batch.result(seq)
        reason = "stop" if seq.tokens[-1] == self.batch.eos else "length"
        self.metrics.request_finished(job, run.started, job.stamps[0], len(seq.prompt), len(seq.tokens), reason)
        self._emit(job, ("done", result))

    def _kv_usage(self) -> float:
        """Token positions the rows hold over what the server reserves: max_num_seqs rows of a full context."""
        assert self.batch is not None
        return min(1.0, self.batch.held() / (self.max_num_seqs * self.max_model_len))

    def _shutdown(self, taken: list[ServeRequest]) -> None:
        """Fail every job still queued or running (their routes answer at once) and stop."""
        with self._lock:
            jobs = [*taken, *self._waiting, *self._scoring, *(r.job for r in self.rows.values())]
            self._waiting.clear()
            self._scoring.clear()
        for job in jobs:
            self._emit(job, ("error", SHUTTING_DOWN))
        self._flush()

    # -- one request at a time (engines that cannot batch) ------------------------------------------------
    def _generate(self, job: ServeRequest, started: float, n_prompt: int) -> None:
        metrics = self.metrics
        held = [n_prompt]  # tokens in the KV cache

        def on_tokens(request_id: str, tokens: list[int], spec_decode: SpeculativeStats | None) -> None:
            if job.cancelled.is_set() or self._past_deadline():
                raise Cancelled  # out of engine.generate: the request stops here
            if job.stamps:  # a decode step of this request alone: its tokens are the step's
                metrics.iteration_tokens.observe(len(tokens))
            self.metrics.tokens_delivered(job, time.perf_counter(), len(tokens), n_prompt)
            held[0] += len(tokens)
            metrics.kv_usage.set(min(1.0, held[0] / self.max_model_len))
            if spec_decode is not None:
                self.metrics.speculative_step(spec_decode)
            if job.stream:
                self._emit(job, ("tokens", tokens))
                self._flush()  # now: this token's step is done

        try:
            result = self.engine.generate([job.request], on_tokens=on_tokens)[0]
        except Cancelled:
            if self._past_deadline():
                self._emit(job, ("error", SHUTTING_DOWN))
            raise
        eos = self.engine.tokenizer.eos_token_id
        reason = "stop" if result.token_ids and result.token_ids[-1] == eos else "length"
        self.metrics.request_finished(job, started, job.stamps[0] if job.stamps else time.perf_counter(), n_prompt,
                       len(result.token_ids), reason)
        self._emit(job, ("done", result))

    def _emit(self, job: ServeRequest, event: tuple) -> None:
        self._outbox.append((job, event))

    def _flush(self) -> None:
        """Send the events emitted since the last flush: one wake-up of each event loop per step,
        not one per row (a thread-safe call writes to the loop's wake-up pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[ServeRequest, tuple]]] = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (the server is gone): nobody to tell
                pass

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


def _put_all(items: list[tuple[ServeRequest, tuple]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)
