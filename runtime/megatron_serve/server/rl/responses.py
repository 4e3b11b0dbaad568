"""The error answers the RL frameworks' routes that act document (they need the admin key), for the OpenAPI document:
one table for the control and the weight routes."""

from __future__ import annotations

from typing import Any

from ..models import ErrorResponse

#: A control route that acts.
ACTING_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": description} for code, description in (
        (400, "a bad or unknown query parameter or body field (named)"),
        (401, "no admin key presented"),
        (403, "a wrong admin key (the API key included), or no admin key configured"),
        (409, "the lifecycle refuses the verb in the fleet's state (the message says why)"),
        (503, "the coordinator is unreachable or did not acknowledge"))}

#: A weight route: the same, and 501 for what this server does not do (a framework's own wire format).
WEIGHT_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ACTING_RESPONSES, 501: {"model": ErrorResponse, "description": "not implemented here (the message says why)"}}
