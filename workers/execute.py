"""Execute one config-run: claim it (an attempt with a lease: workers/lease.py), load the engine
for its config (cached per worker process: workers/engine_cache.py), loop over the suite's
producers (workers/producers/: documents, generation, labelled items, and any registered since),
write each batch of their raw per-sample rows idempotently, fenced by the attempt, and hand over
to aggregation when the run's last config finishes."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

from sqlalchemy.orm import Session

from app import repo
from app.db import is_transient
from app.dispatch import AGGREGATE_RUN, EXECUTE_CONFIG_RUN, Dispatcher, priority_of
from app.settings import Settings, get_settings
from engines.fingerprint import weights_digest
from engines.protocol import WindowSpec
from evals.run_stats import RunStats, percentile
from vocabulary.figures import RunFigures
from workers import baseline_reuse, engine_cache
from workers.base import BaseTask
from workers.engine_cache import reset_engine_cache
from workers.generation import concurrency
from workers.job import Job, load_job, loadable_model, served_model_tokenizer
from workers.lease import Attempt, LeaseKeeper, LostLease, claim
from workers.producers import Work, producers_for
from workers.top_up import with_earlier

log = logging.getLogger(__name__)


class ExecuteConfigRun(BaseTask):
    """One config-run on this worker's GPU. Its result says what became of it: succeeded,
    failed (recorded on the config-run), interrupted (the database stayed away; the reconciler
    re-sends it), superseded (a newer attempt holds it) or skipped (gone, finished, or leased)."""

    name = EXECUTE_CONFIG_RUN
    failure_results = frozenset({"failed", "interrupted"})

    def run_impl(self, config_run_id: int, *, dispatcher: Dispatcher) -> str:
        settings = get_settings()
        # this message is a turn on the GPU: another project's queued config-run may deserve it more
        picked = self.transaction(lambda session: repo.fair_pick(session, config_run_id),
                                  f"pick for config-run {config_run_id}")
        # the claim commits on its own, before anything can fail
        attempt, run_id, gave_up = self.transaction(lambda session: claim(session, picked, settings),
                                                    f"claim config-run {picked}")
        if picked != config_run_id and attempt is None and not gave_up:  # another worker took it first
            attempt, run_id, gave_up = self.transaction(lambda session: claim(session, config_run_id, settings),
                                                        f"claim config-run {config_run_id}")
        if run_id is None or (attempt is None and not gave_up):
            return "skipped"  # gone, finished, or another worker holds a live lease
        outcome = "failed" if attempt is None else self._attempt(attempt, settings)
        if outcome in ("superseded", "interrupted"):
            return outcome

        def start_aggregation(session: Session) -> str | None:  # the run's trigger when this attempt won, else None
            return repo.run_trigger(session, run_id) if repo.try_start_aggregation(session, run_id) else None

        trigger = self.transaction(start_aggregation, f"aggregation trigger of run {run_id}")
        if trigger is not None:  # after the commit: the task must see every config-run finished
            dispatcher.send(AGGREGATE_RUN, run_id, priority=priority_of(trigger))
        return outcome

    def _attempt(self, attempt: Attempt, settings: Settings) -> str:
        """The attempt's work under its lease, renewed from here on by a thread of this process
        whatever the task is doing (model load, calibration, a long batch), until it ends."""
        with LeaseKeeper(attempt, settings.lease_seconds) as lease:
            try:
                job = self.transaction(lambda session: load_job(session, attempt.config_run_id),
                                       f"load config-run {attempt.config_run_id}")
                self._run_engine(attempt, job, settings, lease)
                return "succeeded"
            except LostLease as e:
                log.warning("%s", e)
                return "superseded"
            except Exception as e:  # noqa: BLE001 - every failure of an attempt is recorded on the config-run
                if is_transient(e):  # the database stayed away: the reconciler re-sends it once the lease is free
                    log.error("%s interrupted, the database is unreachable (%s)", attempt, type(e).__name__)
                    lease.stop()
                    self._note_interruption(attempt, settings,
                                            f"the database was unreachable for longer than CANARY_DB_RETRY_SECONDS "
                                            f"({settings.db_retry_seconds:g} s; {type(e).__name__})")
                    return "interrupted"
                # the config-run fails with its reason; other configs are untouched
                log.error("config-run %s failed: %s", attempt.config_run_id, traceback.format_exc())
                reason = f"{type(e).__name__}: {e}"
                self.transaction(lambda session: attempt.finish(session, "failed", error=reason),
                                 f"record the failure of config-run {attempt.config_run_id}")
                return "failed"

    def _note_interruption(self, attempt: Attempt, settings: Settings, why: str) -> None:
        """An attempt that lets go of a config-run while its process lives says why and frees the lease,
        so the reconciler re-sends it at once. The database was just unreachable: a daemon thread keeps
        trying for one lease's length; the note is fenced by the attempt (a later claim clears it)."""
        def keep_trying() -> None:
            try:
                self.transaction(lambda session: attempt.release(session, why),
                                 f"note the interruption of config-run {attempt.config_run_id}",
                                 deadline_s=max(settings.lease_seconds, settings.db_retry_seconds))
            except Exception as e:  # noqa: BLE001 - best effort: the lease runs out on its own
                log.warning("%s: could not note its interruption (%s)", attempt, type(e).__name__)

        threading.Thread(target=keep_trying, name=f"release-{attempt.config_run_id}-{attempt.number}",
                         daemon=True).start()

    def _run_engine(self, attempt: Attempt, job: Job, settings: Settings, lease: LeaseKeeper | None = None) -> None:
        """Run the config's engine over the run's documents (log-likelihoods) and prompts
        (generations), writing each batch's rows fenced by the attempt, then finish the config-run
        with its serving and memory figures."""
        spec = job.spec
        # a served model (engine openai) is named, not a path
        if spec.engine == "openai":  # URLs and the key's name pass the outbound policy again, at use
            from workers.outbound import check_engine

            check_engine(spec, job.project)
        model, digest = job.model_path, None
        if spec.engine != "openai":  # local files: the checked real paths, the draft's in the spec it loads with
            path, spec = loadable_model(job)
            model, digest = str(path), weights_digest(path)  # hashed once per process and file
        # a baseline's inputs key: a later gate on the same samples may take its rows (computed only
        # for baselines, the only source of reuse: the first call in a process hashes the model's files)
        key = baseline_reuse.inputs_key(job) if job.is_baseline and settings.gate_reuse_baseline else None
        # a top-up pass adds to the rows the config holds: it never takes another run's in their place
        if key is not None and job.trigger == "gate" and job.earlier is None \
                and baseline_reuse.reuse(self.transaction, attempt, job, key, settings.lease_seconds):
            return
        loading = time.perf_counter()  # ~0 for a cached engine; a cold AWQ config's search included
        engine = engine_cache.get_engine(model, spec, job.calibration,
                                         served_model_tokenizer(job) if spec.engine == "openai" else None)
        seconds = {"engine": round(time.perf_counter() - loading, 2)}
        engine.reset_peaks()  # a cached engine's peaks from earlier runs are not this run's
        ppl = job.suite.perplexity
        work = Work(job, engine, WindowSpec(max_length=ppl.window, stride=ppl.stride or ppl.window),
                    attempt.config_run_id, RunStats(dedicated=bool(spec.option("dedicated_server"))),
                    check_lease=lease.check if lease is not None else (lambda: None))
        # requests in flight at once (the generation producer's figure when it ran), told before any request
        step = concurrency(engine, spec, job.suite.generation, None)
        if job.recorded:
            work.notes.append(f"a top-up pass: it scored only the samples the run added ({len(job.samples)} in "
                              "all now); the serving figures it measured are this pass's, the rest the earlier "
                              "pass's (peaks the larger)")
        produced = self._produce(work, attempt, settings, seconds)
        description = engine.describe()
        figures = RunFigures(
            engine=description.engine, weights=description.weights, kv_cache=description.kv_cache,
            speculative=description.speculative, device=description.device, compute_dtype=description.compute_dtype,
            parameters=description.parameters, weight_bytes=description.weight_bytes,
            kv_bytes_per_token=description.kv_bytes_per_token, versions=dict(description.versions),
            resident_weight_bytes=description.resident_weight_bytes,
            peak_kv_cache_bytes=description.peak_kv_cache_bytes, peak_device_bytes=description.peak_device_bytes,
            notes=[*description.notes, *work.notes],
            **{"token_ppl": None, "n_documents": len(job.samples), "n_tokens": 0, "baseline_scoring_error": None,
               "concurrency": step, **produced},
            **work.stats.figures(description.kv_cache_usage),
            inputs_key=key, model_digest=digest, config_digest=job.config_digest,
        ).to_json()
        figures = figures if job.earlier is None else with_earlier(figures, job.earlier, job.runs("perplexity"))
        self.transaction(lambda session: attempt.finish_or_stop(session, "succeeded", figures=figures),
                         f"finish config-run {attempt.config_run_id}")

    def _produce(self, work: Work, attempt: Attempt, settings: Settings, seconds: dict[str, float]) -> dict[str, Any]:
        """Run the suite's producers in order (workers/producers/), each batch written fenced by the
        attempt after a check of the lease; returns the figures they measured, and in `seconds` (beside
        the engine's) each producer's wall time, its writes included."""
        producers = producers_for(work)
        work.total = sum(producer.total() for producer in producers)
        figures: dict[str, Any] = {}
        for producer in producers:
            batches, started = producer.batches(), time.perf_counter()
            while True:
                work.check_lease()  # before each engine call: a superseded attempt stops here
                batch = next(batches, None)
                if batch is None:
                    break
                work.done += batch.progress
                self._write_fenced(work, attempt, batch.rows, settings)
            figures |= producer.figures()
            seconds[producer.scorer] = round(time.perf_counter() - started, 2)
        return figures | {"seconds": seconds}

    def _write_fenced(self, work: Work, attempt: Attempt, rows: list[dict], settings: Settings) -> None:
        """One transaction: record progress and renew the lease (fenced by the attempt number), then
        write the rows. If a newer attempt holds the run, nothing is written. Retried as a unit
        while the database is away."""
        def write(session: Session) -> None:
            attempt.heartbeat_or_stop(session, settings.lease_seconds, work.done, work.total)
            repo.write_sample_results(session, work.job.run_id, work.job.config_id, rows)

        self.transaction(write, f"write results of config-run {attempt.config_run_id}")


execute_config_run = ExecuteConfigRun()

__all__ = ["execute_config_run", "percentile", "reset_engine_cache"]
