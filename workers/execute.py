"""Execute one config-run: claim it (lease + fencing attempt), load the engine for its config
(cached per worker process), run it over the run's documents and prompts, write raw per-sample
results idempotently, and hand over to aggregation when the run's last config finishes."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import platform
import socket
import statistics
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass, replace
from datetime import timezone
from typing import Any

from app import repo
from app.db import is_transient, session_scope
from app.dispatch import AGGREGATE_RUN, EXECUTE_CONFIG_RUN, Dispatcher, priority_of
from app.models import ConfigRun, OptimizationConfig, Project, Run, Suite, aware
from app.settings import get_settings
from engines.fingerprint import model_digest, source_digest
from engines.protocol import GenerationRequest, RollingRequest, RollingResult, ServerStats, SpecStats, WindowSpec
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path
from evals.health import Scored
from evals.records import (
    ENGINE_KINDS,
    DocRecord,
    GenerationRecord,
    RepeatRecord,
    RunFigures,
    ServerFigures,
    SoloRecord,
    SpecFigures,
    spec_to_json,
)
from evals.suite import GenerationSettings, SuiteSpec
from evals.terms import compile_terms, term_nll
from workers.base import BaseTask

log = logging.getLogger(__name__)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
DOC_BATCH = 8  # documents per engine call; progress and a commit after each (the lease: LeaseKeeper)
_ENGINES: OrderedDict[str, Any] = OrderedDict()
MAX_CACHED_ENGINES = 2  # a GPU holds one or two models at once
SERVING_ENGINES = ("openai", "vllm")  # engines that take many requests at once, as a server does


def calibration_id(calibration: list[str] | None) -> str:
    """The calibration texts (AWQ's) as one digest: part of an engine's identity and of an inputs key."""
    return hashlib.sha256("\x00".join(calibration or []).encode()).hexdigest()


def get_engine(model_path: str, spec: OptimizationSpec, calibration: list[str] | None = None):
    from engines.registry import load_engine

    key = json.dumps([model_path, spec.model_dump(), calibration_id(calibration)], sort_keys=True)
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


class ExecuteConfigRun(BaseTask):
    """One config-run on this worker's GPU. Its result says what became of it: succeeded,
    failed (recorded on the config-run), interrupted (the database stayed away; the reconciler
    re-sends it), superseded (a newer attempt holds it) or skipped (gone, finished, or leased)."""

    name = EXECUTE_CONFIG_RUN
    failure_results = frozenset({"failed", "interrupted"})

    def run_impl(self, config_run_id: int, *, dispatcher: Dispatcher) -> str:
        settings = get_settings()
        # the claim commits on its own, before anything can fail
        attempt, run_id, gave_up = self.transaction(lambda session: _claim(session, config_run_id, settings),
                                                    f"claim config-run {config_run_id}")
        if run_id is None or (attempt is None and not gave_up):
            return "skipped"  # gone, finished, or another worker holds a live lease
        outcome = "failed"
        if attempt is not None:
            # the lease is renewed from here on by a thread of this process, whatever the task is
            # doing (model load, calibration, a long batch), until the attempt ends
            with LeaseKeeper(config_run_id, attempt, settings.lease_seconds) as lease:
                try:
                    job = self.transaction(lambda session: _load_job(session, config_run_id),
                                           f"load config-run {config_run_id}")
                    self._run_engine(config_run_id, attempt, job, settings, lease)
                    outcome = "succeeded"
                except _LostLease as e:
                    log.warning("%s", e)
                    return "superseded"
                except Exception as e:  # noqa: BLE001 - every failure of an attempt is recorded on the config-run
                    if is_transient(e):  # the database stayed away: the reconciler re-sends it once the lease is free
                        log.error("config-run %s attempt %s interrupted, the database is unreachable (%s)",
                                  config_run_id, attempt, type(e).__name__)
                        lease.stop()
                        self._note_interruption(config_run_id, attempt, settings,
                                                f"the database was unreachable for longer than CANARY_DB_RETRY_SECONDS "
                                                f"({settings.db_retry_seconds:g} s; {type(e).__name__})")
                        return "interrupted"
                    # the config-run fails with its reason; other configs are untouched
                    log.error("config-run %s failed: %s", config_run_id, traceback.format_exc())
                    reason = f"{type(e).__name__}: {e}"
                    self.transaction(lambda session: _finish(session, config_run_id, attempt, "failed", error=reason),
                                     f"record the failure of config-run {config_run_id}")
        def start_aggregation(session) -> str | None:  # the run's trigger when this attempt won, else None
            return repo.run_trigger(session, run_id) if repo.try_start_aggregation(session, run_id) else None

        trigger = self.transaction(start_aggregation, f"aggregation trigger of run {run_id}")
        if trigger is not None:  # after the commit: the task must see every config-run finished
            dispatcher.send(AGGREGATE_RUN, run_id, priority=priority_of(trigger))
        return outcome

    def _note_interruption(self, config_run_id: int, attempt: int, settings, why: str) -> None:
        """An attempt that lets go of a config-run while its process lives says why, and frees the
        lease so the reconciler re-sends it without waiting for the lease to run out. The database
        was just unreachable, so a daemon thread keeps trying for one lease's length; the note is
        fenced by the attempt (a later claim clears it) and names the cause if the config-run is
        given up."""
        def release(session) -> bool:
            return repo.release_lease(session, config_run_id, attempt, INTERRUPTED.format(attempt=attempt) + why)

        def keep_trying() -> None:
            try:
                self.transaction(release, f"note the interruption of config-run {config_run_id}",
                                 deadline_s=max(settings.lease_seconds, settings.db_retry_seconds))
            except Exception as e:  # noqa: BLE001 - best effort: the lease runs out on its own
                log.warning("config-run %s attempt %s: could not note its interruption (%s)", config_run_id, attempt,
                            type(e).__name__)

        threading.Thread(target=keep_trying, name=f"release-{config_run_id}-{attempt}", daemon=True).start()

    def _run_engine(self, config_run_id: int, attempt: int, job: Job, settings,
                    lease: LeaseKeeper | None = None) -> None:
        """Run the config's engine over the run's documents (log-likelihoods) and prompts
        (generations), writing each batch's rows fenced by the attempt, then finish the config-run
        with its serving and memory figures."""
        check_lease = lease.check if lease is not None else (lambda: None)
        spec: OptimizationSpec = job.spec
        # a served model (engine openai) is named, not a path
        if spec.engine == "openai":  # URLs and the key's name pass the outbound policy again, at use
            from workers.outbound import check_engine

            check_engine(spec, job.project)
        model = job.model_path if spec.engine == "openai" else str(loadable_model(job))
        # a baseline's inputs key: a later gate on the same samples may take its rows (computed only
        # for baselines, the only source of reuse: the first call in a process hashes the model's files)
        key = inputs_key(job) if job.is_baseline and settings.gate_reuse_baseline else None
        if key is not None and job.trigger == "gate" and self._reuse(config_run_id, attempt, job, key, settings):
            return
        engine = get_engine(model, spec, job.calibration)
        engine.reset_peaks()  # a cached engine's peaks from earlier runs are not this run's
        ppl, gen, scorers = job.suite.perplexity, job.suite.generation, job.suite.scorers
        window = WindowSpec(max_length=ppl.window, stride=ppl.stride or ppl.window)
        term_pattern = compile_terms(ppl.terms)  # the suite's domain terms (term_nll_ratio)
        keep_ids = "agreement" in scorers  # top-1 and exact-match agreement pair token ids with the baseline's
        samples = job.samples
        n_prompts = min(job.prompts, len(samples)) if "generation" in scorers else 0
        total = len(samples) + n_prompts
        done = 0
        nll_sum = n_tokens = 0.0
        for i in range(0, len(samples), DOC_BATCH):
            documents = samples[i : i + DOC_BATCH]
            check_lease()
            results = engine.loglikelihood_rolling([RollingRequest(key, text, window) for key, text, _ in documents])
            rows = []
            for doc, (_, text, cluster) in zip(results, documents, strict=True):
                nll_sum += doc.nll
                n_tokens += len(doc.token_ids)
                terms = term_nll(text, doc.logprobs, doc.char_spans, term_pattern) if term_pattern else None
                rows.append(DocRecord.from_result(doc, cluster, keep_ids, terms).to_row())
            done += len(documents)
            self._write_fenced(config_run_id, attempt, job, rows, done, total, settings)
        ttft, itl, tps, gen_tokens = [], [], [], 0
        spec_decode = SpecStats()  # requests' own counters plus servers' per-batch counters
        server_stats: list[ServerStats] = []  # one per batch, from an engine that runs in a server
        server_spec, foreign = SpecStats(), 0  # a server's spec-decode counter deltas; batches others moved
        own_spec = SpecStats()  # the responses' own spec-decode figures, where the server reports them
        foreign_excess = 0  # the server's counters beyond own_spec so far
        dedicated = bool(spec.engine_options.get("dedicated_server", False))
        requests = [GenerationRequest(key, " ".join(text.split()[: gen.prompt_words]), gen.max_new_tokens,
                                      gen.temperature)
                    for key, text, _ in samples[:n_prompts]]
        prompts = {request.request_id: request.prompt for request in requests}
        judge = _baseline_scorer(engine, job) if requests else None  # the baseline model scores every config's outputs
        step = _concurrency(engine, spec, gen, judge)  # requests in flight at once (a batch)
        # a candidate's prompts also run on the baseline engine, batch by batch, in alternating order
        # (ABBA): the paired timings that ttft_ratio and tpot_ratio compare, and the baseline's second
        # pass over the prompts (RepeatRecord), the noise floor that confident_divergence is judged beyond
        timing, floor = gen.paired_timing, gen.noise_floor
        repeat = judge is not None and judge.engine is not engine and (timing or floor)
        for batch_number, i in enumerate(range(0, len(requests), step)):
            rows = []
            check_lease()
            batch = requests[i : i + step]
            # (repeat implies a judge: `judge is not None` first, for the type checker)
            baseline_pass = (judge.engine.generate(batch) if judge is not None and repeat and batch_number % 2 == 0
                             else [])
            generations = engine.generate(batch)
            if judge is not None and repeat and batch_number % 2 == 1:
                baseline_pass = judge.engine.generate(batch)
            baseline_timing = _timings(baseline_pass) if timing else {}
            for generation, (nll, n, read) in zip(generations, judge.score(generations, prompts, window) if judge
                                                  else [(None, None, None)] * len(generations), strict=True):
                ttft.append(generation.ttft_ms)
                itl.extend(generation.itl_ms)
                tps.append(generation.tokens_per_second)
                gen_tokens += generation.n_tokens
                if generation.spec is not None:
                    spec_decode += generation.spec
                record = GenerationRecord.from_result(generation, prompts[generation.request_id], keep_ids)
                base_ttft, base_tpot = baseline_timing.get(generation.request_id, (None, None))
                rows.append(replace(record, baseline_nll=nll, baseline_nll_tokens=n, paired_baseline_ttft_ms=base_ttft,
                                    paired_baseline_tpot_ms=base_tpot, scored=read, batch=batch_number).to_row())
            if floor and baseline_pass and judge is not None:
                rows += _records(RepeatRecord, baseline_pass, judge, prompts, window, keep_ids)
            server = engine.server_stats()  # a serving process's own figures over this batch (None in-process)
            if server is not None:
                server_stats.append(server)
                per_request = [generation.spec for generation in generations if generation.spec is not None]
                own_spec = sum(per_request, own_spec)
                if server.spec is not None and server.spec.num_draft_tokens:
                    server_spec += server.spec
                    if per_request:
                        # the server reported each request's own: what its counters moved beyond them, summed
                        # over the run so far, is someone else's; a batch is flagged when that excess grows (a
                        # scrape that lags one batch moves counts between batches, never adds any)
                        excess = max(0, server_spec.num_drafts - own_spec.num_drafts,
                                     server_spec.num_draft_tokens - own_spec.num_draft_tokens)
                        foreign += int(excess > foreign_excess)
                        foreign_excess = max(foreign_excess, excess)
                    else:  # more drafts or accepted tokens than the batch generated: someone else's requests
                        ours = sum(generation.n_tokens for generation in generations)
                        foreign += int(server.spec.num_drafts > ours or server.spec.num_accepted_tokens > ours)
                    # a dedicated server's counters stand for the batch (GenerationRecord.spec_scope), unless
                    # each request carried its own figures, which are already in the rows
                    if dedicated and not per_request:
                        rows[0]["extra"]["spec"] = spec_to_json(server.spec) | {"scope": "batch"}
                        spec_decode += server.spec
            done += len(generations)
            self._write_fenced(config_run_id, attempt, job, rows, done, total, settings)
        # batch invariance: a few prompts again, each alone, against their answers inside a full batch
        probes = requests[: gen.solo_probes] if step > 1 and judge is not None else []
        if probes and judge is not None:
            check_lease()
            alone = [engine.generate([request])[0] for request in probes]
            rows = _records(SoloRecord, alone, judge, prompts, window, keep_ids)
            self._write_fenced(config_run_id, attempt, job, rows, done, total, settings)
        description = engine.describe()
        figures = RunFigures(
            engine=description.engine, weights=description.weights, kv_cache=description.kv_cache,
            speculative=description.speculative, device=description.device, compute_dtype=description.compute_dtype,
            parameters=description.parameters, weight_bytes=description.weight_bytes,
            kv_bytes_per_token=description.kv_bytes_per_token, versions=dict(description.versions),
            resident_weight_bytes=description.resident_weight_bytes,
            peak_kv_cache_bytes=description.peak_kv_cache_bytes, peak_device_bytes=description.peak_device_bytes,
            notes=list(description.notes),
            token_ppl=math.exp(nll_sum / n_tokens) if n_tokens else None,
            n_documents=len(samples), n_tokens=int(n_tokens),
            ttft_ms_p50=percentile(ttft, 50), ttft_ms_p99=percentile(ttft, 99),
            tbt_ms_mean=statistics.fmean(itl) if itl else None,
            tbt_ms_p50=percentile(itl, 50), tbt_ms_p99=percentile(itl, 99),
            tokens_per_second=statistics.fmean(tps) if tps else None,
            generated_tokens=gen_tokens,
            concurrency=step,
            # peak over the run: the engine's own, or the highest a server reported while it ran
            kv_cache_usage=_peak([description.kv_cache_usage, *(batch.max_kv_cache_usage for batch in server_stats)]),
            server=_server_figures(server_stats, server_spec, dedicated, foreign) if server_stats else None,
            spec=SpecFigures.from_stats(spec_decode) if spec_decode.num_drafts else None,
            baseline_scoring_error=judge.error if judge is not None else None,
            inputs_key=key,
        ).to_json()
        if not self.transaction(lambda session: _finish(session, config_run_id, attempt, "succeeded", figures=figures),
                                f"finish config-run {config_run_id}"):
            raise _LostLease(config_run_id, attempt)

    def _reuse(self, config_run_id: int, attempt: int, job: Job, key: str, settings) -> bool:
        """A gate's baseline: take the rows and figures of the newest earlier config-run of this
        config with the same inputs key on the same samples, in one transaction fenced by the
        attempt. False when there is none (the engine computes them)."""
        def reuse(session) -> int | None:
            mine = session.get(ConfigRun, config_run_id)
            if mine is not None and mine.attempt == attempt and mine.status == "succeeded":
                # this transaction committed already and its acknowledgement was lost: done
                return (mine.figures or {}).get("reused_from_run")
            run = session.get(Run, job.run_id)
            source = repo.reusable_config_run(session, run, job.config_id, key)
            if source is None:
                return None
            total = source.progress_total
            if not repo.heartbeat(session, config_run_id, attempt, settings.lease_seconds, total, total):
                raise _LostLease(config_run_id, attempt)
            # what the engine wrote, not what judges added later (a remote judge is not in the key)
            repo.copy_sample_results(session, source.run_id, job.run_id, job.config_id, ENGINE_KINDS)
            assert source.figures is not None  # reusable_config_run matched the figures' inputs_key
            figures = {**source.figures, "reused_from_run": source.figures.get("reused_from_run") or source.run_id}
            if not _finish(session, config_run_id, attempt, "succeeded", figures=figures):
                raise _LostLease(config_run_id, attempt)
            return figures["reused_from_run"]

        source_run = self.transaction(reuse, f"reuse a baseline for config-run {config_run_id}")
        if source_run is not None:
            log.info("config-run %s: the baseline's results of run %s reused (same inputs %s)", config_run_id,
                     source_run, key[:12])
        return source_run is not None

    def _write_fenced(self, config_run_id, attempt, job, rows, done, total, settings) -> None:
        """One transaction: record progress and renew the lease (fenced by the attempt number), then
        write the rows. If a newer attempt holds the run, nothing is written. Retried as a unit
        while the database is away."""
        def write(session) -> bool:
            if not repo.heartbeat(session, config_run_id, attempt, settings.lease_seconds, done, total):
                return False
            repo.write_sample_results(session, job.run_id, job.config_id, rows)
            return True

        if not self.transaction(write, f"write results of config-run {config_run_id}"):
            raise _LostLease(config_run_id, attempt)


def _claim(session, config_run_id: int, settings) -> tuple[int | None, int | None, bool]:
    """(the attempt number this worker now holds, the run, whether the config-run was given up)."""
    attempt = repo.claim_config_run(session, config_run_id, WORKER_ID, settings.lease_seconds, settings.max_attempts)
    config_run = session.get(ConfigRun, config_run_id)
    if config_run is None or attempt is not None:
        return attempt, config_run and config_run.run_id, False
    if config_run.status == "running" and config_run.worker == WORKER_ID:
        # our own claim, whose commit was in doubt when the connection dropped (this
        # process runs one task at a time, so a running row in its name is this task's)
        return config_run.attempt, config_run.run_id, False
    return None, config_run.run_id, repo.give_up_config_run(session, config_run_id, settings.max_attempts,
                                                             give_up_reason(config_run))


INTERRUPTED = "attempt {attempt} interrupted: "  # how an attempt that let go of its lease says why (in `error`)


def give_up_reason(config_run: ConfigRun) -> str:
    """Why a config-run is abandoned once its attempts are spent. Its last attempt either said why
    it let go (an interruption it recorded, e.g. the database was unreachable for longer than the
    retry window), or it stopped renewing its lease without a word: the heartbeat thread renews
    it for as long as the worker process lives, however slow the work, so a silent lease means
    the process died (killed, out of memory, a crash in native code) or was frozen."""
    worker = config_run.worker or "an unknown worker"
    spent = config_run.attempt - config_run.attempt_base  # this pass's attempts (a top-up starts a pass)
    note = INTERRUPTED.format(attempt=config_run.attempt)
    if config_run.error and config_run.error.startswith(note):
        return (f"gave up after {spent} attempts, all spent; the last, attempt {config_run.attempt} on "
                f"{worker}, was interrupted: {config_run.error[len(note):]} — the worker was alive; fix that cause, "
                f"then start a new run")
    when = (aware(config_run.lease_expires_at).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if config_run.lease_expires_at else "an unknown time")
    where = (f"after {config_run.progress_done}/{config_run.progress_total} results" if config_run.progress_done
             else "before its first results were written (model load or calibration)")
    return (f"gave up after {spent} attempts: the last, attempt {config_run.attempt} on {worker}, "
            f"stopped renewing its lease without reporting an error (process killed, out of memory, or hung) {where}, "
            f"its lease expiring at {when}; a live worker's heartbeat renews it however slow the work, so see that "
            f"worker's log; raise CANARY_MAX_ATTEMPTS only once the cause is fixed")


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

    def __enter__(self) -> LeaseKeeper:
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
        with session_scope() as session:
            return repo.heartbeat(session, self.config_run_id, self.attempt, self.lease_seconds)

    def _run(self) -> None:
        wait = self.period
        while not self._stop.wait(wait):
            wait = self.period
            try:
                held = self.renew()
            except Exception as e:
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


def _finish(session, config_run_id: int, attempt: int, status: str, **kw) -> bool:
    """Fenced by the attempt; True also when this attempt already finished it with that status
    (a retry after a commit whose acknowledgement was lost with the connection)."""
    if repo.finish_config_run(session, config_run_id, attempt, status, **kw):
        return True
    config_run = session.get(ConfigRun, config_run_id)
    return config_run is not None and config_run.attempt == attempt and config_run.status == status


_CODE = pathlib.Path(__file__).resolve().parent.parent
_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "triton", "vllm", "numpy")


def loadable_model(job: Job) -> pathlib.Path:
    """The model directory to load, checked again at use against the project's model root (the
    row may predate the root, or a symlink may have moved since it was created): its real path,
    and its draft's check (app/model_paths.py)."""
    from app.model_paths import model_dir

    draft = getattr(job.spec.speculative, "draft_model", None)
    if draft:
        model_dir(draft, "speculative.draft_model", job.project)
    return model_dir(job.model_path, "model.path", job.project)


def inputs_key(job: Job) -> str | None:
    """sha256 of everything that decides a config-run's rows: the model's files (and a draft
    model's) by content, the config's spec, the suite's spec and version, the samples in order,
    the source of engines/, evals/ and workers/, the libraries' versions and the device kind.
    None for a served model (engine openai): what the server runs is not ours to pin."""
    spec: OptimizationSpec = job.spec
    if spec.engine == "openai":
        return None
    models = [model_digest(resolve_model_path(job.model_path))]
    draft = getattr(spec.speculative, "draft_model", None)
    if draft:
        models.append(model_digest(resolve_model_path(draft)))
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    import torch  # the worker's engines run on it already

    device = spec.engine_options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        device = f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    payload = {
        "models": models, "spec": spec.model_dump(mode="json"), "baseline_spec": job.baseline_spec.model_dump(
            mode="json"), "suite": job.suite.model_dump(mode="json"), "suite_version": job.suite_version,
        "samples": [key for key, _, _ in job.samples],
        "code": source_digest(_CODE / "engines", _CODE / "evals", _CODE / "workers"), "versions": versions,
        "device": str(device), "machine": platform.machine(), "python": platform.python_version(),
        "threads": torch.get_num_threads(), "kernels": os.environ.get("CANARY_KERNELS"),
        "calibration": calibration_id(job.calibration),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Job:
    """What one config-run needs, read from the database once per attempt (`_load_job`)."""

    run_id: int
    config_id: int
    project: str  # the project's name: whose secrets the config may name
    trigger: str  # the run's trigger (a gate may reuse a baseline's rows)
    is_baseline: bool
    spec: OptimizationSpec
    baseline_spec: OptimizationSpec  # the run's baseline config (it scores every config's outputs)
    calibration: list[str] | None  # AWQ calibration text: the suite's documents the run does not score
    suite_version: str
    model_path: str
    suite: SuiteSpec
    samples: tuple[tuple[str, str, str], ...]  # (key, text, cluster) in the run's order
    prompts: int  # generation prompts: the suite's, scaled as a top-up scales the samples


def _load_job(session, config_run_id: int) -> Job:
    config_run = session.get(ConfigRun, config_run_id)
    run = session.get(Run, config_run.run_id)
    suite = session.get(Suite, run.suite_id)
    spec = OptimizationSpec.model_validate(config_run.config.spec)
    calibration = None
    if spec.weights == "awq-int4":  # domain text the run does not score: no test leakage
        scored = set(run.sample_keys)
        calibration = [sample.text for sample in repo.suite_samples(session, suite.id, run.suite_version)
                       if sample.key not in scored]
    baseline = session.get(OptimizationConfig, run.baseline_config_id)
    order = {key: i for i, key in enumerate(run.sample_keys)}
    settings = suite.settings
    return Job(
        run_id=run.id,
        project=session.get(Project, run.project_id).name,
        trigger=run.trigger,
        is_baseline=config_run.config_id == run.baseline_config_id,
        config_id=config_run.config_id,
        spec=spec,
        baseline_spec=OptimizationSpec.model_validate(baseline.spec) if baseline is not None else spec,
        calibration=calibration,
        suite_version=run.suite_version,
        model_path=config_run.config.model.path,
        suite=settings,
        # in the run's order: a top-up (workers/top_up.py) appends its documents after those drawn first
        samples=tuple(sorted(((sample.key, sample.text, sample.cluster or sample.key) for sample in
                              repo.suite_samples(session, suite.id, run.suite_version, run.sample_keys)),
                             key=lambda sample: order[sample[0]])),
        # a top-up that doubled the samples doubles the prompts too, the first pass's staying first
        prompts=round(settings.generation.prompts * len(run.sample_keys) / max(1, run.n_samples)),
    )


class _BaselineScorer:
    """The run's baseline model scoring generated text teacher-forced (gen_nll_ratio): the NLL of
    an output is that of prompt + output minus that of the prompt alone, both by the engine's
    rolling log-likelihood (echo log-probs over HTTP), so it needs no new engine method. An
    engine that cannot score text (a server without prompt log-probs) scores nothing, once, and
    the run says so instead of failing the config-run."""

    def __init__(self, engine):
        self.engine = engine
        self.error: str | None = None
        self._read: dict[str, RollingResult] = {}  # text → its rolling result: each prompt, and each output, read once

    def score(self, generations, prompts: dict[str, str], window: WindowSpec) -> list[tuple]:
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
            requests = [RollingRequest(str(i), t, window) for i, t in enumerate(todo)]
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
            read = Scored(tuple(full.token_ids[start:]), tuple(full.logprobs[start:]))
            n = len(read.ids)
            out.append((full.nll - prompt.nll, n, read) if n > 0 else (None, None, read))
        return out


def _records(kind, generations, judge: _BaselineScorer, prompts: dict[str, str], window: WindowSpec,
             keep_ids: bool) -> list[dict]:
    """Rows of a pass beside the main one (the baseline's second pass, the prompts sent alone),
    each output read by the baseline model as the main pass's are."""
    return [replace(kind.from_result(generation, prompts[generation.request_id], keep_ids), baseline_nll=nll,
                    baseline_nll_tokens=n, scored=read).to_row()
            for generation, (nll, n, read) in zip(generations, judge.score(generations, prompts, window), strict=True)]


def _concurrency(engine, spec: OptimizationSpec, generation: GenerationSettings, judge: _BaselineScorer | None) -> int:
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


def _timings(generations) -> dict[str, tuple[float, float | None]]:
    """(TTFT, time per output token after the first) of each request, in ms."""
    return {g.request_id: (g.ttft_ms, sum(g.itl_ms) / len(g.itl_ms) if g.itl_ms else None) for g in generations}


def _baseline_scorer(engine, job: Job) -> _BaselineScorer:
    """The engine's own for the baseline config; else the baseline config's engine (cached beside
    this one: a second model in memory while the run's configs execute)."""
    baseline: OptimizationSpec = job.baseline_spec
    if baseline == job.spec:
        return _BaselineScorer(engine)
    if baseline.engine == "openai":
        from workers.outbound import check_engine

        check_engine(baseline, job.project)
        return _BaselineScorer(get_engine(job.model_path, baseline))
    return _BaselineScorer(get_engine(str(loadable_model(job)), baseline))


def _server_figures(server_stats: list[ServerStats], spec: SpecStats, dedicated: bool, foreign: int) -> ServerFigures:
    """A serving process's own gauges, each at its peak over the run's generate calls, and its
    spec-decode counter deltas summed over them."""
    return ServerFigures(metrics_url=server_stats[-1].metrics_url,
                         max_kv_cache_usage=_peak([batch.max_kv_cache_usage for batch in server_stats]),
                         max_num_requests_waiting=_peak([batch.max_num_requests_waiting for batch in server_stats]),
                         max_num_requests_running=_peak([batch.max_num_requests_running for batch in server_stats]),
                         spec=SpecFigures.from_stats(spec) if spec.num_drafts else None, dedicated=dedicated,
                         foreign_traffic_batches=foreign)


def _peak(values: list[float | None]) -> float | None:
    """The highest known value; None when no source knew it."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


class _LostLease(RuntimeError):
    def __init__(self, config_run_id: int, attempt: int):
        super().__init__(f"config-run {config_run_id}: attempt {attempt} lost its lease to a newer attempt")


def reset_engine_cache() -> None:
    _ENGINES.clear()


execute_config_run = ExecuteConfigRun()

__all__ = ["execute_config_run", "percentile", "reset_engine_cache"]
