"""The OpenAI-compatible HTTP server (docs/reference/http-api.md).

``create_app`` builds the FastAPI app over an ``InferenceClient`` (or anything with its
interface); ``serve_app`` runs an app on uvicorn; ``serve_async_llm`` is what
``MegatronAsyncLLM.serve()`` calls. Submodules have one job each: ``models`` (request and response
bodies), ``errors`` (the OpenAI error shape), ``translate`` (bodies to engine requests),
``generation`` (submitting, streaming and aborting), ``completions`` / ``chat`` (the two
endpoints), ``fleet`` (the coordinator's status), ``metrics`` (Prometheus), ``streaming`` (SSE and
disconnects), ``runner`` (uvicorn), ``local`` (serving a ``MegatronAsyncLLM``).
"""

from .app import API_KEY_ENV, create_app
from .runner import bind_socket, serve_app
from .local import serve_async_llm

__all__ = ["API_KEY_ENV", "bind_socket", "create_app", "serve_app", "serve_async_llm"]
