"""``--enable-log-requests``: one log line when a request arrives and one when it ends, named by its id.

The id is the response's (``cmpl-...``/``chatcmpl-...``), which carries the client's ``request_id``
or ``X-Request-Id`` when it sent one (vLLM's fields), so a client's id finds its request in the
server log. Lines go to the ``megatron_serve.requests`` logger at INFO, which the option turns on
whatever ``--log-level`` says (as in vLLM, requests are not logged unless asked). The prompt is cut
to ``--max-log-len`` characters; a request's ``cache_salt`` (a tenant's secret) is never logged.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol, Sequence

import msgspec
from fastapi import Request

from ..wire.request import DynamicInferenceRequest
from .errors import bad_request
from .vllm_fields import REQUEST_ID

if TYPE_CHECKING:  # annotations only
    from .translate import EngineJob

logger = logging.getLogger("megatron_serve.requests")


def request_id_header(request: Request) -> str | None:
    """The ``X-Request-Id`` header (vLLM: it names the request, before the body's ``request_id``), checked."""
    value = request.headers.get("x-request-id")
    if value is not None and not REQUEST_ID.match(value):
        raise bad_request("the X-Request-Id header must be 1 to 256 printable ASCII characters",
                          param="X-Request-Id")
    return value


class Handled(Protocol):
    """What the log reads of an endpoint's handler."""

    id: str
    jobs: list[EngineJob]


class RequestLog:
    """Logs requests when ``enabled`` (a no-op otherwise); ``max_len``: prompt characters shown (None: all)."""

    def __init__(self, enabled: bool = False, max_len: int | None = None) -> None:
        self.enabled = enabled
        self.max_len = max_len
        if enabled:
            logger.setLevel(logging.INFO)

    def received(self, handler: Handled) -> None:
        if not self.enabled or not handler.jobs:
            return
        prompts = {job.prompt_index: job.prompt for job in handler.jobs}
        params = handler.jobs[0].params.to_dict()
        params.pop("cache_salt", None)
        params.pop("sample_index", None)  # differs per choice; the first choice's is 0
        first = prompts[min(prompts)]
        text = first.text if first.text is not None else f"<{len(first.tokens)} token ids>"
        if self.max_len is not None and len(text) > self.max_len:
            text = text[: self.max_len] + "..."
        logger.info("request %s received: %d prompt(s) of %s tokens, %d engine request(s), params %s, prompt %r",
                    handler.id, len(prompts), "+".join(str(len(p.tokens)) for p in prompts.values()),
                    len(handler.jobs), msgspec.json.encode(params).decode(), text)

    def finished(self, label: str, results: Sequence[DynamicInferenceRequest], started: float) -> None:
        if not self.enabled:
            return
        reasons = ",".join(sorted({str(r.finish_reason.value) if r.finish_reason else "none" for r in results}))
        logger.info("request %s finished in %.3fs: %d generated token(s), finish reason %s", label,
                    time.monotonic() - started, sum(len(r.generated_tokens) for r in results), reasons)

    def aborted(self, label: str, count: int, started: float) -> None:
        if self.enabled:
            logger.info("request %s aborted after %.3fs: %d engine request(s) unfinished (the client left, or the "
                        "server stops)", label, time.monotonic() - started, count)
