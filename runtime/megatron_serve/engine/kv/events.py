"""An engine's KV events (:mod:`megatron_serve.wire.kv_events`): recorded where its tiers change, sent in batches.

The allocator, the host tier and the disk tier tell :class:`KVEventLog` what they store and drop. The log keeps
what each medium holds (a block's chain parent, tokens and adapter, learnt when it is first stored, serve its
copies in the other tiers), gathers the events of a step and, at :meth:`KVEventLog.flush`, numbers them as one
batch and hands it to its sinks, each numbering its batches from its first: the ZeroMQ publisher of ``--kv-events-config`` (:class:`ZmqPublisher`, vLLM's
PUB socket and replay ROUTER) and the engine process's link to the coordinator. Without a sink nothing is
gathered; a sink that joins late (a new registration) starts from :meth:`KVEventLog.snapshot`: a clear, then
every block held, so that its index is whole without a replay from the beginning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, NamedTuple

import zmq

from ...wire.kv_events import (END_OF_REPLAY, KV_CACHE_GROUP, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored,
                               KVEvent, KVEventBatch, KVEventsConfig, encode_batch)

logger = logging.getLogger("megatron_serve.engine")

#: ``(seq, payload)`` of a published batch.
Sink = Callable[[int, bytes], None]


class BlockOrigin(NamedTuple):
    """What a stored block is, beside its hash: the hash it chains on (None: the first of its chain), its tokens,
    and the adapter it was computed under (``(version, name)``, None: the base model)."""

    parent: int | None
    tokens: tuple[int, ...]
    lora: tuple[int, str] | None = None


class KVEventLog:
    """What an engine's KV tiers hold, and the events saying so (see the module docstring)."""

    def __init__(self, block_size: int, data_parallel_rank: int = 0) -> None:
        """``data_parallel_rank``: stamped on every batch, 0 without data parallelism (as vLLM's publisher does)."""
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.sinks: list[Sink] = []
        self._seqs: dict[Sink, int] = {}  # each sink's last batch number: a sink numbers from its snapshot on
        self._pending: list[KVEvent] = []
        self._origin: dict[int, BlockOrigin] = {}  # every hash held in some medium
        self._media: dict[int, set[str]] = {}

    @property
    def recording(self) -> bool:
        return bool(self.sinks)

    def holds(self, medium: str) -> list[int]:
        """The hashes ``medium`` holds (tests, snapshots)."""
        return [h for h, media in self._media.items() if medium in media]

    def origin(self, block_hash: int) -> BlockOrigin | None:
        """What a block held in some medium is (None: not held, or its tokens were never said)."""
        return self._origin.get(block_hash)

    def stored(self, medium: str, block_hash: int, origin: BlockOrigin | None = None) -> None:
        """``medium`` now holds ``block_hash`` (``origin``: known from an earlier store when None)."""
        if origin is not None:
            self._origin.setdefault(block_hash, origin)
        known = self._origin.get(block_hash)
        if known is None:
            return  # a block whose tokens nobody said: unannounced (no consumer could use it)
        media = self._media.setdefault(block_hash, set())
        if medium in media:
            return
        media.add(medium)
        if self.recording:
            self._append_stored(self._pending, medium, block_hash, known)

    def _append_stored(self, events: list[KVEvent], medium: str, block_hash: int, origin: BlockOrigin) -> None:
        last = events[-1] if events else None
        lora_id, lora_name = origin.lora if origin.lora is not None else (None, None)
        if (isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == origin.parent
                and last.lora_id == lora_id and last.lora_name == lora_name):
            last.block_hashes.append(block_hash)  # the chain goes on: one event
            last.token_ids.extend(origin.tokens)
            return
        events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=origin.parent,
                                  token_ids=list(origin.tokens), block_size=self.block_size, lora_id=lora_id,
                                  medium=medium, lora_name=lora_name, group_idx=KV_CACHE_GROUP))

    def removed(self, medium: str, hashes: list[int]) -> None:
        gone = []
        for block_hash in hashes:
            media = self._media.get(block_hash)
            if media is None or medium not in media:
                continue
            media.discard(medium)
            if not media:
                del self._media[block_hash], self._origin[block_hash]
            gone.append(block_hash)
        if gone and self.recording:
            last = self._pending[-1] if self._pending else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.extend(gone)
            else:
                self._pending.append(BlockRemoved(block_hashes=gone, medium=medium, group_idx=KV_CACHE_GROUP))

    def cleared(self) -> None:
        """Every medium forgot every block (a refit, a reset)."""
        self._origin.clear()
        self._media.clear()
        if self.recording:
            self._pending = [AllBlocksCleared()]  # what came before it no longer matters to anyone

    def snapshot(self) -> list[KVEvent]:
        """A clear, then every block each medium holds: the state, as events."""
        events: list[KVEvent] = [AllBlocksCleared()]
        for medium in MEDIA:
            for block_hash, media in self._media.items():
                if medium in media:
                    self._append_stored(events, medium, block_hash, self._origin[block_hash])
        return events

    def attach(self, sink: Sink, snapshot: bool = True) -> None:
        """Send batches to ``sink`` from now on; first (``snapshot``) the state as one batch of its own. A sink
        attached again (a new registration) gets a new snapshot."""
        self.detach(sink)
        if snapshot:
            self._send([sink], self.snapshot())
        self.sinks.append(sink)

    def seq_of(self, sink: Sink) -> int:
        """The last batch number ``sink`` was given (-1: none)."""
        return self._seqs.get(sink, -1)

    def detach(self, sink: Sink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
        self._seqs.pop(sink, None)
        if not self.sinks:
            self._pending = []

    def flush(self) -> bool:
        """Give what was gathered to every sink as one batch, each numbering it next; False when nothing was."""
        if not self._pending:
            return False
        events, self._pending = self._pending, []
        self._send(self.sinks, events)
        return True

    def _send(self, sinks: list[Sink], events: list[KVEvent]) -> None:
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank))
        for sink in sinks:
            self._seqs[sink] = seq = self._seqs.get(sink, -1) + 1
            sink(seq, payload)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel rank's endpoint: the port plus the rank on tcp, a ``_dp<rank>`` suffix otherwise (vLLM's)."""
    if not endpoint or not rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqPublisher:
    """vLLM's publisher: a PUB socket (``[topic, seq, payload]``) and a replay ROUTER, both owned by one thread that
    takes batches from a queue; the last ``buffer_steps`` batches stay for replay. A sink of :class:`KVEventLog`."""

    def __init__(self, config: KVEventsConfig, rank: int = 0, context: zmq.Context | None = None) -> None:
        self.config = config
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def __call__(self, seq: int, payload: bytes) -> None:
        try:
            self._queue.put_nowait((seq, payload))
        except queue.Full:
            logger.warning("KV events: %d batches wait for the publisher; batch %d dropped (a replay cannot "
                           "return it)", self._queue.qsize(), seq)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, payload = item
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append(item)

    def _answer_replay(self) -> None:
        """One replay request ``[identity, b"", start]`` (a REQ socket's): every buffered batch from ``start``, each
        ``[topic, seq, payload]`` as the PUB socket sent it, then the end marker (vLLM 0.33's frames)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored (expected [start seq])", len(frames) - 2)
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ipc or inproc endpoint is bound (a stable address), any other is connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
