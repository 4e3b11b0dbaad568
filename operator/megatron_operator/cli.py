"""Entry points for the ``megatron-serve`` command (the CLI module itself lives in the runtime).

- ``megatron-serve render -f FILE``   -> :func:`render_command` (``FILE`` may be ``-`` for stdin)
- ``megatron-serve operator [ARGS]``  -> :func:`operator_command` (ARGS pass through to ``kopf run``)

Both return a process exit status. :mod:`megatron_operator.commands.render` and
:mod:`megatron_operator.commands.operator` wrap them in the CLI's subcommand-module shape
(``add_arguments(parser)`` / ``run(args)``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from .config import ENV_PEERING_PRIORITY
from .render import render_command, render_main

__all__ = ["render_command", "render_main", "operator_command", "kopf_argv", "refuse_two_priorities"]

HANDLERS_MODULE = "megatron_operator.handlers"


def kopf_argv(extra_args: Sequence[str]) -> list[str]:
    """The ``kopf run`` argument list: our handlers module plus the user's options.

    Without any namespace option the operator serves the whole cluster (``--all-namespaces``).
    """
    extra = list(extra_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    scoped = any(a in ("-A", "--all-namespaces") or a in ("-n", "--namespace") or a.startswith("--namespace=")
                 for a in extra)
    argv = ["run", "--module", HANDLERS_MODULE]
    if not scoped:
        argv.append("--all-namespaces")
    return argv + extra


def refuse_two_priorities(extra_args: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse kopf's ``--priority``/``-p`` (or ``--dev``, priority 666) beside ``$MEGATRON_OPERATOR_PEERING_PRIORITY``:
    the operator applies the variable at startup, after kopf has read its options, so the option would be dropped
    without a word."""
    if not (env.get(ENV_PEERING_PRIORITY) or "").strip():
        return
    for arg in extra_args:
        if arg in ("--priority", "--dev") or arg.startswith("--priority=") or \
                (arg.startswith("-p") and not arg.startswith("--")):
            raise ValueError(f"{arg} and ${ENV_PEERING_PRIORITY} both set kopf's peering priority; keep one")


def operator_command(extra_args: Sequence[str] = ()) -> int:
    """Run the kopf operator in this process until it is stopped; returns the exit status."""
    import kopf.cli

    try:
        refuse_two_priorities(extra_args, os.environ)
        kopf.cli.main.main(args=kopf_argv(extra_args), prog_name="megatron-serve operator", standalone_mode=False)
    except SystemExit as exc:  # click may still exit for --help and usage errors
        return int(exc.code or 0) if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # click usage errors and startup failures: one clear line
        print(f"megatron-serve operator: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_operator [render -f FILE | operator ARGS...]`` (handy without the CLI)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "render":
        return render_main(args[1:])
    if args and args[0] == "operator":
        args = args[1:]
    return operator_command(args)
