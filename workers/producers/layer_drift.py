"""The layer-drift producer (scorer `layers`; evals/layer_drift.py): on the suite's first
perplexity.layer_samples documents, the candidate's first window and the baseline engine's, layer
by layer, one LayerDriftRecord per document. Both engines in-process (GivesLayerStates); a
candidate served over HTTP, or a baseline that is, records nothing and the run's notes say why."""

from __future__ import annotations

from collections.abc import Iterator

from engines.protocol import GivesLayerStates, RollingRequest
from evals.layer_drift import LayerDriftRecord
from workers.producers.base import Batch, Producer, Work, register_producer


@register_producer
class LayerDrift(Producer):
    scorer = "layers"
    records = (LayerDriftRecord,)

    def __init__(self, work: Work):
        super().__init__(work)
        n = 0 if work.job.is_baseline else min(work.job.suite.perplexity.layer_samples, len(work.job.samples))
        # a top-up pass finds the first documents measured already
        self.start = work.job.first_unscored(LayerDriftRecord.KIND, [key for key, _, _ in work.job.samples[:n]])
        self.n = n

    def total(self) -> int:
        return self.n - self.start

    def batches(self) -> Iterator[Batch]:
        work = self.work
        if self.start >= self.n:
            return
        baseline = work.baseline().engine
        if not (isinstance(work.engine, GivesLayerStates) and isinstance(baseline, GivesLayerStates)):
            side = "the candidate's" if not isinstance(work.engine, GivesLayerStates) else "the baseline's"
            work.notes.append(f"no layer drift (layers scorer): {side} engine does not give per-layer states "
                              "(in-process engines only)")
            yield Batch([], self.total())
            return
        for key, text, _ in work.job.samples[self.start : self.n]:  # one document at a time: two passes' states live
            request = RollingRequest(key, text, work.window)
            record = LayerDriftRecord.measure(key, baseline.layer_states(request), work.engine.layer_states(request))
            if record is None:
                work.notes.append(f"no layer drift on '{key}': the two engines read different tokens")
            yield Batch([record.to_row()] if record is not None else [], 1)
