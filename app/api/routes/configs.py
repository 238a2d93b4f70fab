from __future__ import annotations

from fastapi import APIRouter, status

from app import repo
from app.api.deps import ProjectDep, SessionDep
from app.models import OptimizationConfig
from app.repo import Conflict, NotFound
from app.schemas import ConfigIn, ConfigOut, error_responses
from app.services import check_config_fits_model, check_project_room
from app.ssrf import public_spec
from engines.spec import ConfigNotAvailable

router = APIRouter(tags=["configs"], responses=error_responses(404))


def _out(c: OptimizationConfig) -> ConfigOut:
    # an engine URL may carry user:password@: never echoed
    return ConfigOut(id=c.id, name=c.name, model=c.model.name, baseline=c.is_baseline, spec=public_spec(c.spec))


@router.post("/projects/{project}/configs", status_code=status.HTTP_201_CREATED, response_model=ConfigOut,
             responses=error_responses(400, 403, 409))
def create_config(body: ConfigIn, project: ProjectDep, session: SessionDep) -> ConfigOut:
    try:
        repo.get_config(session, project, body.name)
        raise Conflict(f"name: config '{body.name}' already exists in project '{project.name}'; pick another name")
    except NotFound:
        pass
    check_project_room(session, project, "configs", [body.name], "name")
    model = repo.get_model(session, project, body.model)
    spec = body.to_spec()
    try:
        spec.check_available()
    except ConfigNotAvailable as e:
        raise ValueError(str(e)) from None
    check_config_fits_model(spec.model_dump(), model.path, "config", project.name)
    return _out(repo.upsert_config(session, project, model, body.name, spec.model_dump(), body.baseline))


@router.get("/projects/{project}/configs", response_model=list[ConfigOut])
def list_configs(project: ProjectDep, session: SessionDep) -> list[ConfigOut]:
    return [_out(config) for config in repo.list_configs(session, project)]


@router.get("/projects/{project}/configs/{name}", response_model=ConfigOut)
def get_config(name: str, project: ProjectDep, session: SessionDep) -> ConfigOut:
    return _out(repo.get_config(session, project, name))
