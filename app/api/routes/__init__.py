from fastapi import APIRouter

from app.api.routes import alerting, catalogue, channels, configs, gates, projects, runs, schedules, suites, views

router = APIRouter()
for module in (projects, configs, suites, runs, gates, alerting, schedules, channels, views, catalogue):
    router.include_router(module.router)
