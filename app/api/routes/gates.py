from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Response, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app import repo
from app.api.deps import ProjectDep, RowId, SessionDep
from app.config_base import DB_INT_MAX, NameRef
from app.dispatch import get_dispatcher
from app.gates import check_request, find_gate, record_gate
from app.models import Project
from app.queries import gate as read_gate
from app.queries import gate_out
from app.queries import gates as read_gates
from app.schemas import ComparisonOut, RunVerdict, Time, error_responses
from app.services import start_run

router = APIRouter(tags=["gates"], responses=error_responses(404))
# a request that races another with its Idempotency-Key can lose the run's insert, then the gate's;
# its third pass reads the winner's gate
RACE_ATTEMPTS = 4


class GateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidate: NameRef = Field(description="the config to deploy")
    baseline: NameRef | None = Field(None, description="must be the candidate model's baseline config (checked)")
    suite: NameRef
    samples: int | None = Field(None, ge=1, le=DB_INT_MAX)
    inconclusive: Literal["pass", "warn", "fail"] = Field(
        "warn", description="gate verdict when the data cannot decide")


class GateListItem(BaseModel):
    gate_id: int
    candidate: str
    baseline: str
    verdict: Literal["pass", "warn", "fail", "error"] | None = Field(description="null while the run goes on")
    run_id: int
    created_at: Time | None
    decided_at: Time | None


class GateOut(GateListItem):
    run_status: str
    run_verdict: RunVerdict | None
    reason: str | None = Field(description="the run's verdict reason")
    idempotency_key: str | None
    summary_markdown: str = Field(description="the gate's result as a pull-request comment")
    comparisons: list[ComparisonOut] = Field(description="the candidate's")
    summary: list[str] = Field(description="the verdict for people, as every surface prints it (app/summary.py)")


@router.post("/projects/{project}/gates", status_code=status.HTTP_202_ACCEPTED, response_model=GateOut,
             responses={200: {"description": "the gate already started with this Idempotency-Key", "model": GateOut},
                        **error_responses(400, 403, 409)})
def create_gate(body: GateIn, project: ProjectDep, session: SessionDep, response: Response,
                idempotency_key: Annotated[str | None, Header(max_length=120)] = None) -> dict:
    """Start a gate run (trigger 'gate'); the same Idempotency-Key returns the same gate (200),
    also to requests that race the first one."""
    attempts = RACE_ATTEMPTS
    while True:
        existing = find_gate(session, project, idempotency_key)
        if existing is not None:
            if (existing.candidate, existing.policy and existing.policy.get("suite")) != (body.candidate, body.suite):
                raise repo.Conflict(f"Idempotency-Key '{idempotency_key}' was used for a different gate (gate "
                                    f"{existing.id}); use a new key")
            response.status_code = status.HTTP_200_OK
            return gate_out(session, project, existing)
        try:
            return _start_gate(session, project, body, idempotency_key)
        except IntegrityError:
            # a concurrent request with this key wrote the run ("gate:<key>") or the gate first; once
            # it commits (the unique index makes this insert wait for it), the next pass reads its gate
            session.rollback()
            attempts -= 1
            if not idempotency_key or not attempts:
                raise


def _start_gate(session: Session, project: Project, body: GateIn, idempotency_key: str | None) -> dict:
    baseline = check_request(session, project, body.candidate, body.baseline, body.suite)
    run_id, _ = start_run(project.name, body.suite, [body.candidate], get_dispatcher(background=True),
                          samples=body.samples, trigger="gate",
                          idempotency_key=f"gate:{idempotency_key}" if idempotency_key else None)
    policy = {"inconclusive": body.inconclusive, "suite": body.suite}
    gate = record_gate(session, project, run_id, body.candidate, baseline, policy, idempotency_key)
    session.commit()
    # a run that finished before the gate row existed (inline, tiny suites) is decided now
    from app.gates import decide

    decide(session, run_id)
    return gate_out(session, project, gate)


@router.get("/projects/{project}/gates/{gate_id}", response_model=GateOut)
def get_gate(gate_id: RowId, project: ProjectDep, session: SessionDep) -> dict:
    return read_gate(session, project, gate_id)


@router.get("/projects/{project}/gates", response_model=list[GateListItem])
def list_gates(project: ProjectDep, session: SessionDep, limit: int = Query(50, ge=1, le=500)) -> list[dict]:
    return read_gates(session, project, limit)
