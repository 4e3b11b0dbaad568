"""KV events in vLLM's format: which blocks an engine's KV tiers hold, as they change (``--kv-events-config``).

An engine says, step by step, which complete blocks it stored and removed, in which medium (``GPU``: its
device pool, ``CPU``: the host tier, ``DISK``: the node's disk tier), and when it forgot them all (a refit, a
reset, a restart). A gateway's indexer (llm-d's kv-cache-manager, Dynamo's KV router) or the coordinator's own
index (:mod:`megatron_serve.coordinator.kv_index`) keeps from them a map of which engine holds which prefix.

The layout is vLLM's as its documentation's subscriber decodes it: a batch is ``[ts, events,
data_parallel_rank]`` and each event an array whose first item is its type's name (msgspec's ``array_like``
structs with ``tag=True``); ``BlockStored`` carries vLLM's fields in vLLM's order, so a subscriber written
for an older vLLM (without ``lora_name``) reads ours too (msgspec ignores trailing items). A batch travels
over ZeroMQ as vLLM's publisher sends it: ``[topic, seq (8 bytes, big-endian), payload]`` on a PUB socket,
and a ROUTER answers a replay request (the first missed ``seq``, 8 bytes big-endian) with every buffered
batch from there, ``[seq, payload]`` each, then ``[-1, b""]``.

Block hashes are this project's chained hashes (:mod:`megatron_serve.wire.prefix_hash`), unsigned 64-bit:
a chain starts from the request's cache salt, its LoRA adapter's registration and the weights' epoch, so a
block computed under other weights or another adapter version never has the hash a request looks for.
``lora_name`` names the adapter and ``lora_id`` is its version (vLLM's integer id of the adapter).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

import msgspec

#: ``medium`` of a block in each tier (vLLM says ``GPU`` for the device pool and ``CPU`` for host memory).
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
MEDIA = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)

#: vLLM's ``--kv-offloading-backend`` values served here: ``native`` (the host tier alone, vLLM's default) and ``disk``
#: (the host tier spills to files shared by a node's engines: ``engine.kv.disk``).
KV_OFFLOADING_BACKENDS = ("native", "disk")

#: The replay socket's end-of-replay marker (a seq of -1 with an empty payload).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Complete blocks now held in ``medium``, each chained on the one before it: ``parent_block_hash`` is the
    first one's parent (None: it starts its chain), ``token_ids`` the blocks' tokens, ``block_size`` each."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block in every medium is gone (a refit, a prefix-cache reset, a restart)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """A batch from its bytes; ``msgspec.DecodeError`` / ``ValidationError`` for one that is not."""
    return _DECODER.decode(payload)


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``KVEventsConfig`` (``--kv-events-config``, a JSON object): its fields, names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard (or is ipc/inproc), else connected
    replay_endpoint: str | None = None  # a ROUTER bound there answers replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be at least 1, got {getattr(self, name)}")

    @property
    def publishes(self) -> bool:
        """Whether an engine publishes on a socket of its own (else it only tells its coordinator)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_json(self) -> str:
        return json.dumps(msgspec.to_builtins(self), separators=(",", ":"))


def json_object(value: Any, option: str) -> dict[str, Any]:
    """vLLM's options whose value is a JSON object (``--kv-events-config`` here, the fleet's ``--kv-transfer-config``),
    read one way: ``value`` (JSON text, or what it decoded to: a dict that crossed processes) as a dict; ``ValueError``
    naming ``option`` when it is not JSON or not an object. Here, in the lowest of its readers, which imports nothing
    of the project."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{option} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {value!r}")
    return value


def parse_kv_events_config(value: str | dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
    """``--kv-events-config``'s value (a JSON object, or its dict) as a config; ``ValueError`` naming what is wrong."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    try:
        return msgspec.convert(json_object(value, "--kv-events-config"), KVEventsConfig)
    except msgspec.ValidationError as exc:
        fields = ", ".join(KVEventsConfig.__struct_fields__)
        raise ValueError(f"--kv-events-config: {exc} (its fields: {fields})") from None
