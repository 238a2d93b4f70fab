"""Extensions installed beside the service, found by their package's entry points, so that every
process (the API, each Celery worker, the CLI) knows them without an edit here or in a test
fixture. A distribution declares, in its pyproject.toml:

    [project.entry-points."inference_canary.vocabulary"]   # scorers and metric rows: the API checks
    my_signal = "my_pkg.vocabulary"                        # suites and config files against them
    [project.entry-points."inference_canary.producers"]    # producers: only the workers run them
    my_signal = "my_pkg.producer"

Each entry point names a module (or an object in one) that registers what it adds when imported:
`vocabulary.suite.register_scorer`, `vocabulary.metrics.register_metric`,
`workers.producers.register_producer` (which makes its record kinds readable). The two groups keep
the layering: the API loads the vocabulary only, so it never imports workers/; a worker loads both,
the vocabulary first. Each group is loaded once per process. A plugin that fails to import is an
error naming its entry point, its distribution and the fix, raised where the group is loaded.
"""

from __future__ import annotations

import importlib.metadata
import threading


class PluginError(RuntimeError):
    """An installed plugin that does not load."""


VOCABULARY = "inference_canary.vocabulary"
PRODUCERS = "inference_canary.producers"
GROUPS = (VOCABULARY, PRODUCERS)

_loaded: dict[str, list[str]] = {}
_failed: dict[str, PluginError] = {}  # a group whose plugin failed: the same error each time it is loaded
_lock = threading.RLock()


def load(group: str) -> list[str]:
    """Import every entry point of `group` (once per process, in entry-point name order;
    VOCABULARY before PRODUCERS) → the entry points loaded, as "name = value (distribution)". A
    plugin that fails raises PluginError, and the same one again at each later load in this process
    (a second import of a half-registered plugin would fail on what it registered, hiding why)."""
    if group not in GROUPS:
        raise ValueError(f"unknown plugin group '{group}'; choose from {', '.join(GROUPS)}")
    with _lock:
        if group in _failed:
            raise _failed[group]
        if group in _loaded:
            return _loaded[group]
        if group == PRODUCERS:
            load(VOCABULARY)  # a producer's scorer and metric rows first
        _loaded[group] = []  # a plugin that looks a scorer up while it loads does not load the group again
        done = []
        for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else "?"
            try:
                ep.load()
            except Exception as e:
                del _loaded[group]
                _failed[group] = PluginError(
                    f"plugin '{ep.name}' ({ep.value}, from {dist}) in entry-point group {group} "
                    f"failed to load: {type(e).__name__}: {e}; fix or uninstall {dist}")
                raise _failed[group] from e
            done.append(f"{ep.name} = {ep.value} ({dist})")
        _loaded[group] = done
        return done


def loaded() -> dict[str, list[str]]:
    """What this process has loaded so far, by group."""
    with _lock:
        return {group: list(eps) for group, eps in _loaded.items()}
