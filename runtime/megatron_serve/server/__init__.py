"""The OpenAI-compatible HTTP server (docs/reference/http-api.md).

``create_app`` builds the FastAPI app over an ``InferenceClient`` (or anything with its
interface); ``serve_app`` runs an app on uvicorn; ``serve_async_llm`` serves a
``MegatronAsyncLLM`` in this process. Submodules have one job each: ``models`` (request and response
bodies), ``errors`` (the OpenAI error shape), ``translate`` (bodies to engine requests),
``generation`` (submitting, streaming and aborting), ``completions`` / ``chat`` (the two
endpoints), ``fleet`` (the coordinator's status), ``metrics`` (Prometheus), ``streaming`` (SSE and
disconnects), ``runner`` (uvicorn), ``local`` (serving a ``MegatronAsyncLLM``).
"""


from __future__ import annotations

from typing import TYPE_CHECKING

from ..package import lazy_exports

# Imported on first use (PEP 562): the probe process runs ``server.probe_process`` and needs none of FastAPI,
# which importing ``.app`` here cost it (some 1.5 s of CPU at each start).
_EXPORTS = {"API_KEY_ENV": ".app", "create_app": ".app", "bind_socket": ".runner", "serve_app": ".runner",
            "serve_async_llm": ".local"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .app import API_KEY_ENV, create_app
    from .local import serve_async_llm
    from .runner import bind_socket, serve_app


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
