"""``megatron-serve server``: the OpenAI-compatible HTTP server in front of a coordinator.

The server holds no model: it tokenizes, validates and forwards requests through an
``InferenceClient``. It may start before its coordinator (it then reports not-ready and answers
503 until the coordinator appears), and several servers may share one coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..generation_config import GenerationDefaults
from ..heap import pause_collection_until_started
from ..http_options import HTTPOptions, TenancyOptions
from ..limits import MAIN_BACKLOG, RequestLimits
from ..multimodal import ImageOptions
from . import api_servers, local_runs
from .flags import add_flags
from .inputs import check_model_dir, coordinator_address, parse_port
from .model_options import add_model_options, resolve_model_args
from .options import (add_coordinator_option, add_token_option, read_secret, read_token, setup_logging,
                      stopped_exit_code)
from ..client.vllm_options import Scope, add_vllm_options

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

logger = logging.getLogger("megatron_serve.server")

API_KEY_ENV = "MEGATRON_SERVE_API_KEY"  # the same name as megatron_serve.server.API_KEY_ENV (kept light here)
ADMIN_KEY_ENV = "MEGATRON_SERVE_ADMIN_KEY"  # the same as megatron_serve.server.admin.ADMIN_KEY_ENV


def add_server_options(parser: argparse.ArgumentParser, default_host: str) -> None:
    """HTTP options shared by ``server`` and ``run`` (``flags.yaml``'s sections), and the request limits."""
    add_flags(parser.add_argument_group("HTTP server"), "http_server", default_host=default_host,
              API_KEY_ENV=API_KEY_ENV, ADMIN_KEY_ENV=ADMIN_KEY_ENV)
    add_flags(parser.add_argument_group("tenants", "several keys in the key file, each with its tenant, class and "
                                                   "limits (docs/tenants.md); these flags: the fairness header and "
                                                   "when sheddable requests are refused"), "tenants")
    limits = parser.add_argument_group("request limits", "what one request may carry; beyond it, 400 or 413 "
                                                         "before any work is done")
    defaults = RequestLimits()
    for name, flag, text in RequestLimits.flags():
        default = getattr(defaults, name)
        kind = RequestLimits.flag_type(name)
        shown = f" (default: {kind(default)!r})" if default is not None else ""
        limits.add_argument(flag, dest=name, type=kind, default=None, metavar="S" if kind is float else "N",
                            help=text + shown)
    add_flags(parser.add_argument_group("images (vision-language models)"), "images")
    add_vllm_options(parser, Scope.SERVER)


def tenancy_options(args: argparse.Namespace) -> TenancyOptions:
    """The tenancy settings from the flags (``ValueError`` names a bad one)."""
    return TenancyOptions.from_args(args)


def image_options(args: argparse.Namespace) -> ImageOptions:
    """How chat images are fetched, from the flags (``ValueError`` names a bad one)."""
    if not args.image_fetch_timeout > 0:
        raise ValueError(f"--image-fetch-timeout must be > 0, got {args.image_fetch_timeout}")
    return ImageOptions(fetch_timeout=args.image_fetch_timeout, allow_remote=args.remote_images)


def read_limits(args: argparse.Namespace) -> RequestLimits:
    """The request limits from the flags (``ValueError`` names a bad one)."""
    return RequestLimits.from_options(vars(args))


def _read_key(args: argparse.Namespace, name: str, env: str) -> str | None:
    """A key from ``--NAME``, else ``--NAME-file``, else ``$env``, else ``None`` (``name``: api_key, admin_key)."""
    flag = "--" + name.replace("_", "-")
    value = getattr(args, name)
    if value is not None:
        if not value.strip():
            raise ValueError(f"{flag} is empty")
        return value.strip()
    return read_secret(args, f"{name}_file", f"{flag}-file", env)


def read_api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key``, else ``--api-key-file``, else ``$MEGATRON_SERVE_API_KEY``, else ``None``."""
    return _read_key(args, "api_key", API_KEY_ENV)


def read_admin_key(args: argparse.Namespace) -> str | None:
    """The admin key from ``--admin-key``, else ``--admin-key-file``, else ``$MEGATRON_SERVE_ADMIN_KEY``, else None."""
    return _read_key(args, "admin_key", ADMIN_KEY_ENV)


def check_server_options(args: argparse.Namespace) -> None:
    parse_port(args.port, "--port")
    admin_key = read_admin_key(args)
    if admin_key is not None and admin_key == read_api_key(args):
        raise ValueError("the admin key (--admin-key-file, --admin-key or $MEGATRON_SERVE_ADMIN_KEY) must differ "
                         "from the API key: the API key must not open the admin API")
    api_servers.check_option(args)
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise ValueError(f"--max-concurrent-requests must be >= 1, got {args.max_concurrent_requests}")
    if not args.read_timeout > 0:
        raise ValueError(f"--read-timeout must be > 0, got {args.read_timeout}")
    if not args.timeout_keep_alive > 0:
        raise ValueError(f"--timeout-keep-alive must be > 0, got {args.timeout_keep_alive}")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout (vLLM's --shutdown-timeout) must be >= 0, got {args.drain_timeout}")
    if not args.coordinator_grace >= 0:
        raise ValueError(f"--coordinator-grace must be >= 0, got {args.coordinator_grace}")
    if args.health_port is not None:
        parse_port(args.health_port, "--health-port")
        if args.health_port != 0 and args.health_port == args.port:
            raise ValueError(f"--health-port must differ from --port ({args.port})")
    for flag in ("status_interval", "status_timeout", "ready_timeout", "health_stall_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.tokenizer_threads is not None and args.tokenizer_threads < 1:
        raise ValueError(f"--tokenizer-threads must be >= 1, got {args.tokenizer_threads}")
    read_limits(args)
    image_options(args)
    HTTPOptions.from_args(args)
    from ..server.tenants import tenant_table  # noqa: PLC0415 - the server package: not for --help

    tenants = tenant_table(read_api_key(args), tenancy_options(args))  # a key document's errors, before any start
    if admin_key is not None and tenants is not None and tenants.entry(admin_key.encode()) is not None:
        raise ValueError("the admin key must differ from every API key of the key file")


@dataclass(frozen=True)
class ServingFiles:
    """What the HTTP server reads besides the model's limits, checked before any process starts:
    the tokenizer's directory, ``--chat-template`` and the ``--generation-config`` defaults."""

    tokenizer_dir: str
    chat_template: str | None
    generation_defaults: GenerationDefaults

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServingFiles":
        """Read and check the template and the defaults (fast: no tokenizer is loaded yet); logs what applies."""
        from ..tokenizer import load_chat_template  # noqa: PLC0415

        template = load_chat_template(args.chat_template) if args.chat_template is not None else None
        defaults = GenerationDefaults.load(args.generation_config, args.model)
        logger.info("%s", defaults.describe())
        return cls(args.tokenizer or args.model, template, defaults)

    def load_tokenizer(self) -> Tokenizer:
        from ..tokenizer import Tokenizer as Loaded  # noqa: PLC0415 - transformers: only when serving

        return Loaded.from_pretrained(self.tokenizer_dir, chat_template=self.chat_template)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser, what="the model: a directory or a Hub id (its tokenizer and config.json are read; no "
                                   "weights are loaded)")
    add_coordinator_option(parser)
    add_server_options(parser, default_host="0.0.0.0")
    add_token_option(parser, default="the secret of your `megatron-serve run` at that address, else none")
    add_flags(parser, "log")


def run(args: argparse.Namespace) -> int:
    pause_collection_until_started()  # until it serves (freeze_startup_heap)
    setup_logging(args.log_level)
    args.coordinator = coordinator_address(args.coordinator)
    check_server_options(args)
    token = read_token(args) or local_runs.secret_for(args.coordinator)
    resolve_model_args(args)  # a Hub id becomes its local directory before the directory is checked
    check_model_dir(args.model, weights=False, tokenizer=args.tokenizer is None)
    from ..server.runner import bind_socket  # noqa: PLC0415 - keep --help fast

    from ..server.probe_port import bind_probe_socket  # noqa: PLC0415

    sock = bind_socket(args.host, args.port)
    probe_sock = bind_probe_socket(args.host, args.health_port, args.port)
    metrics_dir = api_servers.share_metrics(args.api_server_count)
    siblings = None if metrics_dir is None else api_servers.Siblings(args, sock, args.coordinator, token, metrics_dir)
    return serve_on(args, sock, token, siblings=siblings, probe_sock=probe_sock)


def serve_on(args: argparse.Namespace, sock: Any, token: str | None, *, announce: bool = True,
             siblings: "api_servers.Siblings | None" = None, probe_sock: Any = None,
             on_started: Callable[[str], None] | None = None) -> int:
    """Serve on ``sock`` (bound) through ``args.coordinator`` until stopped; ``siblings``: the other API server
    processes this one starts and stops (``--api-server-count``); ``probe_sock``: the probe port's socket
    (bound; ``--health-port``), or None (the siblings: the first process answers the pod's probes);
    ``on_started(url)``: called once it serves. Returns the exit code (:func:`.options.stopped_exit_code`)."""
    from ..server.modelinfo import ModelFacts  # noqa: PLC0415
    from ..server.runner import run_loop  # noqa: PLC0415

    files = ServingFiles.from_args(args)
    facts = ModelFacts.from_dir(args.model, args.served_model_name)
    tokenizer = files.load_tokenizer()
    first_signal = run_loop(_serve(args, facts, files, tokenizer, sock, read_api_key(args), token, announce, siblings,
                                   probe_sock, on_started))
    return stopped_exit_code(first_signal)


async def _serve(args: argparse.Namespace, facts: Any, files: ServingFiles, tokenizer: Tokenizer, sock: Any,
                 api_key: str | None, token: str | None, announce: bool,
                 siblings: "api_servers.Siblings | None", probe_sock: Any,
                 on_started: Callable[[str], None] | None) -> int | None:
    """Serve until stopped; the first signal that stopped it, if one did."""
    from ..client.coordinator_client import InferenceClient  # noqa: PLC0415
    from ..server.app import create_app  # noqa: PLC0415
    from ..heap import defer_young_collections, freeze_startup_heap  # noqa: PLC0415
    from ..server.runner import serve_app  # noqa: PLC0415

    client = InferenceClient(args.coordinator, token=token, tokenizer=tokenizer,  # it makes the text
                             coordinator_grace=args.coordinator_grace)
    app = create_app(client, tokenizer, facts.name, api_key, admin_key=read_admin_key(args),
                     vocab_size=facts.vocab_size, max_model_len=facts.max_model_len,
                     max_concurrent_requests=api_servers.per_process_limit(args), limits=read_limits(args),
                     tokenizer_threads=args.tokenizer_threads, image_options=image_options(args),
                     generation_defaults=files.generation_defaults, options=HTTPOptions.from_args(args),
                     stream_interval=args.stream_interval, tenancy=tenancy_options(args), **status_options(args))
    stop = asyncio.Event()
    serving = asyncio.current_task()
    loop = asyncio.get_running_loop()
    signals: list[int] = []

    def on_signal(signum: int) -> None:
        """The first signal drains (a pod's stop, after its preStop); a second one stops at once."""
        signals.append(signum)
        if siblings is not None:
            siblings.signal(signum)
        if not stop.is_set():
            logger.warning("%s: draining for up to %gs (again to stop at once)", signal.Signals(signum).name,
                           args.drain_timeout)
            stop.set()
        elif serving is not None:
            logger.warning("%s again: stopping at once", signal.Signals(signum).name)
            serving.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    sock.listen(MAIN_BACKLOG)  # before the probe port can say ready: from then on connections queue, never refused
    probes = await start_probes(args, probe_sock, args.coordinator, token, app)

    def started(url: str) -> None:
        if on_started is not None:
            on_started(url)
        if announce:
            count = f" in {args.api_server_count} processes" if args.api_server_count > 1 else ""
            print(f"megatron-serve server: {url}/v1 serving model '{facts.name}' through {args.coordinator}{count}"
                  f"{' (API key required)' if api_key else ''}{probes_note(probes)}", file=sys.stderr, flush=True)

    freeze_startup_heap()
    defer_young_collections()
    if siblings is not None:
        siblings.start()
    try:
        # The siblings serve first (the socket queues connections meanwhile): "serving" means every process does.
        if siblings is None or await siblings.wait_ready(stop):
            await serve_app(app, sock=sock, log_level=args.log_level, on_started=started, stop=stop,
                            **connection_options(args))
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
    finally:
        if probes is not None:
            await probes.aclose()
        client.close()
        if siblings is not None:
            await asyncio.to_thread(siblings.stop, args.drain_timeout + 15.0)
    return signals[0] if signals else None


async def start_probes(args: argparse.Namespace, probe_sock: Any, address: str, token: str | None, app: Any) -> Any:
    """The probe port on ``probe_sock`` (None: none), watching the coordinator at ``address`` and ``app``'s drain;
    on the running loop, which it stamps (``--health-stall-timeout``). Started once ``app``'s fleet monitor has
    had its first status, so that its first stamp carries the main port's ``/ready`` verdict."""
    if probe_sock is None:
        return None
    from ..server.probe_process import ProbePort  # noqa: PLC0415

    ctx = app.state.ctx
    await ctx.monitor.wait_first_poll()
    return ProbePort(probe_sock, address, token, lambda: ctx.drain.draining.is_set() or ctx.stopping.is_set(),
                     ready=lambda: ctx.monitor.not_ready_reason() is None
                     or (ctx.wake is not None and ctx.wake.holds()),
                     holds=None if ctx.wake is None else ctx.wake.holds,
                     interval=args.status_interval, timeout=args.status_timeout,
                     stall_timeout=args.health_stall_timeout, log_level=args.log_level)


def probes_note(probes: Any) -> str:
    """``; probes on URL`` for the start-up line, or nothing without a probe port."""
    return "" if probes is None else f"; /health and /ready also on {probes.url()}"


def status_options(args: argparse.Namespace) -> dict[str, float]:
    """``create_app``'s fleet-status timing, from the flags of :func:`add_server_options`."""
    return {"status_interval": args.status_interval, "status_timeout": args.status_timeout,
            "ready_timeout": args.ready_timeout}


def connection_options(args: argparse.Namespace) -> dict[str, Any]:
    """``serve_app``'s connection and drain options, from the flags of :func:`add_server_options`."""
    return {"read_timeout": args.read_timeout, "timeout_keep_alive": args.timeout_keep_alive,
            "max_connections": args.max_connections, "drain_timeout": args.drain_timeout}
