"""Execute one config-run: claim it (lease + fencing attempt), load the engine for its config
(cached per worker process), score the run's documents and prompts, write raw per-sample
results idempotently, and hand over to aggregation when the run's last config finishes."""

from __future__ import annotations

import hashlib
import json
import math
import logging
import os
import socket
import statistics
import threading
import traceback
from datetime import timezone
from collections import OrderedDict
from typing import Any


from app import repo
from app.db import is_transient, retry_transient, session_scope
from app.dispatch import AGGREGATE_RUN, Dispatcher
from app.models import ConfigRun, Run, Suite, aware
from app.settings import get_settings
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path
from evals.records import DocRecord, GenerationRecord, spec_to_json

log = logging.getLogger(__name__)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
DOC_BATCH = 8  # documents per engine call; progress and a commit after each (the lease: LeaseKeeper)
_ENGINES: OrderedDict[str, Any] = OrderedDict()
MAX_CACHED_ENGINES = 2  # a GPU holds one or two models at once


def get_engine(model_path: str, spec: OptimizationSpec, calibration: list[str] | None = None):
    from engines.registry import load_engine

    calib_id = hashlib.sha256("\x00".join(calibration or []).encode()).hexdigest()
    key = json.dumps([model_path, spec.model_dump(), calib_id], sort_keys=True)
    if key in _ENGINES:
        _ENGINES.move_to_end(key)
        return _ENGINES[key]
    from workers.outbound import engine_options

    engine = load_engine(model_path, spec, calibration=calibration, **engine_options(spec))
    _ENGINES[key] = engine
    while len(_ENGINES) > MAX_CACHED_ENGINES:
        _ENGINES.popitem(last=False)
    return engine


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def execute_config_run(config_run_id: int, dispatcher: Dispatcher) -> str:
    settings = get_settings()

    def claim() -> tuple[int | None, int | None, bool]:
        with session_scope() as s:  # the claim commits on its own, before anything can fail
            attempt = repo.claim_config_run(s, config_run_id, WORKER_ID, settings.lease_seconds, settings.max_attempts)
            cr = s.get(ConfigRun, config_run_id)
            if cr is None or attempt is not None:
                return attempt, cr and cr.run_id, False
            if cr.status == "running" and cr.worker == WORKER_ID:
                # our own claim, whose commit was in doubt when the connection dropped (this
                # process runs one task at a time, so a running row in its name is this task's)
                return cr.attempt, cr.run_id, False
            return None, cr.run_id, repo.give_up_config_run(s, config_run_id, settings.max_attempts, give_up_reason(cr))

    attempt, run_id, gave_up = retry_transient(claim, f"claim config-run {config_run_id}")
    if run_id is None or (attempt is None and not gave_up):
        return "skipped"  # gone, finished, or another worker holds a live lease
    outcome = "failed"
    if attempt is not None:
        # the lease is renewed from here on by a thread of this process, whatever the task is
        # doing (model load, calibration, a long batch), until the attempt ends
        with LeaseKeeper(config_run_id, attempt, settings.lease_seconds) as lease:
            try:
                job = retry_transient(lambda: _load_job(config_run_id), f"load config-run {config_run_id}")
                _score(config_run_id, attempt, job, settings, lease)
                outcome = "succeeded"
            except _LostLease as e:
                log.warning("%s", e)
                return "superseded"
            except Exception as e:
                if is_transient(e):  # the database stayed away: the reconciler re-sends it once the lease is free
                    log.error("config-run %s attempt %s interrupted, the database is unreachable (%s)", config_run_id,
                              attempt, type(e).__name__)
                    lease.stop()
                    _note_interruption(config_run_id, attempt, settings,
                                       f"the database was unreachable for longer than CANARY_DB_RETRY_SECONDS "
                                       f"({settings.db_retry_seconds:g} s; {type(e).__name__})")
                    return "interrupted"
                # the config-run fails with its reason; other configs are untouched
                log.error("config-run %s failed: %s", config_run_id, traceback.format_exc())
                retry_transient(lambda: _finish(config_run_id, attempt, "failed", error=f"{type(e).__name__}: {e}"),
                                f"record the failure of config-run {config_run_id}")
    if retry_transient(lambda: _try_start_aggregation(run_id), f"aggregation trigger of run {run_id}"):
        dispatcher.send(AGGREGATE_RUN, run_id)  # after the commit: the task must see every config-run finished
    return outcome


INTERRUPTED = "attempt {attempt} interrupted: "  # how an attempt that let go of its lease says why (in `error`)


def give_up_reason(cr: ConfigRun) -> str:
    """Why a config-run is abandoned once its attempts are spent. Its last attempt either said why
    it let go (an interruption it recorded, e.g. the database was unreachable for longer than the
    retry window), or it stopped renewing its lease without a word: the heartbeat thread renews
    it for as long as the worker process lives, however slow the work, so a silent lease means
    the process died (killed, out of memory, a crash in native code) or was frozen."""
    worker = cr.worker or "an unknown worker"
    note = INTERRUPTED.format(attempt=cr.attempt)
    if cr.error and cr.error.startswith(note):
        return (f"gave up after {cr.attempt} attempts, all spent; the last, attempt {cr.attempt} on {worker}, was "
                f"interrupted: {cr.error[len(note):]} — the worker was alive; fix that cause, then start a new run")
    when = (aware(cr.lease_expires_at).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if cr.lease_expires_at else "an unknown time")
    where = (f"after {cr.progress_done}/{cr.progress_total} results" if cr.progress_done
             else "before its first results were written (model load or calibration)")
    return (f"gave up after {cr.attempt} attempts: the last, attempt {cr.attempt} on {worker}, stopped renewing its "
            f"lease without reporting an error (process killed, out of memory, or hung) {where}, its lease expiring at "
            f"{when}; a live worker's heartbeat renews it however slow the work, so see that worker's log; raise "
            f"CANARY_MAX_ATTEMPTS only once the cause is fixed")


class LeaseKeeper:
    """The heartbeat of one attempt: a daemon thread with its own database sessions renews the
    config-run's lease every lease/3 seconds, fenced by the attempt number, from the claim until
    the attempt ends — through the model load, calibration and every batch, however long they
    take. It dies with its process, so only a worker that is gone or frozen (SIGSTOP, a stalled
    VM: every thread stops) lets its lease run out and is taken over. A transient database error
    is retried at the next beat (within the lease, two more tries); once another attempt holds
    the config-run, `lost` is set and the thread ends — the task stops at its next check or its
    next fenced write. A main thread hung inside a live process keeps its lease until Celery's
    hard time limit kills the process."""

    def __init__(self, config_run_id: int, attempt: int, lease_seconds: float, period: float | None = None):
        self.config_run_id, self.attempt, self.lease_seconds = config_run_id, attempt, lease_seconds
        self.period = period if period is not None else max(lease_seconds / 3, 0.05)
        self.lost = threading.Event()
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{config_run_id}-{attempt}", daemon=True)

    def __enter__(self) -> "LeaseKeeper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.period, 1.0))

    def check(self) -> None:
        """Raise _LostLease once a newer attempt holds the config-run (before more GPU work)."""
        if self.lost.is_set():
            raise _LostLease(self.config_run_id, self.attempt)

    def renew(self) -> bool:
        with session_scope() as s:
            return repo.heartbeat(s, self.config_run_id, self.attempt, self.lease_seconds)

    def _run(self) -> None:
        wait = self.period
        while not self._stop.wait(wait):
            wait = self.period
            try:
                held = self.renew()
            except Exception as e:  # noqa: BLE001 - the heartbeat must outlive a database outage
                wait = min(self.period, 1.0)
                if is_transient(e):
                    log.warning("lease of config-run %s attempt %s: database unavailable (%s); retrying in %.1f s",
                                self.config_run_id, self.attempt, type(e).__name__, wait)
                else:
                    log.exception("lease of config-run %s attempt %s: renewal failed", self.config_run_id, self.attempt)
                continue
            if self._stop.is_set():
                return  # the attempt ended while the renewal was in flight (a finished row matches no lease)
            if not held:
                self.lost.set()
                log.warning("config-run %s: attempt %s lost its lease to a newer attempt (heartbeat)",
                            self.config_run_id, self.attempt)
                return
            self.beats += 1


def _note_interruption(config_run_id: int, attempt: int, settings, why: str) -> None:
    """An attempt that lets go of a config-run while its process lives says why, and frees the
    lease so the reconciler re-sends it without waiting for the lease to run out. The database
    was just unreachable, so a daemon thread keeps trying for one lease's length; the note is
    fenced by the attempt (a later claim clears it) and names the cause if the config-run is
    given up."""
    def write() -> bool:
        with session_scope() as s:
            return repo.release_lease(s, config_run_id, attempt, INTERRUPTED.format(attempt=attempt) + why)

    def keep_trying() -> None:
        try:
            retry_transient(write, f"note the interruption of config-run {config_run_id}",
                            deadline_s=max(settings.lease_seconds, settings.db_retry_seconds))
        except Exception as e:  # noqa: BLE001 - best effort: the lease runs out on its own
            log.warning("config-run %s attempt %s: could not note its interruption (%s)", config_run_id, attempt,
                        type(e).__name__)

    threading.Thread(target=keep_trying, name=f"release-{config_run_id}-{attempt}", daemon=True).start()


def _try_start_aggregation(run_id: int) -> bool:
    with session_scope() as s:
        return repo.try_start_aggregation(s, run_id)


def _finish(config_run_id: int, attempt: int, status: str, **kw) -> bool:
    """Fenced by the attempt; True also when this attempt already finished it with that status
    (a retry after a commit whose acknowledgement was lost with the connection)."""
    with session_scope() as s:
        if repo.finish_config_run(s, config_run_id, attempt, status, **kw):
            return True
        cr = s.get(ConfigRun, config_run_id)
        return cr is not None and cr.attempt == attempt and cr.status == status


def _load_job(config_run_id: int) -> dict:
    with session_scope() as s:
        cr = s.get(ConfigRun, config_run_id)
        run = s.get(Run, cr.run_id)
        suite = s.get(Suite, run.suite_id)
        spec = OptimizationSpec.model_validate(cr.config.spec)
        calibration = None
        if spec.weights == "awq-int4":  # domain text the run does not score: no test leakage
            scored = set(run.sample_keys)
            calibration = [x.text for x in repo.suite_samples(s, suite.id, run.suite_version) if x.key not in scored]
        return {
            "run_id": run.id,
            "config_id": cr.config_id,
            "spec": spec,
            "calibration": calibration,
            "model_path": cr.config.model.path,
            "suite": dict(suite.spec),
            "samples": [(x.key, x.text, x.cluster or x.key)
                        for x in repo.suite_samples(s, suite.id, run.suite_version, run.sample_keys)],
        }


def _score(config_run_id: int, attempt: int, job: dict, settings, lease: LeaseKeeper | None = None) -> None:
    check_lease = lease.check if lease is not None else (lambda: None)
    spec: OptimizationSpec = job["spec"]
    # a served model (engine openai) is named, not a path
    if spec.engine == "openai":  # URLs and the key's name pass the outbound policy again, at use
        from workers.outbound import check_engine

        check_engine(spec)
    model = job["model_path"] if spec.engine == "openai" else str(resolve_model_path(job["model_path"]))
    engine = get_engine(model, spec, job["calibration"])
    suite = job["suite"]
    ppl = suite.get("perplexity", {})
    window = WindowSpec(max_length=ppl.get("window", 256), stride=ppl.get("stride") or ppl.get("window", 256))
    gen = suite.get("generation", {})
    scorers = suite.get("scorers", ["perplexity", "generation"])
    keep_ids = "agreement" in scorers  # top-1 and exact-match agreement pair token ids with the baseline's
    samples = job["samples"]
    n_prompts = min(gen.get("prompts", 0), len(samples)) if "generation" in scorers else 0
    total = len(samples) + n_prompts
    done = 0
    nll_sum = tokens = 0.0
    for i in range(0, len(samples), DOC_BATCH):
        batch = samples[i : i + DOC_BATCH]
        check_lease()
        results = engine.loglikelihood_rolling([RollingRequest(k, t, window) for k, t, _ in batch])
        rows = []
        for r, (_, _, cluster) in zip(results, batch):
            nll_sum += r.nll
            tokens += len(r.token_ids)
            rows.append(DocRecord.from_result(r, cluster, keep_ids).to_row())
        done += len(batch)
        _write_fenced(config_run_id, attempt, job, rows, done, total, settings)
    ttft, itl, tps, gen_tokens = [], [], [], 0
    spec_totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    requests = [GenerationRequest(key, " ".join(text.split()[: gen.get("prompt_words", 24)]),
                                  gen.get("max_new_tokens", 32), gen.get("temperature", 0.0))
                for key, text, _ in samples[:n_prompts]]
    prompts = {r.request_id: r.prompt for r in requests}
    step = max(1, int(spec.engine_options.get("concurrency", 1)))  # a batch of `concurrency` at a time
    for i in range(0, len(requests), step):
        rows = []
        check_lease()
        for g in engine.generate(requests[i : i + step]):
            ttft.append(g.ttft_ms)
            itl.extend(g.itl_ms)
            tps.append(g.tokens_per_second)
            gen_tokens += g.n_tokens
            row = GenerationRecord.from_result(g, prompts[g.request_id], keep_ids).to_row()
            if g.spec is not None:
                for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                    spec_totals[k] += getattr(g.spec, k)
                per = spec_totals["accepted_per_position"]
                per.extend([0] * (len(g.spec.accepted_per_position) - len(per)))
                for j, a in enumerate(g.spec.accepted_per_position):
                    per[j] += a
            rows.append(row)
        server = engine.server_stats()  # a serving process's own counters over this batch (None in-process)
        server_spec = server.spec if server is not None else None
        if server_spec is not None and server_spec.num_draft_tokens:  # a server's counters: per batch, not per request
            rows[0]["extra"]["spec"] = spec_to_json(server_spec) | {"scope": "batch"}  # GenerationRecord.spec_scope
            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                spec_totals[k] += getattr(server_spec, k)
        done += len(rows)
        _write_fenced(config_run_id, attempt, job, rows, done, total, settings)
    d = engine.describe()
    figures = {
        "engine": d.engine, "weights": d.weights, "kv_cache": d.kv_cache, "speculative": d.speculative,
        "device": d.device, "compute_dtype": d.compute_dtype, "parameters": d.parameters,
        "weight_bytes": d.weight_bytes, "kv_bytes_per_token": d.kv_bytes_per_token, "versions": d.versions,
        "resident_weight_bytes": d.resident_weight_bytes, "peak_kv_cache_bytes": d.peak_kv_cache_bytes,
        "peak_device_bytes": d.peak_device_bytes,
        "notes": list(d.notes),
        "token_ppl": math.exp(nll_sum / tokens) if tokens else None,
        "n_documents": len(samples), "n_tokens": int(tokens),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tbt_ms_mean": statistics.fmean(itl) if itl else None,
        "tbt_ms_p50": percentile(itl, 50), "tbt_ms_p99": percentile(itl, 99),
        "tokens_per_second": statistics.fmean(tps) if tps else None,
        "generated_tokens": gen_tokens,
        "concurrency": int(spec.engine_options.get("concurrency", 1)),
    }
    if spec_totals["num_drafts"]:
        # vLLM's definitions: acceptance rate = accepted / draft tokens; mean acceptance length =
        # 1 + accepted / drafts; per-position rate = accepted at position i / drafts
        n_drafts, n_tokens, n_acc = (spec_totals[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        figures["spec"] = {**spec_totals, "acceptance_rate": n_acc / n_tokens,
                           "mean_acceptance_length": 1 + n_acc / n_drafts,
                           "per_position_rate": [a / n_drafts for a in spec_totals["accepted_per_position"]]}
    if not retry_transient(lambda: _finish(config_run_id, attempt, "succeeded", figures=figures),
                           f"finish config-run {config_run_id}"):
        raise _LostLease(config_run_id, attempt)


class _LostLease(RuntimeError):
    def __init__(self, config_run_id: int, attempt: int):
        super().__init__(f"config-run {config_run_id}: attempt {attempt} lost its lease to a newer attempt")


def _write_fenced(config_run_id, attempt, job, rows, done, total, settings) -> None:
    """One transaction: record progress and renew the lease (fenced by the attempt number), then
    write the rows. If a newer attempt holds the run, nothing is written. Retried while the
    database is away."""
    def write() -> bool:
        with session_scope() as s:
            if not repo.heartbeat(s, config_run_id, attempt, settings.lease_seconds, done, total):
                return False
            repo.write_sample_results(s, job["run_id"], job["config_id"], rows)
            return True

    if not retry_transient(write, f"write results of config-run {config_run_id}"):
        raise _LostLease(config_run_id, attempt)


def reset_engine_cache() -> None:
    _ENGINES.clear()


__all__ = ["execute_config_run", "percentile", "reset_engine_cache"]
