"""Options shared by the fleet commands (``coordinator``, ``engine``, ``control``, ``run``).

* the shared token: ``--token-file`` or ``$MEGATRON_SERVE_TOKEN`` (docs/reference/cli.md);
* one logging format for every long-running process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..fleet_argv import TOKEN_ENV


def add_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the shared coordinator token (default: ${TOKEN_ENV}, else no token)")


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
    """The shared token from ``--token-file``, else ``$MEGATRON_SERVE_TOKEN``, else ``None``."""
    return read_secret(args, "token_file", "--token-file", TOKEN_ENV)


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
