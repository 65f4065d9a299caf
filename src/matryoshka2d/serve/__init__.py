"""The OpenAI-compatible embeddings server as a library: one model serves every (layer, dim) cell.

    from matryoshka2d.serve import ServerConfig, build_app, run

    app = build_app(ServerConfig(model="runs/st-ese", layers=[2, 4]))  # an ASGI app: TestClient(app), uvicorn
    run(ServerConfig(model="minilm-l6", port=8000))  # or the process: uvicorn, drain on SIGTERM, --workers

Inside, as text-embeddings-inference and vLLM are built: the routes (`http`), the OpenAI protocol (`protocol`), one
`Engine` that turns a parsed request into an answer (`engine`), what is served (`catalog`), micro-batching
(`batching`), admission (`admission`), the ladder of adaptive depth (`ladder`, `depth`), the backends behind a
`Backend` protocol (`backends`), loading (`loading`), and the process with its workers (`process`, `workers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["ServerConfig", "build_app", "run"]

if TYPE_CHECKING:
    from matryoshka2d.serve.app import build_app
    from matryoshka2d.serve.config import ServerConfig
    from matryoshka2d.serve.process import run


def __getattr__(name: str):
    """The public names, imported when first used: `matryoshka2d.serve.backends` and the other modules below
    (which pick and eval use) do not pull in FastAPI and uvicorn."""
    if name == "ServerConfig":
        from matryoshka2d.serve.config import ServerConfig

        return ServerConfig
    if name == "build_app":
        from matryoshka2d.serve.app import build_app

        return build_app
    if name == "run":
        from matryoshka2d.serve.process import run

        return run
    raise AttributeError(f"module 'matryoshka2d.serve' has no attribute {name!r}")
