"""The labelled producer (scorer `labelled`): the suite's labelled items (vocabulary/labelled.py),
DOC_BATCH at a time. A multiple-choice item is answered by each choice's Σ log p after the prompt
(the log-likelihood of prompt + choice less the prompt's own, as lm-eval's loglikelihood requests
give it), any other by a greedy answer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engines.protocol import ChoiceRequest, Engine, GenerationRequest, RollingRequest, ScoresChoices, WindowSpec
from evals.records import ItemRecord
from vocabulary.labelled import LabelledItem, choice_correct, continuation_loglikelihood, generated_correct
from workers.producers.base import Batch, Producer, Work, register_producer
from workers.producers.documents import DOC_BATCH


def answer_choices(engine: Engine, items: Sequence[LabelledItem], window: WindowSpec) -> list[ItemRecord]:
    """Multiple-choice items answered by log-likelihood: each choice's Σ log p after the prompt
    (vocabulary/labelled.py continuation_loglikelihood). An engine that scores a prompt's choices
    over one pass of it (engines/protocol.py ScoresChoices: the reference engine) takes them all
    first; what it leaves, every choice of every item in one rolling call (the reference engine packs
    them into batches)."""
    asked = [ChoiceRequest(item.key, item.prompt, item.choices, window) for item in items]
    scored: list[list[float] | None] = [
        list(row) if row is not None else None
        for row in (engine.loglikelihood_choices(asked) if isinstance(engine, ScoresChoices) and items
                    else [None] * len(items))]
    rest = [i for i, row in enumerate(scored) if row is None]
    requests = [RollingRequest(f"{items[i].key}#{j}", items[i].prompt + choice, window)
                for i in rest for j, choice in enumerate(items[i].choices)]
    results = iter(engine.loglikelihood_rolling(requests) if requests else [])
    rows = {i: [next(results) for _ in items[i].choices] for i in rest}
    spanless = [i for i in rest if any(not r.char_spans for r in rows[i])]
    # a server's tokens have no place in the text: each choice's whole text less the prompt scored alone
    prompts = dict(zip(spanless, engine.loglikelihood_rolling(
        [RollingRequest(f"{items[i].key}#prompt", items[i].prompt, window) for i in spanless]), strict=True)) \
        if spanless else {}
    for i in rest:
        scored[i] = [continuation_loglikelihood(r, len(items[i].prompt), prompts.get(i)) for r in rows[i]]
    records = []
    for item, scores in zip(items, scored, strict=True):
        assert scores is not None  # every item scored, shared or rolling
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
