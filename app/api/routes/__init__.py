from fastapi import APIRouter

from app.api.routes import configs, projects, runs, suites

router = APIRouter()
for module in (projects, configs, suites, runs):
    router.include_router(module.router)
