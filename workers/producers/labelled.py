"""The labelled producer (scorer `labelled`): the suite's labelled items (vocabulary/labelled.py),
DOC_BATCH at a time. A multiple-choice item is answered by each choice's Σ log p after the prompt
(the log-likelihood of prompt + choice less the prompt's own, as lm-eval's loglikelihood requests
give it), any other by a greedy answer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engines.protocol import Engine, GenerationRequest, RollingRequest, WindowSpec
from evals.records import ItemRecord
from vocabulary.labelled import LabelledItem, choice_correct, continuation_loglikelihood, generated_correct
from workers.producers.base import Batch, Producer, Work, register_producer
from workers.producers.documents import DOC_BATCH


def answer_choices(engine: Engine, items: Sequence[LabelledItem], window: WindowSpec) -> list[ItemRecord]:
    """Multiple-choice items answered by log-likelihood, every choice of every item in one engine
    call (the reference engine packs them into batches): each choice's Σ log p after the prompt
    (vocabulary/labelled.py continuation_loglikelihood)."""
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


@register_producer
class Labelled(Producer):
    scorer = "labelled"
    records = (ItemRecord,)

    def __init__(self, work: Work):
        super().__init__(work)
        # the items are the suite's, not the run's samples: a top-up pass finds them all answered
        items = work.job.items
        self.items = items[work.job.first_unscored(ItemRecord.KIND, [item.key for item in items]):]

    def total(self) -> int:
        return len(self.items)

    def batches(self) -> Iterator[Batch]:
        work, items = self.work, self.items
        max_new_tokens = work.job.suite.labelled.max_new_tokens
        for i in range(0, len(items), DOC_BATCH):
            batch = items[i : i + DOC_BATCH]
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
            yield Batch([record.to_row() for record in records], len(batch))
