"""What every producer shares: the config-run's work in progress (`Work`), the `Producer` base
class, and the registry the worker reads (`PRODUCERS`, in the order they run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, NamedTuple

from engines.protocol import WindowSpec
from evals.records import register_record
from evals.run_stats import RunStats
from vocabulary.suite import scorer
from workers.generation import BaselineScorer, baseline_scorer
from workers.job import Job


@dataclass
class Work:
    """One attempt's engine pass: its job, its engine, its progress, and the notes the producers
    add to the config-run's figures as they go (each producer's own figures: Producer.figures)."""

    job: Job
    engine: Any  # an engines.protocol.Engine
    window: WindowSpec
    config_run_id: int
    stats: RunStats  # the generations' serving figures
    check_lease: Callable[[], None] = lambda: None  # raises LostLease once a newer attempt holds the config-run
    notes: list[str] = field(default_factory=list)  # said with the config-run's figures
    done: int = 0  # rows of progress so far
    total: int = 0

    @cached_property
    def keep_ids(self) -> bool:
        """Token ids are stored beside texts where agreement pairs them with the baseline's."""
        return self.job.suite.runs("agreement")

    def baseline(self) -> BaselineScorer:
        """The run's baseline model as a scorer of text (the engine's own for the baseline config;
        workers/generation.py)."""
        return baseline_scorer(self.engine, self.job)


class Batch(NamedTuple):
    """Rows a producer wrote in one engine call (or a few), and the progress they stand for."""

    rows: list[dict]
    progress: int


class Producer:
    """One kind of measurement of a config-run, made per attempt (`Producer(work)`): it asks the
    engine for what it needs and yields its rows a batch at a time; the worker checks the lease
    before each batch and writes each one fenced by the attempt."""

    scorer: ClassVar[str]  # the suite scorer that switches it on (vocabulary/suite.py SCORER_TABLE)
    records: ClassVar[tuple[type, ...]] = ()  # the record kinds it writes (evals/records.py)

    def __init__(self, work: Work):
        self.work = work

    def total(self) -> int:
        """Rows of progress it will report in all."""
        return 0

    def batches(self) -> Iterator[Batch]:
        raise NotImplementedError

    def figures(self) -> dict[str, Any]:
        """RunFigures fields it measured, read after its last batch."""
        return {}


PRODUCERS: list[type[Producer]] = []


def register_producer(cls: type[Producer]) -> type[Producer]:
    """Add a producer after those registered before it. Its scorer must be in the scorer table
    (register a new one with vocabulary.suite.register_scorer); its record kinds become readable
    (evals.records.register_record) and a reused baseline or a top-up keeps them."""
    scorer(cls.scorer)  # an unknown scorer is an error naming the table's
    for record in cls.records:
        register_record(record, engine_pass=True)
    if cls not in PRODUCERS:
        PRODUCERS.append(cls)
    return cls


def producers_for(work: Work) -> list[Producer]:
    """The producers the job's suite switches on (less those a top-up pass leaves out), made for
    this attempt, in registry order."""
    return [cls(work) for cls in PRODUCERS if work.job.runs(cls.scorer)]
