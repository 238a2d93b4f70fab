from __future__ import annotations

from fastapi import APIRouter, status
from sqlalchemy import select

from app import repo
from app.api.deps import KeyDep, ProjectDep, SessionDep
from app.auth import Forbidden
from app.models import Model, Project
from app.repo import Conflict
from app.schemas import ModelIn, ModelOut, ProjectIn, ProjectOut, error_responses
from app.services import check_model_path
from app.ssrf import mask_userinfo

router = APIRouter(tags=["projects"])


@router.post("/projects", status_code=status.HTTP_201_CREATED, response_model=ProjectOut,
             responses=error_responses(400, 403, 409))
def create_project(body: ProjectIn, session: SessionDep, key: KeyDep) -> ProjectOut:
    if key is not None:
        raise Forbidden("API keys are scoped to one project and cannot create projects; an operator runs "
                        "`canary keys create --project NAME` (which creates it) or `canary run -f canary.yaml`")
    if session.scalar(select(Project).where(Project.name == body.name)) is not None:
        raise Conflict(f"name: project '{body.name}' already exists")
    project = repo.get_or_create_project(session, body.name)
    return ProjectOut(id=project.id, name=project.name)


@router.get("/projects", response_model=list[ProjectOut])
def list_projects(session: SessionDep, key: KeyDep) -> list[ProjectOut]:
    query = select(Project).order_by(Project.id)
    if key is not None:
        query = query.where(Project.id == key.project_id)  # a key sees its own project only
    return [ProjectOut(id=project.id, name=project.name) for project in session.scalars(query)]


@router.post("/projects/{project}/models", status_code=status.HTTP_201_CREATED, response_model=ModelOut,
             responses=error_responses(400, 403, 404, 409))
def create_model(body: ModelIn, project: ProjectDep, session: SessionDep) -> ModelOut:
    if session.scalar(select(Model).where(Model.project_id == project.id, Model.name == body.name)) is not None:
        raise Conflict(f"name: model '{body.name}' already exists in project '{project.name}'")
    check_model_path(body.path, "path", project.name)
    model = repo.upsert_model(session, project, body.name, body.path)
    return ModelOut(id=model.id, name=model.name, path=mask_userinfo(model.path))


@router.get("/projects/{project}/models", response_model=list[ModelOut], responses=error_responses(404))
def list_models(project: ProjectDep, session: SessionDep) -> list[ModelOut]:
    rows = session.scalars(select(Model).where(Model.project_id == project.id).order_by(Model.id))
    return [ModelOut(id=model.id, name=model.name, path=mask_userinfo(model.path)) for model in rows]
