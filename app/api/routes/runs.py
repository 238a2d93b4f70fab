from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import HTMLResponse
from sqlalchemy import func, select

from app import repo, services
from app.api.deps import KeyDep, ProjectDep, RowId, SessionDep
from app.config_base import DB_INT_MAX
from app.dispatch import get_dispatcher
from app.models import SampleResult
from app.schemas import ERROR_CODES, RunIn, RunListItem, RunOut, SamplePage, SampleResultOut, error_responses
from app.services import run_summary, start_run

router = APIRouter(tags=["runs"], responses=error_responses(404))
RESERVED_RUN_KEYS = ("gate:", "schedule:")  # the run keys app/api/routes/gates.py and app/schedules.py write


@router.post("/projects/{project}/runs", status_code=status.HTTP_202_ACCEPTED, response_model=RunOut,
             responses={200: {"description": "the run already started with this Idempotency-Key", "model": RunOut},
                        **error_responses(400, 403, 409, 422)})
def create_run(
    body: RunIn, project: ProjectDep, session: SessionDep, response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=128)] = None,
) -> RunOut:
    """Start a run of a suite over configs (baseline included); 200 with the earlier run when
    the Idempotency-Key was seen before."""
    if idempotency_key and idempotency_key.startswith(RESERVED_RUN_KEYS):
        # a gate's run carries "gate:<its key>", a schedule slot's "schedule:<id>:<slot>": a client
        # run holding one would be adopted by that gate or slot (the wrong trigger and priority)
        raise ValueError(f"Idempotency-Key: keys starting with {' or '.join(map(repr, RESERVED_RUN_KEYS))} are kept "
                         "for the canary's own gate and schedule runs; choose a key without that prefix, or start a "
                         "gate with POST …/gates")
    run_id, created = start_run(project.name, body.suite, body.configs, get_dispatcher(background=True),
                                samples=body.samples, seed=body.seed, trigger=body.trigger,
                                idempotency_key=idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    return run_summary(session, repo.get_run(session, project, run_id))


@router.get("/projects/{project}/runs", response_model=list[RunListItem])
def list_runs(project: ProjectDep, session: SessionDep, limit: int = Query(50, ge=1, le=500),
              offset: int = Query(0, ge=0, le=DB_INT_MAX)) -> list[dict]:
    return [
        {"run_id": run.id, "status": run.status, "verdict": run.verdict, "trigger": run.trigger,
         "n_samples": run.n_samples, "samples_drawn": len(run.sample_keys), "created_at": run.created_at.isoformat(),
         "finished_at": run.finished_at.isoformat() if run.finished_at else None}
        for run in repo.list_runs(session, project, limit, offset)
    ]


@router.get("/projects/{project}/runs/{run_id}", response_model=RunOut)
def get_run(run_id: RowId, project: ProjectDep, session: SessionDep) -> RunOut:
    return run_summary(session, repo.get_run(session, project, run_id))


# errors stay JSON beside the HTML answer: their content is said here, or the route's HTML media type
# would be documented for them too
_JSON_ERRORS = {code: {**{k: v for k, v in r.items() if k != "model"}, "content": {"application/json": {"schema": {
    "$ref": f"#/components/schemas/{r['model'].__name__}"}}}}
    for code, r in error_responses(*ERROR_CODES).items()}


@router.get("/projects/{project}/runs/{run_id}/report", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {"schema": {"type": "string"}},
                                         "text/markdown": {"schema": {"type": "string"}}},
                             "description": "one self-contained HTML file, or Markdown with format=md"},
                       **_JSON_ERRORS})
def get_run_report(run_id: RowId, project: ProjectDep, session: SessionDep,
                   form: Literal["html", "md"] = Query("html", alias="format", description=(
                       "html: one self-contained file; md: the decision, thresholds, gated comparisons and "
                       "environment as Markdown for a pull request"))) -> Response:
    """The run's report to share (app/report.py): the verdict for people, the thresholds, every
    comparison with its CI, quality lost against speed gained as an inline SVG, the worst documents
    per candidate, the field signals and the environment. No script and nothing from elsewhere: it
    opens offline."""
    from app import report

    text = report.build(session, project, repo.get_run(session, project, run_id), form)
    disposition = {"Content-Disposition": f'inline; filename="canary-run-{run_id}.{form}"'}
    if form == "md":
        return Response(text, media_type="text/markdown; charset=utf-8", headers=disposition)
    return HTMLResponse(text, headers=disposition)


@router.post("/projects/{project}/runs/{run_id}/cancel", response_model=RunOut,
             responses=error_responses(403, 409))
def cancel_run(run_id: RowId, project: ProjectDep, session: SessionDep, key: KeyDep) -> RunOut:
    """Stop a queued or running run: it ends `cancelled` (verdict error: a gate on it decides), its
    unfinished configs end `cancelled` with nothing of theirs kept; 409 once it has ended or is
    being aggregated."""
    who = f"API key {key.id}" if key is not None else "an API client"
    return run_summary(session, services.cancel_run(session, project, run_id, who))


@router.get("/projects/{project}/runs/{run_id}/samples", response_model=SamplePage)
def run_samples(
    run_id: RowId, project: ProjectDep, session: SessionDep,
    config: str | None = Query(None, max_length=128), metric: str | None = Query(None, max_length=64),
    limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=DB_INT_MAX),
) -> SamplePage:
    run = repo.get_run(session, project, run_id)
    names = {config_run.config_id: config_run.config.name for config_run in run.config_runs}
    config_id = None
    if config is not None:
        config_id = repo.get_config(session, project, config).id
    count = select(func.count()).select_from(SampleResult).where(SampleResult.run_id == run.id)
    if config_id is not None:
        count = count.where(SampleResult.config_id == config_id)
    if metric is not None:
        count = count.where(SampleResult.metric == metric)
    total = session.scalar(count) or 0
    rows = repo.sample_results(session, run.id, config_id, metric, limit=limit, offset=offset)
    items = [SampleResultOut(config=names.get(row.config_id, str(row.config_id)), sample_key=row.sample_key,
                             metric=row.metric, value=row.value, extra=row.extra) for row in rows]
    return SamplePage(total=total, offset=offset, limit=limit, items=items)
