"""Top up an undecided run (docs/scorers.md, "Verdict rule": a fault at or above its threshold must be flagged). A
comparison whose CI straddles the warn threshold, or that has fewer paired samples than its
min_n, is `inconclusive`: the data cannot tell, and the answer is more samples (evals/stats.py).
So the aggregation does not stop there. It draws as many documents again as the run holds
(doubling), appends them to the run's samples, and queues the baseline and each undecided config
again: each scores only the samples it does not hold yet (workers/job.py `recorded`: the documents
and the prompts added), and only with the producers of what is undecided (the documents' for a
perplexity metric, the prompts' for an answer's), so a top-up pass costs what its new samples
cost. A comparison of the other producer stays on the samples it had. A config already
critical, or a measurement error, on some metric is not undecided: it fails the run whatever more
samples would say of its other metrics. The configs that were decided keep their results; every
comparison pairs by sample, so theirs stay as they were. The run, and a gate on it, wait; the last
aggregation judges on the larger sample and its reason says how far the run was topped up.

How far: the suite's `max_samples` when it sets one; otherwise by default up to TOP_UP_FACTOR ×
its samples, while the run's age (queue wait included) plus the next pass's estimate (each rerun
config's last pass, per sample, times the samples to add) stays within CANARY_TOP_UP_BUDGET_S.
Both within the suite's documents and the per-run limit. `top_up: false` turns it off. A
comparison whose rule says it needs more samples than that limit leaves (evals/stats.py: about so
many at its effect) is not topped up for: a pass could not settle it.

What it costs: each pass scores the undecided configs on the samples added (their serving
figures cover that pass), and stops once every gated comparison is decided or nothing is left to
draw. Each top-up is one more look at the data, uncorrected: a null config near its threshold
gets more chances to cross it, and a real regression just past warn more chances to be judged
ok (docs/scorers.md, "Verdict rule", says what the detection benchmark does and does not measure of this).

New documents come from those the run has not drawn, by a seed of their own (the run's seed and
its size), kept in suite order after the samples already drawn, so the prompts of the first pass
stay the first prompts of the next. When a config of the run quantizes with AWQ (calibrated on
the documents its first draw did not take, less those a labelled item is cut from: the same in every
pass, calibration_keys) the first quarter of them is never drawn by a top-up (kept_for_calibration).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any, NamedTuple

from sqlalchemy.orm import Session

from app import repo
from app.models import Run, Suite, utcnow
from app.settings import get_settings
from evals.stats import TOO_FEW
from vocabulary.comparison import Comparison
from vocabulary.figures import MIXED
from vocabulary.metrics import counted_by, grows_with_samples, informational, rule_samples
from vocabulary.suite import TOP_UP_FACTOR
from workers import step_back

log = logging.getLogger(__name__)
STRADDLES = "straddles warn"  # evals.stats.decide's rule for a CI across the warn threshold
SETTLED = ("critical", "measurement_error")  # a config with one of these needs no more samples


def undecided(row: Comparison) -> bool:
    """A gated comparison that more samples could decide: inconclusive with some paired samples,
    its CI across the warn threshold or its n below min_n (not one that had nothing to score), on a
    metric whose n grows with the documents drawn (not the labelled items, nor the suite's first
    few documents that the distribution and decode-step signals read: vocabulary.metrics.counted_by)."""
    if row.verdict != "inconclusive" or not row.n or informational(row) or not grows_with_samples(row.metric):
        return False
    rule = row.rule or ""
    return STRADDLES in rule or TOO_FEW in rule


def reachable(row: Comparison, have: int, most: int) -> bool:
    """Whether the samples its rule says would decide it (vocabulary.metrics.rule_samples: its min_n while
    below it, else about so many at its effect), scaled from its n to the run's samples (`have`:
    prompts are a share of them), fit within the `most` the run may hold. A comparison that needs
    thousands where the run may hold hundreds stays undecided without a pass that cannot settle
    it; one whose rule names no figure is tried."""
    need = rule_samples(row.rule, min_n_first=True)
    return need is None or not row.n or math.ceil(need * have / row.n) <= most


def cap(run: Run, suite: Suite) -> int:
    """The most samples the suite lets a run hold: its max_samples, else TOP_UP_FACTOR × the run's
    first draw; the samples drawn already when it turns top-ups off."""
    settings = suite.settings
    if not settings.top_up:
        return len(run.sample_keys)
    return settings.max_samples or TOP_UP_FACTOR * run.n_samples


def calibrates_on_the_suite(spec: Mapping[str, Any] | None) -> bool:
    """Whether a config (its stored spec) quantizes with AWQ on the suite's own documents, not a
    checkpoint quantized already."""
    return (spec or {}).get("weights") == "awq-int4" and not (spec or {}).get("checkpoint")


def calibrates(run: Run) -> bool:
    """Whether a config of the run calibrates on the suite: then the run keeps documents aside for
    its calibration (calibration_keys)."""
    return any(calibrates_on_the_suite(cr.config.spec) for cr in run.config_runs)


QUOTE_CHARS = 40  # a labelled item's prompt of this many characters or more, found in a document, quotes it


def quoted_documents(documents: Iterable[tuple[str, str]], prompts: Iterable[str]) -> frozenset[str]:
    """The keys of the documents (key, text) that hold a labelled item's prompt of QUOTE_CHARS
    characters or more: an item cut from a suite document (builtin:pydoc-next-word cuts each from
    a held-out document, its answer the word that follows there) is answered from that text, so a
    model calibrated on it would have seen the items' answers."""
    quotes = [prompt for prompt in prompts if len(prompt) >= QUOTE_CHARS]
    return frozenset(key for key, text in documents if any(quote in text for quote in quotes)) if quotes \
        else frozenset()


def suite_quotes(session: Session, suite: Suite, version: str) -> frozenset[str]:
    """quoted_documents of the suite version, by the items its labelled scorer asks (none when it
    does not run)."""
    settings = suite.settings
    if not settings.runs("labelled"):
        return frozenset()
    items = repo.suite_samples(session, suite.id, version, items=True)[: settings.labelled.max_items]
    documents = repo.suite_samples(session, suite.id, version)
    return quoted_documents(((d.key, d.text) for d in documents), (item.text for item in items))


def calibration_keys(run: Run, keys: list[str], quoted: frozenset[str] = frozenset()) -> list[str]:
    """The documents a run's AWQ configs calibrate on (workers/job.py): the suite version's `keys`
    its first draw did not take and no labelled item quotes (`quoted`: suite_quotes), in suite
    order. The same in every pass of the run, so a top-up pass scores the model the first pass
    measured. Empty when no config calibrates."""
    if not calibrates(run):
        return []
    first = set(run.sample_keys[: run.n_samples])
    return [key for key in keys if key not in first and key not in quoted]


def kept_for_calibration(run: Run, keys: list[str], quoted: frozenset[str] = frozenset()) -> list[str]:
    """The first quarter of the suite (at least one document) of calibration_keys, which a top-up
    never draws: the calibration reads its texts from the front until it has its tokens
    (engines/reference/weights.py calibration_ids), so on a corpus where a quarter holds them no
    pass scores a document its model was calibrated on. A calibration that reads further (more
    calibration tokens than a quarter of the corpus holds) may read documents a top-up drew."""
    return calibration_keys(run, keys, quoted)[: max(1, len(keys) // 4)]


def room(run: Run, suite: Suite, keys: list[str], quoted: frozenset[str] = frozenset()) -> int:
    """How many samples the run may hold in all: cap(), within the run's suite version's
    documents (`keys`, less those kept for AWQ calibration when a config needs them) and the
    per-run limit."""
    if cap(run, suite) <= len(run.sample_keys):
        return len(run.sample_keys)
    documents = len(keys) - len(kept_for_calibration(run, keys, quoted))
    return max(len(run.sample_keys), min(cap(run, suite), documents, get_settings().max_samples_per_run))


def next_pass_seconds(run: Run, config_ids: list[int], added: int) -> float:
    """About how long the next pass takes on one worker: each config's last pass, per sample of
    the run's first draw (a later pass scored at least as many), times the samples to add."""
    seconds = 0.0
    for cr in run.config_runs:
        if cr.config_id in config_ids and cr.started_at is not None and cr.finished_at is not None:
            seconds += (_aware(cr.finished_at) - _aware(cr.started_at)).total_seconds()
    return seconds * added / max(1, run.n_samples)


def over_budget(run: Run, suite: Suite, config_ids: list[int], added: int) -> str:
    """Why a default top-up would not fit CANARY_TOP_UP_BUDGET_S ('' when it fits): the run's age
    plus the next pass's estimate must stay within it. A suite's own max_samples is always
    honoured."""
    if suite.settings.max_samples:
        return ""
    age = (utcnow() - _aware(run.created_at)).total_seconds()
    estimate = next_pass_seconds(run, config_ids, added)
    budget = get_settings().top_up_budget_s
    if age + estimate <= budget:
        return ""
    return (f"another pass (about {_seconds(estimate)} s) would take the run, {_seconds(age)} s old, past its "
            f"top-up budget of {_seconds(budget)} s (CANARY_TOP_UP_BUDGET_S; or set the suite's max_samples)")


def _seconds(x: float) -> str:
    """Whole seconds from 10 s up, two significant figures below (1800, 42, 2.3, 0.001)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _aware(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def draw_more(run: Run, keys: list[str], n: int, quoted: frozenset[str] = frozenset()) -> list[str]:
    """n of the run's suite version's `keys` that the run has not drawn, nor keeps for calibration:
    a seed of their own (the run's seed and its size, so each top-up draws afresh), kept in suite
    order."""
    drawn = set(run.sample_keys) | set(kept_for_calibration(run, keys, quoted))
    remaining = [key for key in keys if key not in drawn]
    n = min(n, len(remaining))
    picked = set(random.Random(f"top-up:{run.seed}:{len(run.sample_keys)}").sample(range(len(remaining)), n))
    return [key for i, key in enumerate(remaining) if i in picked]


class TopUp(NamedTuple):
    """What plan decided: the new config-runs' ids (empty: judge the run as it is), and, when a
    default top-up was wanted but does not fit the time budget, the run reason's clause saying so."""

    execute: list[int]
    refused: str = ""


def plan(session: Session, run: Run, suite: Suite | None, rows: list[Comparison]) -> TopUp:
    """Top the run up when a candidate is undecided and the suite allows more samples: the new
    config-runs (the baseline's and each undecided config's), else none (judge as it is)."""
    if suite is None or not suite.settings.top_up:
        return TopUp([])
    configs = {cr.config_id: cr for cr in run.config_runs}
    # a config already critical (or a measurement error) fails the run whatever more samples say
    settled = {r.config_id for r in rows if r.verdict in SETTLED and not informational(r)}
    keys = [sample.key for sample in repo.suite_samples(session, suite.id, run.suite_version)]
    quoted = suite_quotes(session, suite, run.suite_version) if calibrates(run) else frozenset()
    have, most = len(run.sample_keys), room(run, suite, keys, quoted)
    asked = [r for r in rows if r.config_id is not None and r.config_id != run.baseline_config_id
             and r.config_id not in settled and undecided(r) and reachable(r, have, most)
             and not step_back.is_ablation(configs[r.config_id].config)]
    waiting = sorted({r.config_id for r in asked if r.config_id is not None})
    if not waiting:
        return TopUp([])
    new_keys = draw_more(run, keys, min(2 * have, most) - have, quoted)
    if not new_keys:
        return TopUp([])
    # a stacked config that breaches steps back once the run is decided: it reruns too, so that it
    # and its single-optimization ablations are measured on the same samples
    stacked = sorted(cr.config_id for cr in run.config_runs
                     if cr.config_id not in waiting and step_back.would_step_back(run, cr, rows))
    names = ", ".join(configs[c].config.name for c in waiting)
    refused = over_budget(run, suite, [run.baseline_config_id, *waiting, *stacked], len(new_keys))
    if refused:
        log.info("run %s: %s undecided at %d samples; not topped up: %s", run.id, names, have, refused)
        # a budget of 0 turns default top-ups off for the deployment: nothing to say per run
        return TopUp([], f"; not topped up for {names}: {refused}" if get_settings().top_up_budget_s else "")
    log.info("run %s: %s undecided at %d samples; topping up to %d", run.id, names, have, have + len(new_keys))
    # only the producers of what is undecided score the samples added (a stacked config's ablations
    # will need every producer's rows on them: then all of them)
    return TopUp(repo.top_up_run(session, run, new_keys, [run.baseline_config_id, *waiting, *stacked],
                                 scorers=None if stacked else pass_scorers(asked)))


def pass_scorers(asked: list[Comparison]) -> list[str]:
    """The suite scorers whose producers a top-up pass runs: the documents' (`perplexity`) for a
    metric of the documents, the prompts' (`generation`) for one of the prompts (what a judge,
    faithfulness and agreement read are the prompts' answers)."""
    return sorted({"perplexity" if counted_by(r.metric) is None else "generation" for r in asked})


def reason(run: Run, suite: Suite | None) -> str:
    """The run reason's clause for a topped-up run ('' when it was not)."""
    drawn = len(run.sample_keys)
    if drawn <= run.n_samples:
        return ""
    settings = suite.settings if suite is not None else None
    limit = f"max_samples {settings.max_samples}" if settings is not None and settings.max_samples else "by default"
    return f"; topped up from {run.n_samples} to {drawn} samples ({limit}) after an inconclusive pass"


PEAKS = ("kv_cache_usage", "peak_kv_cache_bytes", "peak_device_bytes")  # the larger of two passes'


def with_earlier(figures: dict[str, Any], earlier: dict[str, Any], documents: bool) -> dict[str, Any]:
    """A top-up pass's figures over its config's earlier passes' (workers/top_up.py): what this pass
    did not measure (None: a serving figure of a pass that generated nothing, the documents'
    figures of one that scored none) stays the earlier pass's; a peak is the larger of the two; the
    seconds are summed; the documents' count and perplexity are the earlier ones when this pass
    scored no document (the documents producer counts its earlier rows itself when it ran)."""
    merged = dict(figures)
    if earlier.get("config_digest") not in (None, figures.get("config_digest")):
        merged["config_digest"] = MIXED  # the config was edited between passes: its samples measured two definitions
    for name, value in earlier.items():
        if name in ("pass_scorers", "config_digest") or name not in merged:
            continue
        if name == "seconds" and value and merged[name]:  # the config-run's time over its passes
            merged[name] = {k: round(value.get(k, 0) + merged[name].get(k, 0), 2) for k in {**value, **merged[name]}}
        elif name in PEAKS and value is not None and merged[name] is not None:
            merged[name] = max(merged[name], value)
        elif merged[name] is None or (not documents and name in ("token_ppl", "n_documents", "n_tokens")):
            merged[name] = value
    return merged
