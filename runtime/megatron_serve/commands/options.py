"""Options shared by the fleet commands (``coordinator``, ``engine``, ``control``, ``server``, ``run``).

* the fleet secret: ``--token-file`` or ``$MEGATRON_SERVE_TOKEN`` (``docs/security.md``; ``--insecure``, a fleet
  without one, and the other options: :mod:`.flags`);
* one logging format for every long-running process;
* one exit code for a serving command stopped by a signal (:func:`stopped_exit_code`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ..wire.security import TOKEN_ENV, read_secret_file
from .flags import add_flags


def add_token_option(parser: argparse.ArgumentParser, default: str = "none") -> None:
    """``--token-file``; ``default``: what a command without one uses (said in its help)."""
    add_flags(parser, "token", TOKEN_ENV=TOKEN_ENV, token_default=default)


def read_secret(args: argparse.Namespace, attribute: str, flag: str, env: str) -> str | None:
    """A secret from the file named by ``flag`` (attribute ``attribute``), else ``$env``, else ``None``."""
    path = getattr(args, attribute, None)
    if path:
        return read_secret_file(path, flag).decode()
    return os.environ.get(env) or None


def read_token(args: argparse.Namespace) -> str | None:
    """The fleet secret from ``--token-file``, else ``$MEGATRON_SERVE_TOKEN``, else ``None``; one that is too
    short to be a secret raises ``ValueError`` naming where it came from."""
    from ..wire.security import WeakSecret, fleet_secret  # noqa: PLC0415 - zmq: only when the command runs

    token = read_secret(args, "token_file", "--token-file", TOKEN_ENV)
    try:
        fleet_secret(token)
    except WeakSecret as exc:
        source = f"--token-file {args.token_file}" if getattr(args, "token_file", None) else f"${TOKEN_ENV}"
        raise ValueError(f"{source}: {exc}") from None
    return token


COORDINATOR_ENV = "MEGATRON_SERVE_COORDINATOR"


def add_coordinator_option(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--coordinator ADDRESS`` (checked by :func:`~megatron_serve.commands.inputs.coordinator_address`);
    optional for ``control``, which finds a local ``run`` on its own."""
    if required:
        parser.add_argument("--coordinator", required=True, metavar="ADDRESS",
                            help="e.g. tcp://127.0.0.1:5555 or HOST:PORT")
    else:
        parser.add_argument("--coordinator", metavar="ADDRESS", default=None,
                            help=f"e.g. tcp://10.0.0.5:5555 or HOST:PORT (default: ${COORDINATOR_ENV}, else the "
                                 "coordinator of the `megatron-serve run` on this machine)")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stopped_exit_code(signum: int | None) -> int:
    """The exit code of ``run``, ``serve`` or ``server`` stopped by ``signum`` (the first signal; None: none), the same
    at any point of its life: 130 for SIGINT, the shell's code for an interrupt (as vLLM's CLI exits on Ctrl-C);
    0 for SIGTERM and SIGHUP, a stop asked of a service (Kubernetes, systemd), done."""
    return 128 + signal.SIGINT if signum == signal.SIGINT else 0
