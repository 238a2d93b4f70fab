"""A config-run's engine pass as producers: objects the worker loops over (workers/execute.py).

Each producer is one module. It names the suite scorer that switches it on (vocabulary/suite.py's
scorer table), asks the engine for what it needs, and turns the results into rows of its own
record kinds (evals/records.py: one writer and one reader per kind), batch by batch. The worker
keeps the lease, the progress and the fenced writes; a producer never touches the database.

    producer     scorer      engine requests                          records
    documents    perplexity  rolling log-likelihood of each document; DocRecord, with what its signals add:
                             what its document signals ask (below)      terms, positions, decode, distributions
    generation   generation  generate (the candidate; the baseline's  GenerationRecord, RepeatRecord, SoloRecord
                             paired pass), the baseline's reading
    labelled     labelled    log-likelihood per choice, or generate   ItemRecord
    layer_drift  layers      per-layer states of a document's first   LayerDriftRecord (evals/layer_drift.py)
                             window, the candidate's and the baseline's

The document signals (workers/producers/terms.py, positions.py, decode.py, distributions.py) are
read beside each batch of documents and stored on the document's row; a signal that needs a row
of its own is a producer of its own. A new producer is a module here (or anywhere) that calls
`register_producer`; the aggregation finds its records in `ConfigRecords.kinds` and a metric's
compare target reads them (vocabulary/metrics.py). A package installed beside the service adds
producers through its entry points (vocabulary/plugins.py), which every worker loads here.
"""

from vocabulary import plugins
from workers.producers import documents, generation, labelled, layer_drift  # noqa: F401 - each registers itself
from workers.producers.base import PRODUCERS, Batch, Producer, Work, producers_for, register_producer

plugins.load(plugins.PRODUCERS)  # installed producers (and their scorers and metric rows), after the built-in ones

__all__ = ["PRODUCERS", "Batch", "Producer", "Work", "producers_for", "register_producer"]
