"""Hand-made run summaries (app/schemas.RunOut) for tests of what reads one: the CLI table, the gate
summary, the report. The test gives the fields it is about; the rest take neutral values, and the
verdict for people and the trade-off points are computed from them as app/services.run_summary does."""

from __future__ import annotations

from typing import Any

from app.schemas import RunOut
from app.summary import trade_off_points, verdict_summary


def run_config(config: str, **fields: Any) -> dict[str, Any]:
    """A config of the run, succeeded unless said otherwise."""
    return {"config": config, "spec": {}, "status": "succeeded", "attempt": 1, "progress": {"done": None, "total": None},
            "error": None, **fields}


def run_out(**fields: Any) -> RunOut:
    """A done run (id 1, 12 samples, no configs, comparisons or figures) with `fields` in place."""
    fields = {"run_id": 1, "status": "done", "verdict": None, "verdict_reason": None, "baseline": None, "suite_id": 1,
              "trigger": "manual", "n_samples": 12, "seed": 0, "created_at": None, "finished_at": None, "configs": [],
              "comparisons": [], "figures": {}, "step_back": [], **fields}
    fields.setdefault("samples_drawn", fields["n_samples"])
    fields["configs"] = [run_config(**c) if isinstance(c, dict) else c for c in fields["configs"]]
    run = RunOut.model_validate({**fields, "summary": {"groups": {}, "lines": [], "more": 0, "counts": {}}})
    if "summary" not in fields:
        ablations = [c.config for c in run.configs if c.ablation_of]
        run.summary = verdict_summary(run.comparisons, run.step_back, run.baseline, ablations,
                                      figures={n: run.figures_of(n) for n in run.figures})
    if "trade_off" not in fields:
        run.trade_off = trade_off_points(run.configs, run.comparisons, {n: run.figures_of(n) for n in run.figures},
                                         run.baseline)
    return run
