"""A gate's baseline, reused: a baseline config-run whose inputs (models by content, specs, suite,
samples, code, libraries, device) hash to the key of an earlier one takes that one's rows
instead of running the engine again (CANARY_GATE_REUSE_BASELINE)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import platform
from collections.abc import Callable

from sqlalchemy.orm import Session

from app import repo
from app.models import ConfigRun, Run
from engines.fingerprint import model_digest, source_digest
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path
from evals.records import engine_kinds
from workers.engine_cache import calibration_id
from workers.job import Job
from workers.lease import Attempt

log = logging.getLogger(__name__)
_CODE = pathlib.Path(__file__).resolve().parent.parent
_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "triton", "vllm", "numpy")


def inputs_key(job: Job) -> str | None:
    """sha256 of everything that decides a config-run's rows: the model's files (and a draft
    model's, and a config's own checkpoint's) by content, the config's spec, the suite's spec and
    version, the samples in order, the source of engines/, vocabulary/, evals/ and workers/, the
    libraries' versions and the device kind.
    None for a served model (engine openai): what the server runs is not ours to pin."""
    spec: OptimizationSpec = job.spec
    if spec.engine == "openai":
        return None
    models = [model_digest(resolve_model_path(job.model_path))]
    draft = getattr(spec.speculative, "draft_model", None)
    if draft:
        models.append(model_digest(resolve_model_path(draft)))
    if spec.checkpoint:  # the config's own weights, loaded in the model's place
        models.append(model_digest(resolve_model_path(spec.checkpoint)))
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    import torch  # the worker's engines run on it already

    device = spec.option("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        device = f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    payload = {
        "models": models, "spec": spec.model_dump(mode="json"), "baseline_spec": job.baseline_spec.model_dump(
            mode="json"), "suite": job.suite.model_dump(mode="json"), "suite_version": job.suite_version,
        "samples": [key for key, _, _ in job.samples],
        "code": source_digest(_CODE / "engines", _CODE / "vocabulary", _CODE / "evals", _CODE / "workers"),
        "versions": versions,
        "device": str(device), "machine": platform.machine(), "python": platform.python_version(),
        "threads": torch.get_num_threads(), "kernels": os.environ.get("CANARY_KERNELS"),
        "calibration": calibration_id(job.calibration),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def reuse(transaction: Callable[[Callable[[Session], int | None], str], int | None], attempt: Attempt, job: Job,
          key: str, lease_seconds: float) -> bool:
    """A gate's baseline: take the rows and figures of the newest earlier config-run of this
    config with the same inputs key on the same samples, in one transaction (`transaction`, the
    task's retrying one) fenced by the attempt. False when there is none (the engine computes them)."""
    def take(session: Session) -> int | None:
        mine = session.get(ConfigRun, attempt.config_run_id)
        if mine is not None and mine.attempt == attempt.number and mine.status == "succeeded":
            # this transaction committed already and its acknowledgement was lost: done
            return (mine.figures or {}).get("reused_from_run")
        run = session.get(Run, job.run_id)
        assert run is not None  # a foreign key: the row exists
        source = repo.reusable_config_run(session, run, job.config_id, key)
        if source is None:
            return None
        attempt.heartbeat_or_stop(session, lease_seconds, source.progress_total, source.progress_total)
        # what the engine wrote, not what judges added later (a remote judge is not in the key)
        repo.copy_sample_results(session, source.run_id, job.run_id, job.config_id, engine_kinds())
        assert source.figures is not None  # reusable_config_run matched the figures' inputs_key
        figures = {**source.figures, "reused_from_run": source.figures.get("reused_from_run") or source.run_id,
                   "config_digest": job.config_digest}  # the config as this run loaded it (the key says: the same)
        attempt.finish_or_stop(session, "succeeded", figures=figures)
        return figures["reused_from_run"]

    source_run = transaction(take, f"reuse a baseline for config-run {attempt.config_run_id}")
    if source_run is not None:
        log.info("config-run %s: the baseline's results of run %s reused (same inputs %s)", attempt.config_run_id,
                 source_run, key[:12])
    return source_run is not None
