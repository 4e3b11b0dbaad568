"""The HTTP client of verl's actors on a megatron-serve server (the replica's server actor and its weight updater),
with the server's admin key, and its POST that raises on any status but 200.

The pool keeps idle connections without an expiry of its own: httpx's default (5 s) meets encode/httpcore#1110 when
many calls wait for a connection, as verl's agent loop makes them (the pool hands a waiting call an idle connection,
and a concurrent pass closes it on expiry before the call's task runs: the call fails with ``ReadError`` though the
server never closed anything). The server keeps an idle connection 130 s and the pool drops one the server closed
before reusing it (it checks it is not readable first)."""

from __future__ import annotations

from typing import Any

import httpx


def admin_client(url: str, admin_key: str) -> httpx.AsyncClient:
    """A client of the server at ``url`` sending ``admin_key``, with no time limit (a generate call lasts as long as
    its tokens) and no keep-alive expiry (the module's docstring)."""
    return httpx.AsyncClient(base_url=url, timeout=None, headers={"Authorization": f"Bearer {admin_key}"},
                             limits=httpx.Limits(keepalive_expiry=None))


async def post(client: httpx.AsyncClient, path: str, **kwargs: Any) -> Any:
    """``POST path``'s JSON answer (None for an empty body: ``/sleep`` and ``/wake_up`` answer one, as vLLM's); any
    status but 200 raises with the server's error."""
    answer = await client.post(path, **kwargs)
    if answer.status_code != 200:
        raise RuntimeError(f"POST {path}: {answer.status_code} {answer.text}")
    return answer.json() if answer.content else None
