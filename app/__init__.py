"""inference-canary service: settings, DB models, repositories, API, CLI. Never imports torch."""

__version__ = "0.1.0"
