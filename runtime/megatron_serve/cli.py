"""The ``megatron-serve`` command: one subcommand per process role (docs/reference/cli.md).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, and none of them imports torch, transformers or
FastAPI before its ``run``, so that ``--help`` and a refused option answer at once instead of after
torch's import (tests/commands/test_cli.py holds the time; the figures: docs/design-measurements.md).

Every parser refuses abbreviations (``allow_abbrev=False``: ``--api-key abc`` once silently meant
``--api-key-file abc``) and prints every option's default in ``--help``. An argument a subcommand
cannot parse (an unknown option, a bad value, a refused vLLM option) prints that subcommand's usage
in one line and the reason in another (:class:`SubcommandParser`: the whole usage of ``run`` would
bury the reason); a failed check once parsed is one line that says what to fix. vLLM options that change nothing here
are warned about, one line each, before the command runs (:mod:`megatron_serve.client.vllm_options`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
from typing import NoReturn

from .package import __version__
from .client.vllm_options import accepted_warnings
from .processes.lifeline import hold_lifeline

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("megatron_serve.commands.make_tiny_model", "write a small random Llama-family model + tokenizer"),
    "generate": ("megatron_serve.commands.generate", "generate from a model directory in this process"),
    "coordinator": ("megatron_serve.commands.coordinator", "run the coordinator (routing, request table, lifecycle)"),
    "engine": ("megatron_serve.commands.engine", "run one engine group that serves a coordinator"),
    "control": ("megatron_serve.commands.control", "run a lifecycle verb on a fleet (pause, refit, ...) or show its status"),
    "server": ("megatron_serve.commands.server", "run the OpenAI-compatible HTTP server in front of a coordinator"),
    "run": ("megatron_serve.commands.run", "coordinator + engines + HTTP server on this machine, as one command"),
    "serve": ("megatron_serve.commands.serve", "`serve MODEL [options]`, as in vLLM: the same as `run --model MODEL`"),
    "rendezvous-store": ("megatron_serve.commands.rendezvous_store", "serve an elastic expert group's rendezvous store "
                                                                     "in a process of its own"),
    "download": ("megatron_serve.commands.download", "fetch a Hugging Face Hub model into the local cache or a "
                                                     "directory"),
    "operator": ("megatron_operator.commands.operator", "run the Kubernetes operator (options pass through to kopf run)"),
    "render": ("megatron_operator.commands.render", "print the child objects the operator would create for a resource"),
    "metrics-adapter": ("megatron_operator.commands.metrics_adapter", "serve the fleets' metrics as the custom "
                                                                       "metrics API, for a HorizontalPodAutoscaler"),
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default: appended as ``(default: X)`` unless the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is argparse.SUPPRESS or not action.option_strings or action.required
                or "(default" in text or "%(default" in text):
            return text
        if action.default is None or action.default is False:
            shown = "off" if isinstance(action, argparse._StoreTrueAction) else "none"
        elif action.default is True:
            shown = "on"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose errors are two lines: a short usage (the positional arguments, then
    ``[options]``) and the reason. ``--help`` still shows everything."""

    def short_usage(self) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(None, self._get_positional_actions(), [])
        return " ".join(formatter.format_help().split()) + " [options] (--help lists them)"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a ``megatron-serve`` command line exactly as :func:`main` does, without running it.

    Only the chosen subcommand's module is imported. The release check runs this in the installed
    wheel on every container command the operator renders, so a renamed flag cannot ship.
    """
    parser = argparse.ArgumentParser(prog="megatron-serve", description="Megatron-style LLM inference stack.",
                                     allow_abbrev=False, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"megatron-serve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)
    chosen = argv[0] if argv else None
    subs: dict[str, argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        subs[name] = sub = subparsers.add_parser(name, help=help_text, description=help_text, allow_abbrev=False,
                                                 formatter_class=HelpFormatter)
        sub.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        parser.exit(2)
    if extra and not getattr(importlib.import_module(args._module), "ACCEPTS_EXTRA_ARGS", False):
        subs[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    return args


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has left (``control status | head``): the kernel flags
    its write end with POLLERR. A broken pipe of any other file (a socket) is not this command's output."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    hold_lifeline()  # a child of a local fleet dies with it
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    module = importlib.import_module(args._module)
    for line in accepted_warnings(args):
        print(f"megatron-serve {args.command}: warning: {line}", file=sys.stderr, flush=True)
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # here, not at exit, where a reader that left (`| head`) meant a traceback
        return code
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's last flush must not fail again
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # as a command the shell's SIGPIPE ended: 141, quietly
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # one line that says what to fix
        print(f"megatron-serve {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
