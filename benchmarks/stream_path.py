"""The HTTP server's streaming path in one process, by CPU time: what ``benchmarks/serving.py``'s ``server`` column
pays in Python, without the noise of a shared machine.

The real objects of a served stack's HTTP process: ``create_app``'s app on the server's own uvicorn protocol
(``server.connections.ServerProtocol``, behind uvicorn's proxy-headers wrapper) over an ``InferenceClient``.
Doubles stand at the edges: each connection's transport keeps what is written to it, the client's ZeroMQ socket
the frames it sends. The benchmark plays the HTTP client (request bytes into the protocol, as aiohttp sends
them) and the coordinator (each ``SUBMIT`` answered by ``STEP_TOKENS`` frames of the bytes an engine encodes,
then a ``RESULT``), and hands the client each frame as its link's receive loop would (``ClientLink._receive``).
Before each frame and each batch of requests the caches are filled with other data (:class:`Evictor`), as the
other processes of a machine fill them between two turns of a served stack's loop (``--hot``: kept). Time is
the loop thread's CPU time without the benchmark's own work (frames made, ``SUBMIT``s read, caches filled: timed
apart and taken off); not counted: the kernel's share of a write, ZeroMQ's I/O thread and sockets.

* ``token``: per streamed token, ``--streams`` streams open, steps of one token each (nothing starts or ends);
* ``intake to first write``: per request, its bytes into the protocol to its first chunk written (the HTTP way
  in, the body's parse, the submission and ``SUBMIT``, the first delta, the response's start);
* ``end``: per request, the frame of its last token and ``RESULT`` to the end of its body;
* ``mix``: ``serving.py``'s level, closed loop: ``--streams`` connections, each sending its next request when its
  answer ended, staggered lengths (half to one and a half times ``--output-tokens``), a token per stream per step;
  CPU us per token, i.e. ms per 1,000 tokens, the figure to hold beside ``serving.py``'s ``server`` column.

Generated tokens are the ids of an English text (the tiny model's corpus), each stream from its own offset
(``--random-ids``: uniform ids, a quarter of them bytes of characters split over tokens).

    python benchmarks/stream_path.py                    # every measure, 64 streams, median and least of --repeats
    python benchmarks/stream_path.py --hot              # the same with the caches kept between steps
    python benchmarks/stream_path.py --check            # also: every stream's text is the tokenizer's decode
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import itertools
import json
import pstats
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
import uvloop

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.heap import defer_young_collections, freeze_startup_heap
from megatron_serve.model.tiny import BOS, CHAT_TEMPLATE, CORPUS, EOS, train_tokenizer
from megatron_serve.server import create_app
from megatron_serve.server.connections import ServerProtocol
from megatron_serve.tokenizer import Tokenizer
from megatron_serve.wire.deltas import RequestDelta, StepTokensOut
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header, encode, encode_batch
from megatron_serve.wire.request import EventType, FinalRecord, FinishReason, RequestEvent, RequestStatus
from scratch import scratch_dir

#: What a step's delta of one token carries from an engine: the token and its epochs (policy, KV, adapter).
_EPOCHS = [[0], [0], [-1]]
_ENGINE_REQUEST_ID = "0123456789abcdef0123456789abcdef/0123456789abcdef0123456789abcdef"
MODEL = "tiny-llama"


def tiny_tokenizer_dir() -> Path:
    """The tiny model's tokenizer files, written once (no weights: the server makes no use of them)."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - only here

    path = scratch_dir("stream-path-")
    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), bos_token=BOS, eos_token=EOS,
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


def last_level_cache_bytes() -> int:
    """The size of this machine's last cache level (Linux ``/sys``), 32 MiB where it cannot be read."""
    for index in (3, 2):
        try:
            size = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] if size[-1] in "KM" else int(size)
    return 32 << 20


class Evictor:
    """What other processes (engine, coordinator, HTTP client, other work) do to a served stack's HTTP process between
    two turns of its loop: fill the caches, the last level's too, so that a step finds every stream's objects in
    memory. Copying twice the last level's size does the same here (``--hot``: nothing)."""

    def __init__(self, on: bool) -> None:
        size = 2 * last_level_cache_bytes() if on else 0
        self._source, self._target = bytearray(size), bytearray(size)

    def __call__(self) -> None:
        if self._source:
            self._target[:] = self._source


class Progress:
    """What the benchmark waits for: the doubles report each write, and a wait ends when every one of its items is
    where it should be (no polling of the event loop, which would cost the loop's thread time of its own)."""

    def __init__(self) -> None:
        self._waiting: dict[Any, Any] = {}
        self._done: asyncio.Future[None] | None = None

    async def until(self, items: dict[Any, Any], timeout: float = 30.0) -> None:
        """Until ``items[x]()`` holds for each ``x`` (checked now, then when ``x`` reports a write)."""
        self._waiting = {item: ready for item, ready in items.items() if not ready()}
        if not self._waiting:
            return
        for item in self._waiting:
            item.watch(True)
        loop = asyncio.get_running_loop()
        done = self._done = loop.create_future()
        # (a timer, not asyncio.wait_for: its machinery would count as the server's time)
        late = loop.call_later(timeout, lambda: done.done() or done.set_exception(RuntimeError(
            f"the server did not get there: {len(self._waiting)} item(s) left")))
        try:
            await done
        finally:
            late.cancel()
            for item in items:
                item.watch(False)

    def poke(self, item: Any) -> None:
        ready = self._waiting.get(item)
        if ready is not None and ready():
            del self._waiting[item]
            if not self._waiting and self._done is not None:
                self._done.set_result(None)


#: C callables returning a constant: a transport's ``is_closing`` and ``get_write_buffer_size`` without a Python call
_OPEN = itertools.repeat(False).__next__
_CLOSED = itertools.repeat(True).__next__
_EMPTY = itertools.repeat(0).__next__


class CountingTransport:
    """An HTTP connection's transport that keeps what the server writes. Its ``write``, ``is_closing`` and
    ``get_write_buffer_size`` are C callables (a list's ``append``, constants), so that the server's calls cost here
    what a real transport's Python side costs; :meth:`watch` makes writes report to :class:`Progress` while the
    benchmark waits on the connection (that report is timed as the benchmark's own work)."""

    def __init__(self, port: int, keep: bool, progress: Progress, bench: "Bench") -> None:
        self.progress = progress
        self.bench = bench
        self.port = port
        self.keep = keep
        self.chunks: list[bytes] = []
        self.write = self.chunks.append
        self.is_closing = _OPEN
        self.get_write_buffer_size = _EMPTY  # (every write goes out at once)
        self.data = bytearray()  # with keep: everything written
        self.written = 0
        self.writes = 0
        self.ends = 0  # bodies ended (chunked encoding's last chunk)

    def count(self) -> "CountingTransport":
        """Count what was written since the last count."""
        for data in self.chunks:
            self.writes += 1
            self.written += len(data)
            if data.endswith(b"0\r\n\r\n"):
                self.ends += 1
            if self.keep:
                self.data += data
        self.chunks.clear()
        return self

    def watch(self, on: bool) -> None:
        self.write = self._reporting if on else self.chunks.append

    def _reporting(self, data: bytes) -> None:
        self.chunks.append(data)
        with self.bench:
            self.progress.poke(self)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", self.port), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def close(self) -> None:
        self.is_closing = _CLOSED

    def pause_reading(self, *_: Any) -> None:
        pass

    resume_reading = set_protocol = pause_reading


class SocketDouble:
    """The client's ZeroMQ socket: keeps the frames sent to the coordinator, for the benchmark to answer."""

    def __init__(self, progress: Progress) -> None:
        self.sent: list[bytes] = []
        self.progress = progress

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(frame)
        self.progress.poke(self)

    def get(self, option: int) -> int:
        """``EVENTS``: nothing waits to be read (the benchmark hands each frame to the link itself)."""
        return 0

    def watch(self, on: bool) -> None:
        pass

    def close(self, linger: int | None = None) -> None:
        pass


@dataclass
class Stream:
    """One connection and the request it has in flight."""

    protocol: Any
    transport: CountingTransport
    request_id: str | None = None  # the client request id of its SUBMIT
    tokens: list[int] = field(default_factory=list)  # to generate
    sent: int = 0
    expected: list[list[int]] = field(default_factory=list)  # with --check: every request's tokens


class Bench:
    """A served stack's HTTP process in this one, and the frames that drive it (see the module docstring)."""

    def __init__(self, tokenizer_dir: Path, streams: int, output_tokens: int, random_ids: bool, keep: bool,
                 cold: bool = True) -> None:
        self.tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
        self.streams = streams
        self.output_tokens = output_tokens
        self.keep = keep
        rng = random.Random(0)
        if random_ids:
            vocab = [i for i in range(self.tokenizer.vocab_size) if i not in self.tokenizer.special_token_ids]
            self.text_ids = [rng.choice(vocab) for _ in range(4096)]
        else:
            self.text_ids = self.tokenizer.encode(CORPUS, add_special_tokens=False)
        # Where a request's tokens may start: at a token of whole characters, since the first token's chunk is what
        # open() waits for, and the first bytes of a split character write nothing until the token that completes it
        self._starts = [i for i, token in enumerate(self.text_ids) if "\ufffd" not in self.tokenizer.decode([token])]
        self.prompts = [[rng.randrange(10, 500) for _ in range(128)] for _ in range(64)]
        self._delta_bytes: dict[int, msgspec.Raw] = {}
        self.driver = 0.0  # the benchmark's own CPU time inside the measured spans
        self._ports = iter(range(40000, 60000))
        self._next = 0
        self.connections: list[Stream] = []  # every connection so far (what --check reads)
        self._by_prompt: dict[tuple[int, int], Stream] = {}
        self.progress = Progress()
        self._evictor = Evictor(cold)
        self.profiler: cProfile.Profile | None = None  # --calls: the server's calls, the benchmark's own left out
        self._own_started = 0.0

    async def start(self) -> None:


        client = InferenceClient("tcp://127.0.0.1:1", token=None, tokenizer=self.tokenizer)
        client._loop = asyncio.get_running_loop()  # started as start() would, on a socket double
        client._started = True
        self.link = link = client._link
        link._loop, link._wake = client._loop, asyncio.Event()
        link._sock = link._plain = self.socket = SocketDouble(self.progress)  # the link sends through _plain
        link._receive(encode(Header.HELLO_ACK, {"coordinator_id": "bench", "state": "RUNNING",
                                                  "protocol": PROTOCOL_VERSION}))
        self.client = client
        app = create_app(client, self.tokenizer, MODEL, vocab_size=self.tokenizer.vocab_size, max_model_len=1024,
                         status_interval=3600.0)
        self._lifespan = app.router.lifespan_context(app)
        entered = asyncio.ensure_future(self._lifespan.__aenter__())
        while not entered.done():  # the fleet monitor's first poll: answered here
            await asyncio.sleep(0.001)
            self._answer_status()
        entered.result()
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                http=functools.partial(ServerProtocol, read_timeout=60.0, max_connections=100000))
        config.load()
        self.config = config
        self.server_state = uvicorn.server.ServerState()
        self.server_state.default_headers = [(b"date", b"Thu, 01 Jan 2026 00:00:00 GMT"), (b"server", b"uvicorn")]
        self._protocol = ServerProtocol
        freeze_startup_heap()  # as the serving commands do
        defer_young_collections()

    async def stop(self) -> None:
        await self._lifespan.__aexit__(None, None, None)
        self.link._sock = self.link._plain = None
        self.client.close()

    def _answer_status(self) -> None:

        for header, body in self._sent():
            if header == Header.STATUS:
                self.link._receive(encode(Header.STATUS_REPLY, {
                    "state": "RUNNING", "queued": 0, "in_flight": 0, "completed": 0, "failed": 0,
                    "status_id": body["status_id"],
                    "engines": [{"id": "e0", "group": 0, "state": "RUNNING", "running": 0, "waiting": 0,
                                 "info": {"max_sequence_length": 1024}}]}))

    def _sent(self) -> list[tuple[int, Any]]:
        """The messages the client sent since the last look (BATCH frames opened)."""

        frames, self.socket.sent = self.socket.sent, []
        out = []
        for frame in frames:
            header, body = msgspec.msgpack.decode(frame)
            if header == Header.BATCH:
                out += [(header, body) for header, body in body["messages"]]
            else:
                out.append((header, body))
        return out

    def connection(self) -> Stream:
        """A new HTTP connection to the server."""
        transport = CountingTransport(next(self._ports), self.keep, self.progress, self)
        protocol = self._protocol(config=self.config, server_state=self.server_state, app_state={},
                                  read_timeout=60.0, max_connections=100000)
        protocol.connection_made(transport)
        stream = Stream(protocol, transport)
        self.connections.append(stream)
        return stream

    def __enter__(self) -> None:
        """The benchmark's own work begins: timed apart (``driver``), and left out of ``--calls``' profile."""
        if self.profiler is not None:
            self.profiler.disable()
        self._own_started = time.thread_time()

    def __exit__(self, *_: Any) -> None:
        self.driver += time.thread_time() - self._own_started
        if self.profiler is not None:
            self.profiler.enable()

    def evict(self) -> None:
        """Fill the caches with other data, as other processes do between two turns of the server's loop (the time
        it takes is the benchmark's own)."""
        with self:
            self._evictor()

    def request(self, stream: Stream, length: int) -> bytes:
        """A streamed completion of ``length`` tokens as aiohttp sends it (``serving.py``'s body); the stream's
        tokens to generate are chosen here."""
        number = self._next
        self._next += 1
        prompt = [10 + number % 400, 10 + number // 400 % 400, *self.prompts[number % len(self.prompts)][2:]]
        self._by_prompt[tuple(prompt[:2])] = stream  # the SUBMIT names its stream by its prompt
        start = self._starts[(number * 97) % len(self._starts)]
        ids = self.text_ids
        stream.tokens = [ids[(start + i) % len(ids)] for i in range(length)]
        stream.sent = 0
        if self.keep:
            stream.expected.append(stream.tokens)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": length, "stream": True,
                           "ignore_eos": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                           "top_p": 1.0, "top_k": 0, "n": 1}).encode()
        head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: */*\r\n"
                "Accept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.12 aiohttp/3.13.3\r\n"
                f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n\r\n")
        return head.encode() + body

    def submitted(self) -> None:
        """Read the SUBMITs sent since the last look: each one's prompt names its stream."""

        with self:
            for header, body in self._sent():
                if header == Header.SUBMIT:
                    self._by_prompt.pop(tuple(body["prompt"][:2])).request_id = body["client_request_id"]

    def _delta(self, token: int) -> msgspec.Raw:
        raw = self._delta_bytes.get(token)
        if raw is None:

            raw = self._delta_bytes[token] = msgspec.Raw(msgspec.msgpack.encode(RequestDelta(
                request_id=_ENGINE_REQUEST_ID, new_tokens=[token], finished=False, epochs=_EPOCHS)))
        return raw

    def step(self, streams: list[Stream]) -> tuple[bytes, list[Stream]]:
        """The frame of one engine step: a token for each of ``streams``, and the RESULT of each that ends with it
        (one BATCH, as the coordinator sends a step's messages to a client); the streams that end."""

        with self:
            ids, deltas, ending = [], [], []
            for stream in streams:
                ids.append(stream.request_id)
                deltas.append(self._delta(stream.tokens[stream.sent]))
                stream.sent += 1
                if stream.sent == len(stream.tokens):
                    ending.append(stream)
            frame = encode(Header.STEP_TOKENS, StepTokensOut(client_request_ids=ids, deltas=deltas))
            if ending:
                frame = encode_batch([frame, *(encode(Header.RESULT, {"client_request_id": stream.request_id,
                                                                      "request": self._record()})
                                               for stream in ending)])
        return frame, ending

    def _record(self) -> msgspec.Raw:
        """A finished request's record as an engine sends it (``FinalRecord``: its status, events and times)."""

        now = time.time()
        events = [RequestEvent(EventType.ADD, now - 1), RequestEvent(EventType.PREFILL, now - 0.95),
                  RequestEvent(EventType.FIRST_TOKEN, now - 0.9), RequestEvent(EventType.FINISH, now)]
        return msgspec.Raw(msgspec.msgpack.encode(FinalRecord(
            request_id=_ENGINE_REQUEST_ID, status=RequestStatus.COMPLETED,
            finish_reason=FinishReason.LENGTH, arrival_time=now - 1, first_token_time=now - 0.9, finish_time=now,
            events=events)))

    async def ended(self, streams: list[Stream], ends: list[int]) -> None:
        """Until each stream's body has ended more often than ``ends`` says."""
        await self.progress.until({s.transport: functools.partial(_past, s.transport, "ends", e)
                                   for s, e in zip(streams, ends)})

    async def send(self, streams: list[Stream], lengths: list[int]) -> None:
        """Each stream's next request sent, until its SUBMIT went to the coordinator."""
        client = self.client
        target = client.num_pending + len(streams)
        with self:
            requests = [self.request(stream, length) for stream, length in zip(streams, lengths)]
        self.evict()
        for stream, request in zip(streams, requests):
            stream.protocol.data_received(request)
        await self.progress.until({self.socket: lambda: client.num_pending >= target and not self.link._flush_scheduled})
        self.submitted()

    async def open(self, streams: list[Stream], lengths: list[int]) -> None:
        """Each stream's request sent and submitted, its first token streamed."""
        await self.send(streams, lengths)
        writes = [s.transport.count().writes for s in streams]
        frame, _ = self.step(streams)
        self.evict()
        self.link._receive(frame)
        await self.progress.until({s.transport: functools.partial(_past, s.transport, "writes", w)
                                   for s, w in zip(streams, writes)})


def _past(transport: CountingTransport, count: str, value: int) -> bool:
    return getattr(transport.count(), count) > value


# ---------------------------------------------------------------------------------------------------- measures


async def measure_token(bench: Bench, steps: int) -> float:
    """CPU us per streamed token: ``--streams`` streams, ``steps`` steps of a token each."""
    streams = [bench.connection() for _ in range(bench.streams)]
    await bench.open(streams, [steps + 2] * len(streams))
    frames = [bench.step(streams)[0] for _ in range(steps)]
    bench.driver = 0.0
    started = time.thread_time()
    for frame in frames:
        bench.evict()
        bench.link._receive(frame)
        await asyncio.sleep(0)
    spent = time.thread_time() - started - bench.driver
    await finish(bench, streams)
    return spent / (steps * len(streams)) * 1e6


async def finish(bench: Bench, streams: list[Stream]) -> None:
    """Stream what is left of each request, to the end of its body."""
    while True:
        running = [s for s in streams if s.sent < len(s.tokens)]
        if not running:
            break
        frame, _ = bench.step(running)
        bench.link._receive(frame)
    await bench.ended(streams, [0] * len(streams))


async def measure_request(bench: Bench, requests: int) -> tuple[float, float]:
    """CPU us per request: from its bytes to the first chunk written, and from its last frame to its body's end
    (a request at a time, on one kept-alive connection)."""
    stream = bench.connection()
    intake = end = 0.0
    for i in range(requests):
        bench.driver = 0.0
        started = time.thread_time()
        await bench.open([stream], [2])
        intake += time.thread_time() - started - bench.driver
        bench.driver = 0.0
        ends = stream.transport.count().ends
        frame, _ = bench.step([stream])
        started = time.thread_time()
        bench.evict()
        bench.link._receive(frame)
        await bench.ended([stream], [ends])
        end += time.thread_time() - started - bench.driver
    return intake / requests * 1e6, end / requests * 1e6


async def measure_mix(bench: Bench, requests: int) -> tuple[float, list[Stream]]:
    """CPU us per streamed token over ``requests`` requests, ``--streams`` at a time (closed loop: a connection sends
    its next request once its answer ended; new requests' first tokens come with the next step)."""
    rng = random.Random(1)
    n = bench.output_tokens
    lengths = [max(1, n // 2 + (n * i) // max(requests - 1, 1)) for i in range(requests)]
    rng.shuffle(lengths)
    todo = iter(lengths)
    streams = [bench.connection() for _ in range(min(bench.streams, requests))]
    bench.driver = 0.0
    started = time.thread_time()
    await bench.send(streams, [next(todo) for _ in streams])
    running = streams
    tokens = 0
    while running:
        frame, ending = bench.step(running)
        tokens += len(running)
        ends = [s.transport.count().ends for s in ending]
        bench.evict()
        bench.link._receive(frame)
        await asyncio.sleep(0)
        if ending:
            await bench.ended(ending, ends)
            again = [(s, length) for s, length in zip(ending, todo)]
            if again:
                await bench.send([s for s, _ in again], [length for _, length in again])
        running = [s for s in streams if s.sent < len(s.tokens)]
    spent = time.thread_time() - started - bench.driver
    return spent / tokens * 1e6, streams


async def count_calls(bench: Bench, requests: int, top: int) -> None:
    """Print the Python calls of one request of :func:`measure_request` (cProfile; the benchmark's own work left out)
    and the ``top`` functions by calls: a change that takes work out of a request shows here without the machine's
    noise."""
    profiler = bench.profiler = cProfile.Profile()
    profiler.enable()
    try:
        await measure_request(bench, requests)
    finally:
        profiler.disable()
        bench.profiler = None
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined] - {function: (prim, calls, tt, ct, callers)}
    own = {function: numbers for function, numbers in stats.items()
           if not function[0].endswith("stream_path.py") and "_lsprof" not in function[2]}
    calls = sum(numbers[1] for numbers in own.values())
    print(f"Python calls per request (intake to the body's end, {requests} requests): {calls / requests:.1f}")
    for (path, line, name), numbers in sorted(own.items(), key=lambda item: -item[1][1])[:top]:
        print(f"  {numbers[1] / requests:6.2f}  {name} ({Path(path).name}:{line})")


def answers(data: bytes) -> list[list[dict[str, Any]]]:
    """The chunks of each streamed answer on one connection (HTTP/1.1 responses with chunked bodies of events)."""
    out = []
    rest = bytes(data)
    while rest:
        head, _, rest = rest.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK"), head[:200]
        body = b""
        while True:
            size, _, rest = rest.partition(b"\r\n")
            count = int(size, 16)
            body, rest = body + rest[:count], rest[count + 2:]
            if count == 0:
                break
        events = [event for event in body.split(b"\n\n") if event]
        assert events[-1] == b"data: [DONE]", events[-1]
        out.append([json.loads(event[len(b"data: "):]) for event in events[:-1]])
    return out


def check(bench: Bench, streams: list[Stream]) -> int:
    """Every answer's text is the tokenizer's decoding of the tokens its stream was given, and its usage counts them;
    how many answers were checked."""
    checked = 0
    for stream in streams:
        for chunks, tokens in zip(answers(stream.transport.count().data), stream.expected, strict=True):
            text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
            expected = bench.tokenizer.decode(tokens)
            if text != expected:
                raise AssertionError(f"streamed {text!r}, decoded {expected!r}")
            if chunks[-1]["usage"]["completion_tokens"] != len(tokens):
                raise AssertionError(f"usage {chunks[-1]['usage']} for {len(tokens)} tokens")
            checked += 1
    return checked


# ---------------------------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    bench = Bench(args.tokenizer or tiny_tokenizer_dir(), args.streams, args.output_tokens, args.random_ids,
                  args.check, cold=not args.hot)
    await bench.start()
    try:
        await measure_mix(bench, min(args.requests, 2 * args.streams))  # warm-up: every path taken once
        if args.calls:
            await count_calls(bench, args.single_requests, args.calls)
            return {}
        results: dict[str, list[float]] = {"token": [], "intake": [], "end": [], "mix": []}
        for _ in range(args.repeats):
            results["token"].append(await measure_token(bench, args.steps))
            intake, end = await measure_request(bench, args.single_requests)
            results["intake"].append(intake)
            results["end"].append(end)
            results["mix"].append((await measure_mix(bench, args.requests))[0])
        if args.check:
            await asyncio.sleep(0.01)
            print(f"checked {check(bench, bench.connections)} answers: each one's text is its tokens' decoding")
        return results
    finally:
        await bench.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="streams in flight (serving.py's --concurrency)")
    parser.add_argument("--output-tokens", type=int, default=64, help="mean output tokens of the mix's requests")
    parser.add_argument("--requests", type=int, default=512, help="requests of the mix")
    parser.add_argument("--steps", type=int, default=64, help="steps of the token measure")
    parser.add_argument("--single-requests", type=int, default=64, help="requests of the per-request measure")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each measure (the median is shown)")
    parser.add_argument("--random-ids", action="store_true", help="uniform random ids instead of a text's")
    parser.add_argument("--tokenizer", type=Path, help="a directory with tokenizer files (default: the tiny model's)")
    parser.add_argument("--hot", action="store_true", help="keep the caches between steps (see Evictor)")
    parser.add_argument("--check", action="store_true", help="check every stream's text (slower: bytes kept)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--calls", type=int, metavar="TOP", default=0,
                        help="only count a request's Python calls, and print the TOP functions by calls")
    args = parser.parse_args()
    runs = uvloop.run(run(args))
    if args.calls:
        return
    if args.json:
        print(json.dumps({name: statistics.median(values) for name, values in runs.items()}))
        return
    print(f"{args.streams} streams, mean output {args.output_tokens} tokens, caches {'kept' if args.hot else 'filled'} "
          f"between steps; CPU time of the event loop's thread, median and least of {args.repeats} runs (other work "
          "on the machine only adds time):")
    labels = {"token": "us per streamed token", "intake": "us per request, intake to first write",
              "end": "us per request, last frame to end of body", "mix": "us per token in the mix (= ms per 1k)"}
    for name, values in runs.items():
        print(f"  {labels[name]:45s} {statistics.median(values):8.2f} {min(values):8.2f}")


if __name__ == "__main__":
    main()
