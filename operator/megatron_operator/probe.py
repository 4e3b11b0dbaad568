"""Engine pod probes: ``python -m megatron_operator.probe registered|alive``.

Engines expose no port of their own; what tells whether a group works is whether the
coordinator has it registered. Both modes read the pod environment that ``render`` sets:
``MEGATRON_SERVE_COORDINATOR``, ``MEGATRON_SERVE_GROUP`` and ``MEGATRON_SERVE_TOKEN``.

- ``registered`` (startup and readiness): exit 0 when the coordinator lists an engine of this
  group, 1 otherwise (including when the coordinator cannot be reached).
- ``alive`` (liveness): exit 1 only when a reachable coordinator does *not* list this group
  while it is not STOPPED; an unreachable coordinator is no reason to restart engines.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from .coordinator_link import CoordinatorUnavailable, open_link


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


PROBE_MODES = ("registered", "alive")


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
    address = os.environ.get("MEGATRON_SERVE_COORDINATOR", "")
    group_text = os.environ.get("MEGATRON_SERVE_GROUP", "")
    if not address or not group_text.isdigit():
        print("probe: MEGATRON_SERVE_COORDINATOR and MEGATRON_SERVE_GROUP must be set", file=sys.stderr)
        return 2
    token = os.environ.get("MEGATRON_SERVE_TOKEN") or None
    rc, message = asyncio.run(_check(mode, address, int(group_text), token, timeout=5.0))
    print(message, file=sys.stderr if rc else sys.stdout)
    return rc


if __name__ == "__main__":
    sys.exit(main())
