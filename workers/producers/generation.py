"""The generation producer (scorer `generation`): the prompts' generations, a batch (`step`
requests in flight) at a time, each output read by the baseline model; then the batch-invariance
probes. A candidate's prompts also run on the baseline engine, batch by batch, in alternating
order (ABBA): the paired timings that ttft_ratio and tpot_ratio compare, and the baseline's second
pass over the prompts (RepeatRecord), the noise floor that confident_divergence is judged beyond.
Its figures: the concurrency it ran at, and why the baseline could not read the outputs, if so."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from engines.protocol import GenerationRequest
from evals.records import GenerationRecord, RepeatRecord, SoloRecord, speculative_to_json
from workers.generation import BaselineScorer, concurrency, scored_rows, timings
from workers.producers.base import Batch, Producer, Work, register_producer


@register_producer
class Generation(Producer):
    scorer = "generation"
    records = (GenerationRecord, RepeatRecord, SoloRecord)

    def __init__(self, work: Work):
        super().__init__(work)
        gen = work.job.suite.generation
        self.requests = [GenerationRequest(key, " ".join(text.split()[: gen.prompt_words]), gen.max_new_tokens,
                                           gen.temperature)
                         for key, text, _ in work.job.samples[: min(work.job.prompts, len(work.job.samples))]]
        # a top-up pass generates only the prompts it added (the config holds the answers to the rest);
        # its batches are numbered on from there, so that no batch of two passes reads as one cluster
        self.start = work.job.first_unscored(GenerationRecord.KIND, [r.request_id for r in self.requests])
        self.requests = self.requests[self.start :]
        self.judge: BaselineScorer | None = None
        self.step = 1

    def total(self) -> int:
        return len(self.requests)

    def probes(self, solo_probes: int, prompts: int) -> int:
        """How many of this pass's prompts are sent alone too: the suite's solo_probes on the first
        pass; on a top-up pass, as many more per prompt added as the first pass had per prompt
        (solo_probes per `prompts`), so that batch_divergence's probes grow with the prompts and
        a top-up can decide it as it decides the prompts' other metrics."""
        if self.start == 0:
            return min(solo_probes, len(self.requests))
        return min(len(self.requests), math.ceil(len(self.requests) * solo_probes / max(1, prompts)))

    def batches(self) -> Iterator[Batch]:
        work, engine, gen, requests = self.work, self.work.engine, self.work.job.suite.generation, self.requests
        prompts = {request.request_id: request.prompt for request in requests}
        judge = self.judge = work.baseline() if requests else None  # it scores every config's outputs
        step = self.step = concurrency(engine, work.job.spec, gen, judge)  # requests in flight at once (a batch)
        timing, floor = gen.paired_timing, gen.noise_floor
        repeat = judge is not None and judge.engine is not engine and (timing or floor)
        for batch_number, i in enumerate(range(0, len(requests), step)):
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
                work.stats.add(generation)
                record = GenerationRecord.from_result(generation, prompts[generation.request_id], work.keep_ids)
                base_ttft, base_tpot = baseline_timing.get(generation.request_id, (None, None))
                rows.append(replace(record, baseline_nll=nll, baseline_nll_tokens=n, paired_baseline_ttft_ms=base_ttft,
                                    paired_baseline_tpot_ms=base_tpot, scored=read,
                                    batch=self.start + batch_number).to_row())
            if floor and baseline_pass and judge is not None:
                rows += scored_rows(RepeatRecord, baseline_pass, judge, prompts, work.window, work.keep_ids)
            # a serving process's own figures over this batch (None in-process)
            batch_spec = work.stats.add_server(engine.server_stats(), generations)
            if batch_spec is not None:
                rows[0]["extra"]["spec"] = speculative_to_json(batch_spec) | {"scope": "batch"}
            yield Batch(rows, len(generations))
        # batch invariance: a few prompts again, each alone, against their answers inside a full batch
        probes = requests[: self.probes(gen.solo_probes, gen.prompts)] if step > 1 and judge is not None else []
        if probes and judge is not None:
            alone = [engine.generate([request])[0] for request in probes]
            yield Batch(scored_rows(SoloRecord, alone, judge, prompts, work.window, work.keep_ids), 0)

    def figures(self) -> dict[str, Any]:
        return {"concurrency": self.step,
                "baseline_scoring_error": self.judge.error if self.judge is not None else None}
