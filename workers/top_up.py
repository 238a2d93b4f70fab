"""Top up an undecided run (docs/scorers.md, "Verdict rule": a fault at or above its threshold must be flagged). A
comparison whose CI straddles the warn threshold, or that has fewer paired samples than its
min_n, is `inconclusive`: the data cannot tell, and the answer is more samples (evals/stats.py).
When the suite sets `max_samples`, the aggregation does not stop there. It draws as many
documents again as the run holds (doubling, up to `max_samples`, the suite's size and the
per-run limit), appends them to the run's samples, and queues the baseline and each undecided
config again on all of them. A config already critical, or a measurement error, on some metric
is not undecided: it fails the run whatever more samples would say of its other metrics. The
configs that were decided keep their results; every comparison pairs by sample, so theirs stay
as they were. The run, and a gate on it, wait; the last aggregation judges on the larger sample
and its reason says how far the run was topped up.

What it costs: each pass reruns the undecided configs on every sample (so their timings and
figures cover one pass), and stops once every gated comparison is decided or nothing is left to
draw. Each top-up is one more look at the data, uncorrected: a null config near its threshold
gets more chances to cross it, and a real regression just past warn more chances to be judged
ok (docs/scorers.md, "Verdict rule", says what the detection benchmark does and does not measure of this).

New documents come from those the run has not drawn, by a seed of their own (the run's seed and
its size), kept in suite order after the samples already drawn, so the prompts of the first pass
stay the first prompts of the next. When a config of the run quantizes with AWQ (calibrated on
the documents a run does not score) a quarter of the suite is never drawn by a top-up.
"""

from __future__ import annotations

import logging
import random

from sqlalchemy.orm import Session

from app import repo
from app.models import Run, Suite
from app.settings import get_settings
from evals.metrics import informational
from evals.records import engine_kinds
from evals.stats import TOO_FEW, Comparison
from workers import step_back

log = logging.getLogger(__name__)
STRADDLES = "straddles warn"  # evals.stats.decide's rule for a CI across the warn threshold
SETTLED = ("critical", "measurement_error")  # a config with one of these needs no more samples


def undecided(row: Comparison) -> bool:
    """A gated comparison that more samples could decide: inconclusive with some paired samples,
    its CI across the warn threshold or its n below min_n (not one that had nothing to score)."""
    if row.verdict != "inconclusive" or not row.n or informational(row):
        return False
    rule = row.rule or ""
    return STRADDLES in rule or TOO_FEW in rule


def room(run: Run, suite: Suite, documents: int) -> int:
    """How many samples the run may hold in all: the suite's max_samples, within the run's suite
    version's `documents` (less a quarter kept for AWQ calibration when a config needs it) and the
    per-run limit."""
    cap = suite.settings.max_samples
    if not cap:
        return len(run.sample_keys)
    if any((cr.config.spec or {}).get("weights") == "awq-int4" for cr in run.config_runs):
        documents -= documents // 4
    return max(len(run.sample_keys), min(int(cap), documents, get_settings().max_samples_per_run))


def draw_more(run: Run, keys: list[str], n: int) -> list[str]:
    """n of the run's suite version's `keys` that the run has not drawn: a seed of their own (the
    run's seed and its size, so each top-up draws afresh), kept in suite order."""
    drawn = set(run.sample_keys)
    remaining = [key for key in keys if key not in drawn]
    n = min(n, len(remaining))
    picked = set(random.Random(f"top-up:{run.seed}:{len(run.sample_keys)}").sample(range(len(remaining)), n))
    return [key for i, key in enumerate(remaining) if i in picked]


def plan(session: Session, run: Run, suite: Suite | None, rows: list[Comparison]) -> list[int]:
    """Top the run up when a candidate is undecided and the suite allows more samples: the new
    config-runs' ids (the baseline's and each undecided config's), else [] (judge as it is)."""
    if suite is None or not suite.settings.max_samples:
        return []
    configs = {cr.config_id: cr for cr in run.config_runs}
    # a config already critical (or a measurement error) fails the run whatever more samples say
    settled = {r.config_id for r in rows if r.verdict in SETTLED and not informational(r)}
    waiting = sorted({r.config_id for r in rows
                      if r.config_id is not None and r.config_id != run.baseline_config_id
                      and r.config_id not in settled and undecided(r)
                      and not step_back.is_ablation(configs[r.config_id].config)})
    if not waiting:
        return []
    keys = [sample.key for sample in repo.suite_samples(session, suite.id, run.suite_version)]
    have = len(run.sample_keys)
    new_keys = draw_more(run, keys, min(2 * have, room(run, suite, len(keys))) - have)
    if not new_keys:
        return []
    # a stacked config that breaches steps back once the run is decided: it reruns too, so that it
    # and its single-optimization ablations are measured on the same samples
    stacked = sorted(cr.config_id for cr in run.config_runs
                     if cr.config_id not in waiting and step_back.would_step_back(run, cr, rows))
    names = ", ".join(configs[c].config.name for c in waiting)
    log.info("run %s: %s undecided at %d samples; topping up to %d", run.id, names, have, have + len(new_keys))
    # what a judge or faithfulness scorer said of the outputs that run again no longer applies
    return repo.top_up_run(session, run, new_keys, [run.baseline_config_id, *waiting, *stacked],
                           keep_metrics=engine_kinds())


def reason(run: Run, suite: Suite | None) -> str:
    """The run reason's clause for a topped-up run ('' when it was not)."""
    drawn = len(run.sample_keys)
    if drawn <= run.n_samples:
        return ""
    cap = (suite.settings.max_samples if suite is not None else None) or drawn
    return f"; topped up from {run.n_samples} to {drawn} samples (max_samples {cap}) after an inconclusive pass"
