from fastapi import APIRouter

from app.api.routes import alerting, channels, configs, gates, projects, runs, schedules, suites

router = APIRouter()
for module in (projects, configs, suites, runs, gates, alerting, schedules, channels):
    router.include_router(module.router)
