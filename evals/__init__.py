"""Scorers and statistics: a pure library (no DB, no Celery, no FastAPI)."""
