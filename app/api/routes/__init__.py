from fastapi import APIRouter

from app.api.routes import alerting, configs, gates, projects, runs, suites

router = APIRouter()
for module in (projects, configs, suites, runs, gates, alerting):
    router.include_router(module.router)
