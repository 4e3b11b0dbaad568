"""Pod probes: ``python -m megatron_operator.probe registered|alive|coordinator``.

Engines expose no port of their own; what tells whether a group works is whether the
coordinator has it registered. The engine modes read the pod environment that ``render`` sets:
``MEGATRON_SERVE_COORDINATOR``, ``MEGATRON_SERVE_GROUP`` and ``MEGATRON_SERVE_TOKEN``.

- ``registered`` (startup and readiness): exit 0 when the coordinator lists an engine of this
  group, 1 otherwise (including when the coordinator cannot be reached).
- ``alive`` (liveness): exit 1 only when a reachable coordinator does *not* list this group
  while it is not STOPPED; an unreachable coordinator is no reason to restart engines.
- ``coordinator`` (the coordinator container's liveness): exit 0 when the coordinator in this pod
  (``MEGATRON_SERVE_COORDINATOR``, else its port on 127.0.0.1) answers a STATUS within
  :data:`COORDINATOR_DEADLINE` seconds, 1 otherwise. A stopped (SIGSTOP) or spinning coordinator keeps
  its port open, and the kernel still completes a TCP connection to it: a ``tcpSocket`` probe passes
  while it answers nobody. Asking the loop that serves requests is what tells a hung one.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from .coordinator_link import CoordinatorUnavailable, open_link
from .names import COORDINATOR_PORT

#: Seconds the coordinator has to answer the ``coordinator`` probe: the handshake and one STATUS, both
#: served by its loop in milliseconds when it runs (the render's ``timeoutSeconds`` leaves room for the
#: probe's own start).
COORDINATOR_DEADLINE = 5.0


def group_registered(status: dict[str, Any], group: int) -> bool:
    for engine in status.get("engines") or []:
        try:
            if int(engine.get("group", -1)) == group:
                return True
        except (TypeError, ValueError):
            continue
    return False


async def _check(mode: str, address: str, group: int, token: str | None, timeout: float) -> tuple[int, str]:
    try:
        link = await open_link(address, token, timeout)
    except CoordinatorUnavailable as exc:
        return (1 if mode == "registered" else 0), str(exc)
    try:
        status = await link.status(timeout)
    except CoordinatorUnavailable as exc:
        return (1 if mode == "registered" else 0), str(exc)
    finally:
        await link.close()
    registered = group_registered(status, group)
    if registered:
        return 0, f"group {group} registered (coordinator {status.get('state')})"
    if mode == "alive" and str(status.get("state", "")).upper() == "STOPPED":
        return 0, "coordinator STOPPED"
    return 1, f"group {group} is not registered with the coordinator at {address}"


async def _coordinator_answers(address: str, token: str | None, deadline: float) -> tuple[int, str]:
    """0 when the coordinator at ``address`` answers a STATUS within ``deadline`` seconds in all, else 1."""
    started = time.monotonic()
    try:
        link = await open_link(address, token, deadline)
        try:
            status = await link.status(max(0.1, deadline - (time.monotonic() - started)))
        finally:
            await link.close()
    except CoordinatorUnavailable as exc:
        return 1, f"the coordinator at {address} did not answer within {deadline:g}s: {exc}"
    return 0, f"the coordinator at {address} answered in {time.monotonic() - started:.2f}s ({status.get('state')})"


PROBE_MODES = ("registered", "alive", "coordinator")


def parse_mode(argv: list[str]) -> str:
    """The probe's one argument (default ``registered``); ``SystemExit(2)`` with a usage line otherwise.

    The release check parses every probe command the operator renders with this, in the installed wheel.
    """
    mode = argv[0] if argv else "registered"
    if len(argv) > 1 or mode not in PROBE_MODES:
        print(f"usage: python -m megatron_operator.probe {'|'.join(PROBE_MODES)} (got {' '.join(argv)!r})",
              file=sys.stderr)
        raise SystemExit(2)
    return mode


def main(argv: list[str] | None = None) -> int:
    try:
        mode = parse_mode(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    token = os.environ.get("MEGATRON_SERVE_TOKEN") or None
    if mode == "coordinator":
        address = os.environ.get("MEGATRON_SERVE_COORDINATOR") or f"tcp://127.0.0.1:{COORDINATOR_PORT}"
        rc, message = asyncio.run(_coordinator_answers(address, token, COORDINATOR_DEADLINE))
        print(message, file=sys.stderr if rc else sys.stdout)
        return rc
    address = os.environ.get("MEGATRON_SERVE_COORDINATOR", "")
    group_text = os.environ.get("MEGATRON_SERVE_GROUP", "")
    if not address or not group_text.isdigit():
        print("probe: MEGATRON_SERVE_COORDINATOR and MEGATRON_SERVE_GROUP must be set", file=sys.stderr)
        return 2
    rc, message = asyncio.run(_check(mode, address, int(group_text), token, timeout=5.0))
    print(message, file=sys.stderr if rc else sys.stdout)
    return rc


if __name__ == "__main__":
    sys.exit(main())
