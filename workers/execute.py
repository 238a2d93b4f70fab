"""Execute one config-run: claim it (an attempt with a lease: workers/lease.py), load the engine
for its config (cached per worker process: workers/engine_cache.py), run it over the run's
documents and prompts, write raw per-sample results idempotently, fenced by the attempt, and
hand over to aggregation when the run's last config finishes."""

from __future__ import annotations

import logging
import math
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from app import repo
from app.db import is_transient
from app.dispatch import AGGREGATE_RUN, EXECUTE_CONFIG_RUN, Dispatcher, priority_of
from app.settings import get_settings
from engines.openai import NoDistributions
from engines.protocol import (
    GenerationRequest,
    GivesDistributions,
    RollingRequest,
    WindowSpec,
    gives_distributions,
    scores_decode,
)
from evals.distribution import TOP_K, doc_distribution, topk_rows
from evals.figures import RunFigures
from evals.labelled import LabelledItem, choice_correct, continuation_loglikelihood, generated_correct
from evals.positions import position_nll, position_totals
from evals.records import (
    DocDistribution,
    DocRecord,
    DocTopK,
    GenerationRecord,
    ItemRecord,
    RepeatRecord,
    SoloRecord,
    spec_to_json,
    tokens_digest,
)
from evals.run_stats import RunStats, percentile
from evals.terms import compile_terms, term_nll
from workers import baseline_reuse, engine_cache
from workers.base import BaseTask
from workers.engine_cache import reset_engine_cache
from workers.generation import BaselineScorer, baseline_scorer, concurrency, scored_rows, timings
from workers.job import Job, load_job, loadable_model, served_model_tokenizer
from workers.lease import Attempt, LeaseKeeper, LostLease, claim

log = logging.getLogger(__name__)
DOC_BATCH = 8  # documents per engine call; progress and a commit after each (the lease: LeaseKeeper)


def _distributions(engine, baseline, requests: list[RollingRequest]) -> list[DocDistribution | None]:
    """Per document, the candidate's whole next-token distributions against the baseline
    engine's (evals/distribution.py; both in-process); None for a document the two tokenize
    differently."""
    out: list[DocDistribution | None] = []
    for request in requests if baseline is not None else []:  # one document at a time: two [T, V] arrays live
        [(r, q)], [(b, p)] = engine.next_token_logprobs([request]), baseline.next_token_logprobs([request])
        d = doc_distribution(p, q, r.token_ids) if r.token_ids == b.token_ids else None
        # KLD by position in the window (evals/positions.py), as the perplexity ratio is kept
        out.append(replace(d, positions=position_totals(d.kld, request.window)) if d else None)
    return out


def _own_topk(engine, requests: list[RollingRequest]) -> list[DocTopK]:
    """Per document, the config's own top-k table (evals/records.py DocTopK): its whole
    distributions cut to their top k in-process, or what a server returns (at most 20)."""
    out = []
    for request in requests:
        if isinstance(engine, GivesDistributions):
            [(result, rows)] = engine.next_token_logprobs([request])
            ids, logprobs = topk_rows(rows, TOP_K)
        else:
            [(result, ids, logprobs)] = engine.next_token_topk([request], TOP_K)
            ids, logprobs = np.asarray(ids), np.asarray(logprobs, np.float64)
        out.append(DocTopK(int(ids.shape[1]), tuple(int(x) for x in ids.ravel()),
                           tuple(float(x) for x in logprobs.ravel()), tuple(result.logprobs),
                           (request.window.max_length, request.window.stride), tokens_digest(result.token_ids)))
    return out


def answer_choices(engine, items: Sequence[LabelledItem], window: WindowSpec) -> list[ItemRecord]:
    """Multiple-choice items answered by log-likelihood, every choice of every item in one engine
    call (the reference engine packs them into batches): each choice's Σ log p after the prompt
    (evals/labelled.py continuation_loglikelihood)."""
    requests = [RollingRequest(f"{item.key}#{j}", item.prompt + choice, window)
                for item in items for j, choice in enumerate(item.choices)]
    results = iter(engine.loglikelihood_rolling(requests))
    rows = [[next(results) for _ in item.choices] for item in items]
    spanless = [item for item, row in zip(items, rows, strict=True) if any(not r.char_spans for r in row)]
    # a server's tokens have no place in the text: each choice's whole text less the prompt scored alone
    prompts = dict(zip((item.key for item in spanless), engine.loglikelihood_rolling(
        [RollingRequest(f"{item.key}#prompt", item.prompt, window) for item in spanless]), strict=True)) \
        if spanless else {}
    records = []
    for item, row in zip(items, rows, strict=True):
        scores = [continuation_loglikelihood(r, len(item.prompt), prompts.get(item.key)) for r in row]
        correct, chosen = choice_correct(item, scores)
        records.append(ItemRecord(item.key, correct, str(chosen), tuple(scores)))
    return records


@dataclass
class _Pass:
    """One attempt's work in progress: its engine, what it writes rows with, and its counts."""

    attempt: Attempt
    job: Job
    engine: Any  # an engines.protocol.Engine
    window: WindowSpec
    keep_ids: bool  # top-1 and exact-match agreement pair token ids with the baseline's
    total: int  # rows of progress in all: documents, then prompts
    check_lease: Callable[[], None]  # raises LostLease once a newer attempt holds the config-run
    done: int = 0
    notes: list[str] = field(default_factory=list)  # said with the config-run's figures


class ExecuteConfigRun(BaseTask):
    """One config-run on this worker's GPU. Its result says what became of it: succeeded,
    failed (recorded on the config-run), interrupted (the database stayed away; the reconciler
    re-sends it), superseded (a newer attempt holds it) or skipped (gone, finished, or leased)."""

    name = EXECUTE_CONFIG_RUN
    failure_results = frozenset({"failed", "interrupted"})

    def run_impl(self, config_run_id: int, *, dispatcher: Dispatcher) -> str:
        settings = get_settings()
        # the claim commits on its own, before anything can fail
        attempt, run_id, gave_up = self.transaction(lambda session: claim(session, config_run_id, settings),
                                                    f"claim config-run {config_run_id}")
        if run_id is None or (attempt is None and not gave_up):
            return "skipped"  # gone, finished, or another worker holds a live lease
        outcome = "failed" if attempt is None else self._attempt(attempt, settings)
        if outcome in ("superseded", "interrupted"):
            return outcome

        def start_aggregation(session) -> str | None:  # the run's trigger when this attempt won, else None
            return repo.run_trigger(session, run_id) if repo.try_start_aggregation(session, run_id) else None

        trigger = self.transaction(start_aggregation, f"aggregation trigger of run {run_id}")
        if trigger is not None:  # after the commit: the task must see every config-run finished
            dispatcher.send(AGGREGATE_RUN, run_id, priority=priority_of(trigger))
        return outcome

    def _attempt(self, attempt: Attempt, settings) -> str:
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

    def _note_interruption(self, attempt: Attempt, settings, why: str) -> None:
        """An attempt that lets go of a config-run while its process lives says why, and frees the
        lease so the reconciler re-sends it without waiting for the lease to run out. The database
        was just unreachable, so a daemon thread keeps trying for one lease's length; the note is
        fenced by the attempt (a later claim clears it) and names the cause if the config-run is
        given up."""
        def keep_trying() -> None:
            try:
                self.transaction(lambda session: attempt.release(session, why),
                                 f"note the interruption of config-run {attempt.config_run_id}",
                                 deadline_s=max(settings.lease_seconds, settings.db_retry_seconds))
            except Exception as e:  # noqa: BLE001 - best effort: the lease runs out on its own
                log.warning("%s: could not note its interruption (%s)", attempt, type(e).__name__)

        threading.Thread(target=keep_trying, name=f"release-{attempt.config_run_id}-{attempt.number}",
                         daemon=True).start()

    def _run_engine(self, attempt: Attempt, job: Job, settings, lease: LeaseKeeper | None = None) -> None:
        """Run the config's engine over the run's documents (log-likelihoods) and prompts
        (generations), writing each batch's rows fenced by the attempt, then finish the config-run
        with its serving and memory figures."""
        spec = job.spec
        # a served model (engine openai) is named, not a path
        if spec.engine == "openai":  # URLs and the key's name pass the outbound policy again, at use
            from workers.outbound import check_engine

            check_engine(spec, job.project)
        model = job.model_path
        if spec.engine != "openai":  # local files: the checked real paths, the draft's in the spec it loads with
            path, spec = loadable_model(job)
            model = str(path)
        # a baseline's inputs key: a later gate on the same samples may take its rows (computed only
        # for baselines, the only source of reuse: the first call in a process hashes the model's files)
        key = baseline_reuse.inputs_key(job) if job.is_baseline and settings.gate_reuse_baseline else None
        if key is not None and job.trigger == "gate" and baseline_reuse.reuse(self.transaction, attempt, job, key,
                                                                                settings.lease_seconds):
            return
        engine = engine_cache.get_engine(model, spec, job.calibration,
                                         served_model_tokenizer(job) if spec.engine == "openai" else None)
        engine.reset_peaks()  # a cached engine's peaks from earlier runs are not this run's
        ppl, scorers = job.suite.perplexity, job.suite.scorers
        n_prompts = min(job.prompts, len(job.samples)) if "generation" in scorers else 0
        work = _Pass(attempt, job, engine, WindowSpec(max_length=ppl.window, stride=ppl.stride or ppl.window),
                     "agreement" in scorers, len(job.samples) + n_prompts + len(job.items),
                     check_lease=lease.check if lease is not None else (lambda: None))
        nll_sum, n_tokens = self._score_documents(work, settings)
        stats = RunStats(dedicated=bool(spec.option("dedicated_server")))
        judge, step = self._generate(work, n_prompts, stats, settings)
        self._answer_items(work, settings)
        description = engine.describe()
        figures = RunFigures(
            engine=description.engine, weights=description.weights, kv_cache=description.kv_cache,
            speculative=description.speculative, device=description.device, compute_dtype=description.compute_dtype,
            parameters=description.parameters, weight_bytes=description.weight_bytes,
            kv_bytes_per_token=description.kv_bytes_per_token, versions=dict(description.versions),
            resident_weight_bytes=description.resident_weight_bytes,
            peak_kv_cache_bytes=description.peak_kv_cache_bytes, peak_device_bytes=description.peak_device_bytes,
            notes=[*description.notes, *work.notes],
            token_ppl=math.exp(nll_sum / n_tokens) if n_tokens else None,
            n_documents=len(job.samples), n_tokens=n_tokens, concurrency=step,
            **stats.figures(description.kv_cache_usage),
            baseline_scoring_error=judge.error if judge is not None else None,
            inputs_key=key,
        ).to_json()
        self.transaction(lambda session: attempt.finish_or_stop(session, "succeeded", figures=figures),
                         f"finish config-run {attempt.config_run_id}")

    def _score_documents(self, work: _Pass, settings) -> tuple[float, int]:
        """The documents' rolling log-likelihoods, DOC_BATCH at a time; (Σ NLL, Σ tokens)."""
        term_pattern = compile_terms(work.job.suite.perplexity.terms)  # the suite's domain terms (term_nll_ratio)
        samples = work.job.samples
        # the first documents again, one token per decode step through a lossy KV cache (decode_nll_ratio)
        n_decode = work.job.suite.perplexity.decode_samples if scores_decode(work.engine) else 0
        # next-token distributions (kld_mean): a candidate's whole ones against the baseline engine's,
        # else this config-run's own top-k table, compared with the baseline's stored one at aggregation
        n_dist, baseline = self._distribution_baseline(work)
        n_topk = self._topk_documents(work, baseline)
        nll_sum, n_tokens = 0.0, 0
        for i in range(0, len(samples), DOC_BATCH):
            documents = samples[i : i + DOC_BATCH]
            work.check_lease()
            requests = [RollingRequest(key, text, work.window) for key, text, _ in documents]
            results = work.engine.loglikelihood_rolling(requests)
            decoded = work.engine.loglikelihood_decode(requests[: max(0, n_decode - i)]) if n_decode > i else []
            distributions = _distributions(work.engine, baseline, requests[: max(0, n_dist - i)])
            try:
                tables = _own_topk(work.engine, requests[: max(0, n_topk - i)])
            except NoDistributions as e:  # a server that cannot give them (llama-cpp-python: text prompts only);
                # a server error (5xx) fails the pass as the echo for perplexity would, rather than leave
                # every candidate of the run without kld_mean
                log.warning("config-run %s stores no next-token top-k: %s", work.attempt.config_run_id, e)
                work.notes.append(f"no next-token distributions (kld_mean): {e}")
                tables, n_topk = [], 0
            rows = []
            for j, (doc, (_, text, cluster)) in enumerate(zip(results, documents, strict=True)):
                nll_sum += doc.nll
                n_tokens += len(doc.token_ids)
                terms = term_nll(text, doc.logprobs, doc.char_spans, term_pattern) if term_pattern else None
                positions = position_nll(doc.logprobs, work.window)  # quality by position (evals/positions.py)
                decode = ((decoded[j].nll, position_nll(decoded[j].logprobs, work.window))
                          if j < len(decoded) else None)
                rows.append(DocRecord.from_result(doc, cluster, work.keep_ids, terms, positions, decode,
                                                  distributions[j] if j < len(distributions) else None,
                                                  tables[j] if j < len(tables) else None).to_row())
            work.done += len(documents)
            self._write_fenced(work, rows, settings)
        return nll_sum, n_tokens

    @staticmethod
    def _distribution_baseline(work: _Pass):
        """(how many documents, the baseline's engine) for a candidate whose whole next-token
        distributions are compared with the baseline engine's (both in-process); (0, None) where
        none are."""
        n = work.job.suite.perplexity.distribution_samples
        if not n or work.job.is_baseline or not isinstance(work.engine, GivesDistributions):
            return 0, None
        baseline = baseline_scorer(work.engine, work.job).engine
        return (n, baseline) if isinstance(baseline, GivesDistributions) else (0, None)

    @staticmethod
    def _topk_documents(work: _Pass, baseline) -> int:
        """How many documents this config-run stores its own top-k table for: the baseline's always
        (stored once, read by every candidate's aggregation and carried by a reused baseline), a
        candidate's where it has no whole distributions compared already."""
        n = work.job.suite.perplexity.distribution_samples
        if not n or not gives_distributions(work.engine) or (baseline is not None and not work.job.is_baseline):
            return 0
        return n

    def _generate(self, work: _Pass, n_prompts: int, stats: RunStats, settings) -> tuple[BaselineScorer | None, int]:
        """The prompts' generations, a batch (`step` requests in flight) at a time, each output read
        by the baseline model; then the batch-invariance probes. Returns (the baseline scorer, step).

        A candidate's prompts also run on the baseline engine, batch by batch, in alternating order
        (ABBA): the paired timings that ttft_ratio and tpot_ratio compare, and the baseline's second
        pass over the prompts (RepeatRecord), the noise floor that confident_divergence is judged beyond."""
        gen, engine = work.job.suite.generation, work.engine
        requests = [GenerationRequest(key, " ".join(text.split()[: gen.prompt_words]), gen.max_new_tokens,
                                      gen.temperature)
                    for key, text, _ in work.job.samples[:n_prompts]]
        prompts = {request.request_id: request.prompt for request in requests}
        judge = baseline_scorer(engine, work.job) if requests else None  # it scores every config's outputs
        step = concurrency(engine, work.job.spec, gen, judge)  # requests in flight at once (a batch)
        timing, floor = gen.paired_timing, gen.noise_floor
        repeat = judge is not None and judge.engine is not engine and (timing or floor)
        for batch_number, i in enumerate(range(0, len(requests), step)):
            work.check_lease()
            batch = requests[i : i + step]
            # (repeat implies a judge: `judge is not None` first, for the type checker)
            baseline_pass = (judge.engine.generate(batch) if judge is not None and repeat and batch_number % 2 == 0
                             else [])
            generations = engine.generate(batch)
            if judge is not None and repeat and batch_number % 2 == 1:
                baseline_pass = judge.engine.generate(batch)
            baseline_timing = timings(baseline_pass) if timing else {}
            rows = []
            for generation, (nll, n, read) in zip(generations, judge.score(generations, prompts, work.window) if judge
                                                  else [(None, None, None)] * len(generations), strict=True):
                stats.add(generation)
                record = GenerationRecord.from_result(generation, prompts[generation.request_id], work.keep_ids)
                base_ttft, base_tpot = baseline_timing.get(generation.request_id, (None, None))
                rows.append(replace(record, baseline_nll=nll, baseline_nll_tokens=n, paired_baseline_ttft_ms=base_ttft,
                                    paired_baseline_tpot_ms=base_tpot, scored=read, batch=batch_number).to_row())
            if floor and baseline_pass and judge is not None:
                rows += scored_rows(RepeatRecord, baseline_pass, judge, prompts, work.window, work.keep_ids)
            # a serving process's own figures over this batch (None in-process)
            batch_spec = stats.add_server(engine.server_stats(), generations)
            if batch_spec is not None:
                rows[0]["extra"]["spec"] = spec_to_json(batch_spec) | {"scope": "batch"}
            work.done += len(generations)
            self._write_fenced(work, rows, settings)
        # batch invariance: a few prompts again, each alone, against their answers inside a full batch
        probes = requests[: gen.solo_probes] if step > 1 and judge is not None else []
        if probes and judge is not None:
            work.check_lease()
            alone = [engine.generate([request])[0] for request in probes]
            self._write_fenced(work, scored_rows(SoloRecord, alone, judge, prompts, work.window, work.keep_ids),
                               settings)
        return judge, step

    def _answer_items(self, work: _Pass, settings) -> None:
        """The suite's labelled items (evals/labelled.py), DOC_BATCH at a time: a multiple-choice
        item by each choice's Σ log p after the prompt (the log-likelihood of prompt + choice less the
        prompt's own, as lm-eval's loglikelihood requests give it), any other by a greedy answer."""
        max_new_tokens = work.job.suite.labelled.max_new_tokens
        for i in range(0, len(work.job.items), DOC_BATCH):
            work.check_lease()
            batch = work.job.items[i : i + DOC_BATCH]
            asked = [item for item in batch if item.match != "choice"]  # generated together, as one batch
            answers = {answer.request_id: answer.text for answer in work.engine.generate(
                [GenerationRequest(item.key, item.prompt, max_new_tokens, 0.0) for item in asked])} if asked else {}
            chosen = iter(answer_choices(work.engine, [item for item in batch if item.match == "choice"], work.window))
            records = []
            for item in batch:
                if item.match == "choice":
                    records.append(next(chosen))
                else:
                    correct, read = generated_correct(item, answers[item.key])
                    records.append(ItemRecord(item.key, correct, read, output=answers[item.key]))
            work.done += len(batch)
            self._write_fenced(work, [record.to_row() for record in records], settings)

    def _write_fenced(self, work: _Pass, rows: list[dict], settings) -> None:
        """One transaction: record progress and renew the lease (fenced by the attempt number), then
        write the rows. If a newer attempt holds the run, nothing is written. Retried as a unit
        while the database is away."""
        def write(session) -> None:
            work.attempt.heartbeat_or_stop(session, settings.lease_seconds, work.done, work.total)
            repo.write_sample_results(session, work.job.run_id, work.job.config_id, rows)

        self.transaction(write, f"write results of config-run {work.attempt.config_run_id}")


execute_config_run = ExecuteConfigRun()

__all__ = ["execute_config_run", "percentile", "reset_engine_cache"]
