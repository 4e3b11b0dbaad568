"""``megatron-serve run --model DIR``: coordinator, N engine processes and the HTTP server, as one command.

The coordinator and engines are real child processes (the same code as a deployment, via
``LocalFleet``; their logs go to ``--log-dir``, else to the run's own directory, removed when it
ends); the HTTP server runs in this process. Each start-up stage prints one progress line, and the
last line prints the endpoint and a ``curl`` example that works with the API key as it was given.
Once serving, a coordinator or engine that dies is restarted with back-off (the log says why), and
no child outlives this process, whatever ends it. SIGINT/SIGTERM/SIGHUP stop everything in order:
the HTTP server drains (new requests get 503, admitted ones finish for up to ``--drain-timeout``),
the fleet gets STOP (engines drain and exit), then the processes are reaped. A second signal stops
at once. It exits 130 when SIGINT stopped it and 0 when SIGTERM or SIGHUP did, whether the model was still
loading or it served (:func:`.options.stopped_exit_code`); "ready" is printed once every API server process
serves (``--api-server-count``).

The fleet is secure by default: the run generates a fleet secret (unless ``--token-file`` or
``$MEGATRON_SERVE_TOKEN`` gives one) and keeps it in its run directory, readable by the user only,
where ``control`` finds it (:mod:`.local_runs`); the coordinator listens on ``--host`` (default
127.0.0.1). ``--insecure`` runs without a secret (benchmarks), and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..coordinator.routing import KNOWN_POLICIES
from ..fleet.argv import disaggregated_roles
from ..fleet.launcher_client import DEFAULT_ENGINE_START, ENGINE_STARTS
from ..heap import pause_collection_until_started
from ..http_options import HTTPOptions
from . import api_servers, local_runs
from .engine_options import add_engine_options, inference_config_from_args
from .flags import add_flags
from .inputs import check_model_dir, parse_port
from .model_options import add_model_options, resolve_model_args
from .run_janitor import Janitor
from .stack_ports import StackPorts, check_distinct, reserve_ports
from .options import add_token_option, read_token, setup_logging, stopped_exit_code
from .server import (API_KEY_ENV, ServingFiles, add_server_options, check_server_options, connection_options,
                     image_options, probes_note, read_admin_key, read_api_key, read_limits, start_probes,
                     status_options, tenancy_options)

if TYPE_CHECKING:
    from ..config import InferenceConfig
    from ..tokenizer import Tokenizer

logger = logging.getLogger("megatron_serve.run")

STAGES = 4
# How often a run with elastic expert groups reads the sizes wanted of them in the coordinator's STATUS.
SIZE_POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> None:
    """``run``'s options; ``positional_model``: the model is the first argument (``serve MODEL``, as in vLLM)."""
    add_model_options(parser, positional=positional_model)
    add_flags(parser, "run", KNOWN_POLICIES=KNOWN_POLICIES, ENGINE_STARTS=list(ENGINE_STARTS),
              DEFAULT_ENGINE_START=DEFAULT_ENGINE_START)
    add_server_options(parser, default_host="127.0.0.1")
    add_engine_options(parser)
    add_token_option(parser, default="a new secret for this run, kept in its run directory")
    add_flags(parser, "insecure", "log")
    parser.set_defaults(log_level="WARNING")


def fleet_layout(engines: int, data_parallel_size: int | None, expert_parallel: bool) -> tuple[int, int]:
    """(engine groups, data-parallel attention ranks per group) from ``--engines`` and ``--data-parallel-size``.

    As in vLLM, ``--data-parallel-size N`` alone is N replicas; with ``--enable-expert-parallel`` it is N attention
    ranks that share the experts (ep = tp x dp), and ``--engines M`` makes M such groups."""
    if data_parallel_size is None:
        return engines, 1
    if data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
    if expert_parallel:
        return engines, data_parallel_size
    if engines not in (1, data_parallel_size):
        raise ValueError(f"--data-parallel-size {data_parallel_size} without --enable-expert-parallel is "
                         f"{data_parallel_size} engine groups (--engines), but --engines {engines} says otherwise: "
                         "give one of them, or add --enable-expert-parallel for groups of data-parallel attention "
                         "ranks")
    return data_parallel_size, 1


def progress(stage: int | None, message: str) -> None:
    say((f"[{stage}/{STAGES}] " if stage is not None else "      ") + message)


def say(line: str) -> None:
    """Print one line of ``run``'s output."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        # Whoever read our output left (`run | head -2`): keep serving, with the output going nowhere.
        # (Raised here, it ended `run` without stopping its children.)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def run(args: argparse.Namespace) -> int:
    pause_collection_until_started()  # until it serves (freeze_startup_heap)
    setup_logging(args.log_level)
    if args.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines}")
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    args.engines, args.data_parallel_size = fleet_layout(args.engines, args.data_parallel_size,
                                                         args.enable_expert_parallel)
    kv_roles = disaggregated_roles(args.engines, args.prefill_engines, args.decode_engines)
    args.engines = len(kv_roles)  # the prefill and decode engines, when given
    check_server_options(args)
    if args.coordinator_port is not None:
        parse_port(args.coordinator_port, "--coordinator-port")
        check_distinct({"--port": args.port, "--health-port": args.health_port,
                        "--coordinator-port": args.coordinator_port})
    config = inference_config_from_args(args, tensor_parallel_size=args.tensor_parallel)  # fails before any start
    from ..fleet.local_fleet import check_data_parallel  # noqa: PLC0415

    check_data_parallel(args.data_parallel_size, config, args.prefill_engines or args.decode_engines)
    from ..server.modelinfo import default_model_name  # noqa: PLC0415

    served = args.served_model_name or default_model_name(args.model)
    if config.lora_modules and served in config.lora_modules:
        raise ValueError(f"--lora-modules: an adapter named {served!r} would shadow the served model's name; "
                         "choose another name")
    check_adapter_directories(config.lora_modules or {})  # before a model is converted or torch imported
    api_key = read_api_key(args)
    token = read_token(args)
    from ..coordinator import check_secret  # noqa: PLC0415
    from ..wire.security import make_secret  # noqa: PLC0415

    if not args.insecure and token is None:
        token = make_secret()
    check_secret(token, args.insecure)  # a secret given beside --insecure is refused, as by the coordinator
    resolve_model_args(args)  # a Hub id becomes its local directory before the directory is checked
    check_model_dir(args.model, tokenizer=args.tokenizer is None)
    check_model_fits(args.model, config)
    if args.tokenizer is not None:
        from ..tokenizer import check_tokenizer_files  # noqa: PLC0415

        check_tokenizer_files(args.tokenizer)
    files = ServingFiles.from_args(args)  # --chat-template and --generation-config, checked now
    # Every port, before any child starts: a busy or doubly named one fails now, not once the model has loaded.
    ports = reserve_ports(args.host, args.port, args.health_port, args.coordinator_port)
    from ..server.runner import run_loop  # noqa: PLC0415 - keep --help fast

    return run_loop(_Stack(args, config, api_key, token, files, ports).main())


def check_adapter_directories(lora_modules: dict[str, str]) -> None:
    """``--lora-modules`` directories that are missing (or files), refused in one line at once: the rest of each
    adapter is read once the model's config is known (:func:`check_model_fits`)."""
    from ..wire.lora_names import directory_problem  # noqa: PLC0415

    for name, path in lora_modules.items():
        problem = directory_problem(name, path)
        if problem is not None:
            raise ValueError(problem)


def check_model_fits(model: str, config: InferenceConfig) -> None:
    """What the engines would refuse or ignore once they loaded the model, refused now in one line: a layout the
    model cannot split into, expert parallelism or EPLB for a model without experts, and ``--lora-modules``
    adapters of too high a rank."""
    from ..model.config import ModelConfig  # noqa: PLC0415
    from ..model.layout import check_layout  # noqa: PLC0415

    model_config = ModelConfig.from_dir(model)
    check_layout(model_config.num_layers, model_config.num_heads, config.tensor_parallel_size,
                 config.pipeline_parallel_size)
    expert_flags = [flag for flag, on in (("--enable-expert-parallel", config.enable_expert_parallel),
                                          ("--enable-eplb", config.enable_eplb)) if on]
    if expert_flags and model_config.moe is None:
        raise ValueError(f"{' '.join(expert_flags)}: {model_config.architecture} has no experts (not a "
                         "mixture-of-experts model), so there is nothing to place or balance: leave "
                         f"{'them' if len(expert_flags) > 1 else 'it'} out")
    if config.lora_modules:
        from ..model.lora.checkpoint import read_adapter  # noqa: PLC0415 - torch: only where adapters are served

        for name, path in config.lora_modules.items():
            read_adapter(name, path, model_config, config.max_lora_rank)


def _load_serving(args: argparse.Namespace, files: ServingFiles) -> tuple[Any, Any]:
    from ..server.modelinfo import ModelFacts  # noqa: PLC0415

    return ModelFacts.from_dir(args.model, args.served_model_name), files.load_tokenizer()


def bearer_header(args: argparse.Namespace, api_key: str | None) -> tuple[str, str]:
    """curl's ``-H`` argument for the API key ``api_key`` as it was given, and what the user sets first (empty when
    the command works as it is); both empty without a key. The banner goes to logs, so the key itself is never in it
    (it was, from ``--api-key``): a single key file is read by its path, and a key given on the command line or one
    of a key document's is the variable ``$MEGATRON_SERVE_API_KEY`` (a document's text was sent whole as the key)."""
    from ..server.tenants import is_document  # noqa: PLC0415

    if api_key is None:
        return "", ""
    variable = f' -H "Authorization: Bearer ${API_KEY_ENV}"'
    if args.api_key is not None:
        return variable, f"with {API_KEY_ENV} set to the key given by --api-key"
    if args.api_key_file and is_document(api_key):
        return variable, f"with {API_KEY_ENV} set to one of the keys in {args.api_key_file}"
    if args.api_key_file:
        return f' -H "Authorization: Bearer $(cat {shlex.quote(args.api_key_file)})"', ""
    if is_document(api_key):
        return variable, f"with {API_KEY_ENV} set to one of its document's keys"
    return variable, ""  # the key is that variable already


def curl_example(url: str, model: str, bearer: str = "", note: str = "") -> str:
    """The banner's ``try: curl ...``; ``note``: what to set first."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16})
    command = f"curl {url}/v1/completions -H 'Content-Type: application/json'{bearer} -d {shlex.quote(body)}"
    return f"try ({note}): {command}" if note else f"try: {command}"


@dataclass(eq=False)
class _Stack:
    """One run of the whole stack; ``main()`` returns the exit code."""

    args: argparse.Namespace
    config: Any
    api_key: str | None
    token: str | None
    files: ServingFiles
    ports: StackPorts
    fleet: Any = None
    client: Any = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    signals: int = 0
    first_signal: int | None = None  # what stopped it: its exit code (stopped_exit_code)
    forced: bool = False
    task: asyncio.Task | None = None
    published: local_runs.LocalRun | None = None  # this run's directory, for `megatron-serve control`
    janitor: Janitor | None = None
    endpoint: str = ""  # http://host:port/v1, once bound
    address: str = ""  # the coordinator's, once it listens
    siblings: api_servers.Siblings | None = None  # the other API server processes (--api-server-count)
    sizes: asyncio.Task | None = None  # elastic expert groups: follows their sizes wanted (_follow_sizes)

    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        if self.siblings is not None:
            self.siblings.signal(signum)
        if self.signals == 1:
            self.first_signal = signum
            progress(None, f"{signal.Signals(signum).name}: stopping: new requests get 503, those in flight may finish "
                           f"for up to {self.args.drain_timeout:g}s (again to stop at once)")
            self.stop.set()
            return
        progress(None, "stopping at once")
        self.forced = True
        if self.fleet is not None:
            self.fleet.kill()
        if self.task is not None:
            self.task.cancel()

    async def main(self) -> int:
        try:
            self.task = asyncio.current_task()
            return await self._main()
        except asyncio.CancelledError:
            if self.forced:
                return 130
            raise

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        from ..server.runner import endpoint_url  # noqa: PLC0415

        from ..server.modelinfo import default_model_name  # noqa: PLC0415

        args = self.args
        name = args.served_model_name or default_model_name(args.model)
        sock = self.ports.http
        self.endpoint = endpoint_url(sock) + "/v1"
        progress(1, f"model '{name}' from {args.model}")
        defaults = self.files.generation_defaults
        if defaults.values:
            progress(None, defaults.describe())
        # The tokenizer loads here while the children load theirs: start-up is bounded by the slowest.
        loading = asyncio.ensure_future(asyncio.to_thread(_load_serving, args, self.files))
        loading.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failed start reports its own error
        try:
            startup = asyncio.ensure_future(self._start_fleet(loading))
            stopper = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait({startup, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if self.stop.is_set() or not startup.done():  # a signal while starting, even as it ended: never "ready"
                startup.cancel()
                try:
                    await startup
                except (asyncio.CancelledError, Exception):
                    pass
                return stopped_exit_code(self.first_signal)
            startup.result()
            facts, tokenizer = await loading
            await self._serve(facts, tokenizer, sock)
            return stopped_exit_code(self.first_signal)
        finally:
            self.ports.close()
            if self.published is not None:
                local_runs.withdraw(self.published)
            await self._shutdown()

    async def _start_fleet(self, loading: "asyncio.Future[tuple[Any, Any]]") -> None:
        from ..client.coordinator_client import InferenceClient  # noqa: PLC0415
        from ..fleet.local_fleet import LocalFleet  # noqa: PLC0415

        args = self.args
        self.fleet = LocalFleet(args.model, args.engines, self.config, host=args.host, port=self.ports.coordinator,
                                token=self.token, insecure=self.token is None, routing=args.routing,
                                drain_timeout=args.drain_timeout, log_dir=args.log_dir, tokenizer_dir=args.tokenizer,
                                max_request_logprobs=args.max_request_logprobs,
                                session_ttl=args.session_affinity_ttl, prefill_engines=args.prefill_engines,
                                decode_engines=args.decode_engines,
                                data_parallel_size=args.data_parallel_size, engine_start=args.engine_start)
        started = time.monotonic()
        self.address = address = await asyncio.to_thread(self.fleet.start, 60.0)
        security = "encrypted, fleet secret required" if self.token else "INSECURE: no authentication, no encryption"
        kept = "" if args.log_dir is not None else "; removed at exit, --log-dir keeps them"
        progress(2, f"coordinator listening on {address}{self.ports.coordinator_note} ({security}; logs in "
                    f"{self.fleet.log_dir}{kept})")
        self.published = local_runs.publish(os.getpid(), address, self.endpoint, args.served_model_name or args.model,
                                            self.token)
        # Removes both directories once this process is gone, even by kill -9 (--log-dir is the user's: kept).
        self.janitor = Janitor([self.published.directory, *([self.fleet.log_dir] if args.log_dir is None else [])])
        if self.token is None:
            progress(None, "WARNING --insecure: anyone who reaches the coordinator can join the fleet, read prompts "
                           "and answers, and pause, stop or refit it (benchmarks only)")
        _facts, tokenizer = await loading  # the client makes the text with it (the children load meanwhile)
        self.client = InferenceClient(address, token=self.token, tokenizer=tokenizer,
                                      coordinator_grace=args.coordinator_grace)
        await self.client.start(timeout=30.0)
        tp = f", tensor parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else ""
        dp = args.data_parallel_size
        gangs = (f" ({args.engines} group(s) of {dp} data-parallel attention ranks, experts over "
                 f"{dp * self.config.world_size} ranks)" if dp > 1 else "")
        expected = self.fleet.num_engines
        progress(3, f"starting {expected} engine process(es){gangs}{tp}: loading the model ...")
        seen: set[str] = set()
        deadline = time.monotonic() + args.startup_timeout
        while len(seen) < expected:
            self.fleet.check_alive()  # an engine that died says why (its log tail)
            try:
                status = await self.client.status(timeout=10.0)
            except TimeoutError:
                # A coordinator busy loading its tokenizer on a loaded machine can miss one STATUS
                # (seen: a 35 s gap on a 2-core host running other work); only the deadline counts.
                status = {"engines": []}
            for engine in status["engines"]:
                if engine["id"] not in seen:
                    seen.add(engine["id"])
                    progress(None, f"engine {engine['id']} ready: group {engine['group']}, "
                                   f"{engine['kv_blocks_total']} KV blocks ({time.monotonic() - started:.1f}s)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(seen)} of {expected} engine(s) ready after {args.startup_timeout:.0f}s "
                                   f"(logs in {self.fleet.log_dir}; raise --startup-timeout)")
            if len(seen) < expected:
                await asyncio.sleep(0.2)
        if status["state"] != "RUNNING":
            await self.client.unpause(timeout=30.0)  # e.g. a coordinator left STOPPED by an earlier run
        self.fleet.supervise()  # from now on a child that dies is started again
        if self.fleet.elastic:
            self.sizes = asyncio.ensure_future(self._follow_sizes())

    async def _follow_sizes(self) -> None:
        """Start the ranks an elastic expert group is wanted with again (``scale-ep`` above its size). Only the
        coordinator sees that verb (a ``control`` process sends it), and it keeps the size wanted of each group in
        its STATUS: this run reads it there every ``SIZE_POLL_S`` through the client it already holds, so no message
        or connection is added for it; a rank starts again at most that long after the ask (then it joins)."""
        while True:
            read_at = time.monotonic()  # before the ask: the answer is at least this recent
            try:
                status = await self.client.status(timeout=10.0)
            except TimeoutError:  # a coordinator restarting: its next answer counts
                pass
            else:
                # on a thread: the supervisor's thread starts the ranks, and this loop serves HTTP meanwhile
                await asyncio.to_thread(self.fleet.want_ranks, status.get("expert_groups") or [], read_at)
            await asyncio.sleep(SIZE_POLL_S)

    async def _serve(self, facts: Any, tokenizer: Tokenizer, sock: Any) -> None:
        from ..server.app import create_app  # noqa: PLC0415
        from ..heap import defer_young_collections, freeze_startup_heap  # noqa: PLC0415
        from ..server.runner import serve_app  # noqa: PLC0415

        args = self.args
        metrics_dir = api_servers.share_metrics(args.api_server_count)  # before the app makes its series
        if metrics_dir is not None:
            self.janitor.add(metrics_dir)  # removed even after kill -9 of this process
        app = create_app(self.client, tokenizer, facts.name, self.api_key, admin_key=read_admin_key(args),
                         vocab_size=facts.vocab_size, max_model_len=facts.max_model_len,
                         max_concurrent_requests=api_servers.per_process_limit(args),
                         limits=read_limits(args), tokenizer_threads=args.tokenizer_threads,
                         image_options=image_options(args), generation_defaults=self.files.generation_defaults,
                         options=HTTPOptions.from_args(args), stream_interval=args.stream_interval,
                         lora_modules=dict(args.lora_modules or []), tenancy=tenancy_options(args),
                         **status_options(args))

        probes = await start_probes(args, self.ports.probe, self.address, self.token, app)

        def started(url: str) -> None:
            if self.stop.is_set():  # a signal came while the server started: it drains at once, never "ready"
                return
            count = f" ({args.api_server_count} processes)" if args.api_server_count > 1 else ""
            progress(4, f"HTTP server listening on {url}{count}{' (API key required)' if self.api_key else ''}"
                        f"{probes_note(probes)}")
            say(f"megatron-serve is ready: {url}/v1 (model '{facts.name}', {self.fleet.num_engines} engine(s)); "
                f"{curl_example(url, facts.name, *bearer_header(args, self.api_key))}")

        freeze_startup_heap()
        defer_young_collections()
        if metrics_dir is not None:
            self.siblings = api_servers.Siblings(args, sock, self.address, self.token, metrics_dir)
            self.janitor.add(self.siblings.directory)
            self.siblings.start()
        try:
            # The siblings serve first (the socket queues connections meanwhile): "ready" means every process serves.
            if self.siblings is not None and not await self.siblings.wait_ready(self.stop):
                return
            await serve_app(app, sock=sock, log_level=args.log_level, on_started=started, stop=self.stop,
                            **connection_options(args))
        finally:
            if probes is not None:
                await probes.aclose()

    async def _shutdown(self) -> None:
        """Server already stopped (its siblings too, once they drained); now STOP the fleet (engines drain) and
        reap the processes."""
        if self.siblings is not None:
            await asyncio.to_thread(self.siblings.stop, 0.0 if self.forced else self.args.drain_timeout + 15.0)
        if self.fleet is None:
            return
        if self.sizes is not None:
            self.sizes.cancel()
        self.fleet.supervise(False)  # what exits now is meant to
        if self.forced:
            self.fleet.kill()
            return
        progress(None, "stopping the fleet: engines finish or hand back their requests ...")
        if self.client is not None:
            try:
                await self.client.stop(timeout=self.args.drain_timeout + 15.0, drain_timeout=self.args.drain_timeout)
            except Exception as exc:  # the processes are signalled below anyway
                logger.warning("STOP was not acknowledged (%s): signalling the processes", exc)
            self.client.close()
        await asyncio.to_thread(self.fleet.stop)
        progress(None, "stopped")

