"""The API key: ``/v1/*`` routes ask for it as ``Authorization: Bearer KEY`` when the server has one.

A key is also taken as the password of HTTP Basic (any user name): that is what ``requests`` and aiohttp send
from ``~/.netrc`` for a host when the caller sets no header, and the RL frameworks' clients (TRL's, SkyRL's,
slime's) set none of their own, so a line in the trainer's ``~/.netrc`` gives them the key unchanged.

Two forms of one check: a FastAPI dependency for the ordinary routes (and their OpenAPI security
scheme), and a plain coroutine for the lean generation routes, which run without FastAPI's layers
(:mod:`.fast_routes`).

The key file may also hold several keys, each naming its tenant (:mod:`.tenants`): the guard then accepts any of
them and notes which one a request presented, for its tenant's share and limits.
"""

from __future__ import annotations

import base64
import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import APIError
from .tenant_admission import note_key

if TYPE_CHECKING:
    from .tenants import TenantTable

API_KEY_ENV = "MEGATRON_SERVE_API_KEY"


@dataclass
class APIKeyGuard:
    """What the routes that need the API key carry: ``dependencies`` (none without a key) and ``authorize``
    (None without a key)."""

    dependencies: list[Any] = field(default_factory=list)
    authorize: Callable[[Request], Awaitable[None]] | None = None

    @property
    def on(self) -> bool:
        return self.authorize is not None


def presented_key(request: Request, credentials: HTTPAuthorizationCredentials | None) -> bytes:
    """The key a request presents: the Bearer token, else the password of HTTP Basic, else nothing."""
    if credentials is not None:
        return credentials.credentials.encode()
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return b""
    try:
        return base64.b64decode(encoded.strip(), validate=True).partition(b":")[2]
    except ValueError:  # binascii.Error: not base64
        return b""


def api_key_guard(api_key: str | None, tenants: TenantTable | None = None) -> APIKeyGuard:
    """The guard for ``api_key`` (an open server without one: 401 for a missing or wrong key otherwise), or with
    ``tenants`` for the keys of its table (the key file's document: :mod:`.tenants`), noting which key a request
    presented for its tenant (:func:`~.tenant_admission.note_key`)."""
    if (tenants is not None and not tenants.requires_key) or (tenants is None and not api_key):
        return APIKeyGuard()
    bearer = HTTPBearer(auto_error=False, description="the server's API key, as `Authorization: Bearer KEY`")
    expected = (api_key or "").encode()

    async def require_api_key(request: Request,
                              credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        offered = presented_key(request, credentials)
        if tenants is not None:
            entry = tenants.entry(offered)
            if entry is not None:
                note_key(entry)
                return
        elif offered and hmac.compare_digest(offered, expected):
            return
        raise APIError(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def check_key(request: Request) -> None:  # the dependency above, for the lean routes
        await require_api_key(request, await bearer(request))

    return APIKeyGuard([Depends(require_api_key)], check_key)
