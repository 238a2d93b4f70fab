"""The torch- and numpy-free vocabulary the service (app) and the libraries (evals, workers) share:
the metric table (metrics.py), a config-run's figures (figures.py), a suite's settings (suite.py),
the typed Comparison (comparison.py), labelled items (labelled.py) and the domain terms a suite's
settings are checked with (terms.py).

It imports none of app, workers, evals, dashboard, the reference engine, torch, numpy or
transformers (an import-linter contract in pyproject.toml), so app/ reads it and the API image
stays small. The metric table names its compare targets as "module:function" strings in evals/,
imported only when the aggregation calls them.
"""
