"""Test fault, never installed: a slow GPU. Python imports this module at start-up only when its
folder is on PYTHONPATH, which only the fault tests set (for the workers of one test). It wraps
workers.engine_cache.get_engine so that every engine load sleeps CANARY_TEST_LOAD_DELAY_S (a slow
model load or AWQ calibration) and every engine call (one batch of documents or prompts) sleeps
CANARY_TEST_BATCH_DELAY_S first: batches longer than the lease, on a worker that is alive."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

LOAD_DELAY_S = float(os.environ.get("CANARY_TEST_LOAD_DELAY_S", "0"))
BATCH_DELAY_S = float(os.environ.get("CANARY_TEST_BATCH_DELAY_S", "0"))


class SlowEngine:
    def __init__(self, engine):
        self._engine = engine

    def loglikelihood_rolling(self, requests):
        time.sleep(BATCH_DELAY_S)
        return self._engine.loglikelihood_rolling(requests)

    def generate(self, requests):
        time.sleep(BATCH_DELAY_S)
        return self._engine.generate(requests)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _patch(module) -> None:
    real = module.get_engine

    def get_engine(*args, **kwargs):
        time.sleep(LOAD_DELAY_S)
        return SlowEngine(real(*args, **kwargs))

    module.get_engine = get_engine


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "workers.engine_cache":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if LOAD_DELAY_S or BATCH_DELAY_S:
    sys.meta_path.insert(0, _PatchOnImport())
