"""`build_app(config)`: the server as an ASGI app, for uvicorn (serve/process.py) or in-process use with FastAPI's
TestClient."""

from __future__ import annotations

from matryoshka2d.serve.config import ServerConfig
from matryoshka2d.serve.engine import Engine, Models
from matryoshka2d.serve.http import Front, app_for


def build_app(config: ServerConfig, models: Models | None = None) -> Front:
    """The ASGI app that serves `config` (the FastAPI app of its routes behind the Guard: `Front`): the model and
    its query encoders loaded and checked, their backends and ladder built (serve/loading.py), unless `models` gives
    them already in memory (then `config` sets the limits, defaults and guards, and `models.name` the served name).
    `app.state.engine` is the engine that answers its requests."""
    if models is None:
        from matryoshka2d.serve.loading import load_models

        models = load_models(config)
    return app_for(Engine(config, models))
