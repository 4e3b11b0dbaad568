"""Process and polling helpers of the fleet, client and coordinator tests: free ports, children that die, deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from collections import Counter
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, TypeVar

import httpx
import zmq
from filelock import FileLock

from megatron_serve.fleet import local_fleet
from megatron_serve.fleet.launcher_client import DEFAULT_ENGINE_START, ChildProcess, Launcher, Refused
from megatron_serve.processes.lifeline import Lifeline
from megatron_serve.wire.messages import FROM_COORDINATOR, PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header, Message, decode, encode
from megatron_serve.wire.security import TOKEN_ENV, FleetSecret, PeerKeys, make_secret

if TYPE_CHECKING:
    import pytest

    from megatron_serve.client.coordinator_client import InferenceClient
    from megatron_serve.wire.request import DynamicInferenceRequest
    from megatron_serve.wire.sampling_params import SamplingParams

PY = sys.executable
T = TypeVar("T")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is no zombie (dead, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _unverified_context() -> ssl.SSLContext:
    """What httpx makes of ``verify=False``, made once: each client made a new ``SSLContext`` for it (0.56 ms of CPU
    a client against 0.09 ms with this one, on URLs that never use TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


UNVERIFIED = _unverified_context()


def http_get(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.get`` of a plain-HTTP URL of the suite's own, on a connection of its own. Without ``verify=False``
    each call's client loads the CA bundle (43 ms of CPU here), several times a second in every readiness poll."""
    return httpx.get(url, verify=UNVERIFIED, **kwargs)


def http_post(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.post`` as :func:`http_get`."""
    return httpx.post(url, verify=UNVERIFIED, **kwargs)


def poll(fetch: Callable[[], T | None], timeout: float, dead: Callable[[], str | None], late: Callable[[], str],
         interval: float = 0.2) -> T:
    """Call ``fetch`` until it returns something (None: not yet), and return that. ``dead()`` says why it never will
    (a process exited), or None; the wait fails with that at once, or with ``late()`` once ``timeout`` seconds have
    passed."""
    deadline = time.monotonic() + timeout
    while True:
        found = fetch()
        if found is not None:
            return found
        reason = dead()
        if reason is not None:
            raise AssertionError(reason)
        if time.monotonic() > deadline:
            raise AssertionError(late())
        time.sleep(interval)


def poll_ready(url: str, timeout: float, dead: Callable[[], str | None], late: Callable[[], str],
               interval: float = 0.2) -> None:
    """Poll ``url``/ready until it answers 200, as :func:`poll` waits."""
    def ready() -> bool | None:
        try:
            return http_get(f"{url}/ready", timeout=2).status_code == 200 or None
        except httpx.TransportError:
            return None

    poll(ready, timeout, dead, late, interval)


def shared_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this session that every xdist worker shares (their base directories' parent): where what one
    worker makes once a session (under a ``FileLock``) waits for the others."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def written_once(directory: Path, write: Callable[[Path], Any]) -> Path:
    """``directory``, written by ``write`` into a scratch directory and renamed into place (whole or absent, should
    a worker die while writing) by the first process that asks for it, under a lock: what the session's xdist
    workers would each write the same (in :func:`shared_directory`) is written once."""
    with FileLock(f"{directory}.lock"):
        if not directory.is_dir():
            scratch = directory.with_name(f"{directory.name}.{os.getpid()}")
            write(scratch)
            scratch.rename(directory)
    return directory


def free_port() -> int:
    """A port free on the loopback now (nothing listens on it: a closed port too)."""
    return local_fleet.free_port("127.0.0.1")


@contextlib.contextmanager
def hosted_rendezvous(world_size: int) -> Iterator[dict[str, str]]:
    """The environment of an engine group whose rendezvous store this test hosts on a port the kernel gave it, as
    torchrun's agent hosts one (``TORCHELASTIC_USE_AGENT_STORE``): no port picked free and bound later by rank 0,
    which another process could take in between. The store lives until the block ends."""
    import torch.distributed as dist  # noqa: PLC0415

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


async def until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02,
                not_yet: tuple[type[Exception], ...] = ()) -> Any:
    """Poll ``predicate`` (plain or async) until it returns something truthy, and return that. An exception of
    ``not_yet`` (an object not written yet, a port not listening yet) counts as a falsy answer; the time-out names
    ``what`` and the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = predicate()
            if inspect.isawaitable(last):
                last = await last
        except not_yet as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


async def run_in_pulses(pids: list[int], predicate: Callable[[], bool], what: str, *, pulse_s: float = 0.001,
                        longest_pulse_s: float | None = None, settle_s: float = 0.1, timeout: float = 120) -> None:
    """Stop the engine processes ``pids`` (SIGSTOP) and let them run ``pulse_s`` at a time until ``predicate()``
    holds; they are left stopped, for :func:`while_held` to send a verb to. A pulse is SIGCONT, a blocking sleep and
    SIGSTOP, with no turn of this process's event loop in between; then up to ``settle_s`` for what the pulse made
    to reach this process. So the engines never run on while this process waits for a core, a collection or a
    frame: a test that waited for its condition with them running let a tiny model's engines finish, on a loaded
    machine, the very requests it meant to catch in flight (at most a pulse's tokens pass between the condition
    and the verb now). ``longest_pulse_s``: each pulse twice the last, up to that (work of unknown length)."""
    signal_processes(pids, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    try:
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s of pulses waiting for {what}")
            signal_processes(pids, signal.SIGCONT)
            time.sleep(pulse_s)
            signal_processes(pids, signal.SIGSTOP)
            if longest_pulse_s is not None:
                pulse_s = min(2 * pulse_s, longest_pulse_s)
            settled = time.monotonic() + settle_s
            while not predicate() and time.monotonic() < settled:
                await asyncio.sleep(0.005)
    except BaseException:
        signal_processes(pids, signal.SIGCONT)  # a failed test's engines still stop when its fleet is torn down
        raise


def signal_processes(pids: list[int], number: signal.Signals) -> None:
    """Signal ``number`` to each of ``pids`` (SIGCONT: engines :func:`run_in_pulses` left stopped) that still exists:
    one that a test killed among them may already be reaped (a CI run here continued a list holding its victim)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)


async def while_held(pids: list[int], verb: Awaitable[T], held: Callable[[], Any]) -> T:
    """``verb`` (a call not yet awaited) sent while the engine processes ``pids`` are stopped (SIGSTOP;
    :func:`run_in_pulses` leaves them so): once ``held()`` (plain or async) says the fleet holds it, they run in pulses
    (1 ms, then twice the last, up to 64 ms) until its answer came, and read it at a step's end, not having run on
    between the test's decision and the verb's arrival. Pulses, not a plain SIGCONT: an engine reads a verb on its
    link thread, which on a loaded machine may wait for a core while the step loop runs on for a hundred tokens."""
    signal_processes(pids, signal.SIGSTOP)
    try:
        sent = asyncio.ensure_future(verb)
        await until(lambda: sent.done() or held(), 60, "the fleet to hold the verb")
        await run_in_pulses(pids, sent.done, "the verb's answer", longest_pulse_s=0.064, settle_s=0.02)
    finally:
        signal_processes(pids, signal.SIGCONT)
    return await sent


def pending(status: Callable[[], Awaitable[dict[str, Any]]], name: str) -> Callable[[], Awaitable[bool]]:
    """For :func:`while_held`: whether the verb ``name`` is among the pending controls of the coordinator whose
    STATUS_REPLY ``status()`` reads (an ``InferenceClient``'s ``status``, or a server's ``/v1/admin/status``)."""
    async def holds() -> bool:
        return name in (await status())["pending_controls"]
    return holds


def process_children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (a process started from a thread is that thread's child in
    ``/proc``: the local fleet starts engines from one of its own); [] once ``pid`` is gone."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def rank_processes(engine_pid: int) -> list[int]:
    """The tensor-parallel ranks an engine process started (engine/group/spawn.py): its own children, forked from it,
    or where it used multiprocessing's fork server, that server's children (whose command line they share)."""
    def command(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    ranks = []
    for child in process_children(engine_pid):
        if b"multiprocessing.forkserver" in command(child):
            ranks += process_children(child)
        elif command(child) == command(engine_pid):
            ranks.append(child)
    return ranks


def greedy_tokens(model_dir: str, prompts: list[str], params: SamplingParams, **config: Any) -> list[list[int]]:
    """The tokens an in-process engine of ``model_dir`` (64 KV blocks; ``config``: more ``InferenceConfig`` fields)
    generates for ``prompts``: what a fleet serving that checkpoint must answer."""
    from megatron_serve.api.llm import MegatronLLM  # noqa: PLC0415 - torch, only for the tests that run a model
    from megatron_serve.config import InferenceConfig  # noqa: PLC0415

    with MegatronLLM(model_dir, InferenceConfig(**{"num_kv_blocks": 64, **config})) as llm:
        return [r.generated_tokens for r in llm.generate(prompts, params)]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def stream_into(client: InferenceClient, prompt: list[int], params: SamplingParams, streamed: list[int],
                      **options: Any) -> DynamicInferenceRequest:
    """Stream one request (``options`` as ``add_request_streaming`` takes them), adding its tokens to ``streamed`` as
    they come; the final request."""
    from megatron_serve.client.outputs import StreamPartial  # the client package imports a quarter second

    async for item in client.add_request_streaming(prompt, params, **options):
        if isinstance(item, StreamPartial):
            streamed.extend(item.new_tokens)
        else:
            return item
    raise AssertionError("the stream ended without a final request")


#: The commands a :class:`Children` forks from its launcher, as ``megatron-serve run``'s local fleet does: the ones that
#: import torch (the coordinator and servers import none, and an exec of them costs what a fork would).
FORKED_COMMANDS = frozenset({"engine", "rendezvous-store"})


class Children:
    """Every process a test starts; ``kill_all()`` in teardown, whatever happened.

    They share one fleet secret (``secret``, in their ``$MEGATRON_SERVE_TOKEN``), as a deployment's
    processes do; ``env`` given to a spawn wins.

    Engines and rendezvous stores are forked from one launcher of this object's (the product's,
    :mod:`megatron_serve.fleet.launcher_client`), which imports torch once for all of them: most of an engine
    process's start is that import, and the suite is CPU-bound. Where the launcher refuses a child (an environment
    that differs from the one it was started with, say) the child is exec'd, as the product's fleet does, and the
    reason is kept in ``refusals``. ``fork=False``: every child exec'd (a test that reads a child's own parent or
    ``/proc/PID/environ``, which a forked child has from the launcher). ``launcher``: one of :func:`shared_launcher`
    instead of one of its own (the fleets of a module's tests: each launcher's start imports torch again), which
    ``kill_all`` leaves running.
    """

    def __init__(self, log_dir: Path, fork: bool = DEFAULT_ENGINE_START == "fork",
                 launcher: Launcher | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.procs: list[tuple[ChildProcess, Path]] = []
        self.secret = make_secret()
        self.fork = fork
        self.refusals: list[str] = []
        self._launcher: Launcher | None = launcher
        self._shared = launcher is not None
        self._lifeline: Lifeline | None = None

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """A child's environment with ``env``: this process's, with the fleet secret, less ``PYTEST_CURRENT_TEST``.
        pytest changes that one at every test and phase, so an engine spawned in a test body from a launcher
        started in a fixture differed from it there, and the launcher refused it: exec'd, importing torch again."""
        mine = {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}
        return {**mine, TOKEN_ENV: self.secret, **(env or {})}

    def start_launcher(self, env: dict[str, str] | None = None) -> None:
        """Start the launcher now, on this thread, with the environment of children given ``env``: its torch import
        then overlaps what the test starts meanwhile, and its parent-death signal follows this thread (the first
        fork would start it on the thread that asks, a helper thread that may end first)."""
        if self.fork:
            self._forker().start(self.environment(env))

    def _forker(self) -> Launcher:
        if self._launcher is None:
            self._lifeline = Lifeline()
            self._launcher = Launcher(self._lifeline, self.log_dir / f"launcher-{id(self):x}.log")
        return self._launcher

    def spawn(self, args: list[str], name: str, env: dict[str, str] | None = None) -> ChildProcess:
        log = self.log_dir / f"{name}-{len(self.procs)}.log"
        argv = [PY, "-m", "megatron_serve.cli", *args]
        environment = self.environment(env)
        proc: ChildProcess | None = None
        if self.fork and args[:1] and args[0] in FORKED_COMMANDS:
            log.write_bytes(b"")  # there when this returns, as an exec'd child's is
            try:
                proc = self._forker().spawn(argv, environment, log)
            except Refused as exc:
                self.refusals.append(f"{name}: {exc}")
        if proc is None:
            with open(log, "wb") as fh:
                proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=environment)
        self.procs.append((proc, log))
        return proc

    def log_of(self, proc: ChildProcess) -> str:
        for p, log in self.procs:
            if p is proc:
                return log.read_text(errors="replace")
        return ""

    def check_running(self) -> None:
        """Raise, with its log's end, for a child that exited (an engine that refused its flags, say): a test
        waiting for it would otherwise wait out its whole time-out."""
        for proc, log in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{log.stem} exited with {proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")

    async def registered(self, client: InferenceClient, count: int, timeout: float = 300) -> None:
        """Until ``count`` engines registered with the coordinator, failing at once if any child exits."""
        async def enough() -> bool:
            self.check_running()
            return len((await client.status())["engines"]) >= count

        await until(enough, timeout, f"{count} engine(s) to register", interval=0.1)

    def coordinator(self, model: str, port: int, *extra: str, env: dict[str, str] | None = None) -> ChildProcess:
        return self.spawn(["coordinator", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra],
                          "coordinator", env)

    def engine(self, model: str, port: int, *extra: str, env: dict[str, str] | None = None) -> ChildProcess:
        return self.spawn(["engine", "--model", model, "--coordinator", f"tcp://127.0.0.1:{port}",
                           "--num-kv-blocks", "64", *extra], "engine", env)

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._launcher is not None and not self._shared:  # a later spawn starts a fresh one
            self._launcher.close()
            self._launcher = None
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None


@contextlib.contextmanager
def shared_launcher(log_dir: Path) -> Iterator[Launcher]:
    """A launcher for the :class:`Children` of several tests (``Children(..., launcher=)``), ended at the block's
    end: it starts at their first fork, with that one's environment, which theirs may differ from only in the fleet
    secret and the other variables read late (the launcher refuses the rest)."""
    lifeline = Lifeline()
    launcher = Launcher(lifeline, Path(log_dir) / "launcher.log")
    try:
        yield launcher
    finally:
        launcher.close()
        lifeline.close()


@contextlib.contextmanager
def process_fleet(log_dir: Path, model: str, engines: list[tuple[str, ...]], coordinator: tuple[str, ...] = (),
                  env: dict[str, str] | None = None, fork: bool = DEFAULT_ENGINE_START == "fork"
                  ) -> Iterator[SimpleNamespace]:
    """A coordinator of ``model`` (``coordinator``: its extra flags) and one engine per entry of ``engines`` (its extra
    flags), each a process of its own with ``env``, all killed at exit: ``address``, ``port``, ``model``, ``children``
    (their :class:`Children`, holding the fleet secret), ``coordinator`` and ``engines`` (the processes).
    ``fork``: as :class:`Children` takes it."""
    children = Children(log_dir, fork=fork)
    port = free_port()
    try:
        if engines:
            children.start_launcher(env)  # its torch import overlaps the coordinator's start
        coordinator_process = children.coordinator(model, port, *coordinator, env=env)
        procs = [children.engine(model, port, *extra, env=env) for extra in engines]
        yield SimpleNamespace(address=f"tcp://127.0.0.1:{port}", port=port, model=model, children=children,
                              coordinator=coordinator_process, engines=procs)
    finally:
        children.kill_all()


class Recorder:
    """Counts RESULT messages as the client receives them (before any de-duplication)."""

    def __init__(self, client: InferenceClient) -> None:
        self.results: Counter = Counter()
        link = client._link
        original = link.on_message

        def spy(header, body):
            if header is Header.RESULT:
                self.results[str(body.client_request_id)] += 1
            original(header, body)

        link.on_message = spy


class RawPeer:
    """A bare DEALER talking to a coordinator frame by frame, as any program could.

    ``secret``: the fleet secret (a CURVE client whose HELLOs carry the proof for its key), or
    ``None`` (plain TCP, no proof). ``server_key``: the coordinator key to expect instead of the
    secret's (an attacker who learned it without the secret). ``keys``: its CURVE key pair (default:
    a fresh one); ``routing_id``: the routing id it chooses (default: the coordinator assigns one).
    """

    def __init__(self, address: str, secret: str | None, *, server_key: bytes | None = None,
                 keys: PeerKeys | None = None, routing_id: bytes | None = None) -> None:
        self.secret = FleetSecret(secret) if secret is not None else None
        self.keys = keys or PeerKeys()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a DEALER blocks a send while it has no pipe (a refused handshake drops it until the reconnect): once,
        # in a full CI run on the loaded 2-core machine, a rogue's HELLO blocked until the 600 s test timeout
        self.sock.setsockopt(zmq.SNDTIMEO, 30_000)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if self.secret is not None or server_key is not None:
            self.sock.curve_serverkey = server_key or self.secret.server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = self.keys.public, self.keys.secret
        self.address = address
        self.sock.connect(address)

    def send(self, header: Header, body: dict[str, Any]) -> None:
        """Send one message; a HELLO speaks this code's protocol and carries the secret's proof unless it
        says otherwise."""
        if header is Header.HELLO:
            body = {"protocol": PROTOCOL_VERSION, **body}
            if self.secret is not None and "proof" not in body:
                body["proof"] = self.secret.proof(self.keys.public)
        try:
            self.sock.send(encode(header, body))
        except zmq.Again:
            raise AssertionError(f"{header.name} not queued in 30 s: no connection to {self.address}") from None

    def recv(self, timeout_ms: int = 5000) -> Message:
        assert self.sock.poll(timeout_ms), "no answer"
        return decode(self.sock.recv(), FROM_COORDINATOR)

    def received(self) -> list[Message]:
        """Every message waiting now (without waiting for more)."""
        out = []
        while self.sock.poll(0):
            out.append(decode(self.sock.recv(), FROM_COORDINATOR))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def metric_by_engine_group(url: str, name: str) -> dict[str, float]:
    """The samples of ``name`` on a server's ``/metrics``, summed by ``engine_group`` (engines report in
    heartbeats: poll for what must show, a beat later)."""
    values: dict[str, float] = {}
    for line in http_get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            group = line.split('engine_group="', 1)[1].split('"', 1)[0]
            values[group] = values.get(group, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def load_script(name: str, path: Path) -> ModuleType:
    """A script outside the packages (a benchmark, a tool) imported as the module ``name``, registered in
    ``sys.modules`` while the test holds it (its dataclasses look their module up): :func:`script_module`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def script_module(name: str, path: Path) -> Iterator[ModuleType]:
    """:func:`load_script` for the time of a ``with`` block (a module fixture's)."""
    try:
        yield load_script(name, path)
    finally:
        sys.modules.pop(name, None)
