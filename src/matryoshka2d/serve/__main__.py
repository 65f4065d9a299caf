"""`python -m matryoshka2d.serve`: one worker of `matryoshka2d serve --workers N`, started by the parent
(serve/workers.py) with its ServerConfig as JSON in the environment. A user runs `matryoshka2d serve`."""

from __future__ import annotations

import os
import sys

from matryoshka2d.serve.config import ServerConfig
from matryoshka2d.serve.process import run
from matryoshka2d.serve.workers import CONFIG_ENV


def main() -> int:
    """Serve the config the parent gave; a config or model refused is one line, as the command prints it, exit 2."""
    text = os.environ.pop(CONFIG_ENV, None)  # a process this one starts is no worker
    if text is None:
        print(f"matryoshka2d serve: error: {CONFIG_ENV} is not set; run `matryoshka2d serve`", file=sys.stderr)
        return 2
    try:
        return run(ServerConfig.from_json(text))
    except (ValueError, TypeError, OSError) as exc:
        print(f"matryoshka2d serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
