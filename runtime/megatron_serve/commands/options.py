"""Options shared by the fleet commands (``coordinator``, ``engine``, ``control``, ``server``, ``run``).

* the fleet secret: ``--token-file`` or ``$MEGATRON_SERVE_TOKEN`` (``docs/security.md``), and
  ``--insecure`` for a fleet without one (benchmarks);
* the coordinator's routing (``--routing``, ``--session-affinity-ttl``), which ``run`` passes to the one it starts;
* one logging format for every long-running process;
* one exit code for a serving command stopped by a signal (:func:`stopped_exit_code`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ..coordinator.routing import KNOWN_POLICIES
from ..wire.security import TOKEN_ENV


def add_token_option(parser: argparse.ArgumentParser, default: str = "none") -> None:
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the fleet secret, at least 32 random characters: it encrypts the "
                             f"fleet's connections and proves who may join (default: ${TOKEN_ENV}, else {default})")


def add_routing_options(parser: argparse.ArgumentParser) -> None:
    """The coordinator's choice of engine group, declared once for ``coordinator`` and ``run`` (whose coordinator
    takes them as given)."""
    parser.add_argument("--routing", choices=KNOWN_POLICIES, default="least_loaded",
                        help="which engine group gets a request")
    parser.add_argument("--session-affinity-ttl", type=float, default=600.0, metavar="S",
                        help="forget a session's engine (X-Session-ID, a body's session_id) after this many seconds "
                             "without a request of it; until then its requests go back to that engine while it is "
                             "under its load bound (docs/kv-routing.md)")


def add_insecure_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--insecure", action="store_true",
                        help="serve without a fleet secret: no authentication and no encryption between the "
                             "processes, so anyone who reaches the coordinator can join, read prompts and steer the "
                             "fleet (benchmarks only; said in the log)")


def read_secret(args: argparse.Namespace, attribute: str, flag: str, env: str) -> str | None:
    """A secret from the file named by ``flag`` (attribute ``attribute``), else ``$env``, else ``None``."""
    path = getattr(args, attribute, None)
    if path:
        try:
            with open(path) as fh:
                secret = fh.read().strip()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read {flag} {path}: {exc.strerror}") from None
        if not secret:
            raise ValueError(f"{flag} {path} is empty")
        return secret
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


def add_log_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log messages from this level up go to stderr")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stopped_exit_code(signum: int | None) -> int:
    """The exit code of ``run``, ``serve`` or ``server`` stopped by ``signum`` (the first signal; None: none), the same
    at any point of its life: 130 for SIGINT, the shell's code for an interrupt (as vLLM's CLI exits on Ctrl-C);
    0 for SIGTERM and SIGHUP, a stop asked of a service (Kubernetes, systemd), done."""
    return 128 + signal.SIGINT if signum == signal.SIGINT else 0
