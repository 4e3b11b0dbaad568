"""KV events in vLLM's format: which blocks an engine's KV tiers hold, as they change (``--kv-events-config``).

An engine says, step by step, which complete blocks it stored and removed, in which medium (``GPU``: its
device pool, ``CPU``: the host tier, ``STORAGE``: the node's disk tier, vLLM's name for its offloading connector's
file tier), and when it forgot them all (a refit, a reset, a restart). A gateway's indexer (llm-d's
kv-cache-manager, Dynamo's KV router) or the coordinator's own index (:mod:`megatron_serve.coordinator.kv_index`)
keeps from them a map of which engine holds which prefix.

The encoding is vLLM 0.33's (``vllm/distributed/kv_events.py``), so a subscriber that decodes with vLLM's own
structs reads ours: a batch is the array ``[ts, events, data_parallel_rank]`` and each event a map of its fields
with its type's name under ``"type"`` (msgspec's ``tag=True`` without ``array_like``; the positional events of
vLLM's older documented subscriber are gone from vLLM, and llm-d's indexer reads the maps). ``BlockStored``
carries vLLM's required fields, ``lora_name`` among them (``None`` for the base model), and ``group_idx`` (0: an
engine's one KV cache group). The structs declare every field of vLLM's, in its order, though this engine never
sets the optional rest (``extra_keys``, ``locality``...: left out of the map when unset, as vLLM leaves them):
msgspec sizes a map's header by the fields a struct declares, so only the same declaration gives vLLM's bytes.
A batch travels over ZeroMQ as vLLM's publisher sends it: ``[topic, seq (8 bytes, big-endian), payload]`` on a PUB
socket, and a ROUTER answers a replay request (the first missed ``seq``, 8 bytes big-endian) with every buffered
batch from there, ``[topic, seq, payload]`` each, then ``[b"", -1, b""]``.

Block hashes are this project's chained hashes (:mod:`megatron_serve.wire.prefix_hash`), unsigned 64-bit:
a chain starts from the request's cache salt, its LoRA adapter's registration and the weights' epoch, so a
block computed under other weights or another adapter version never has the hash a request looks for.
``lora_name`` names the adapter and ``lora_id`` is its version (vLLM's integer id of the adapter).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

import msgspec

#: ``medium`` of a block in each tier: vLLM's ``MEDIUM_GPU``, ``MEDIUM_CPU`` and ``MEDIUM_STORAGE`` (its file tier's).
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "STORAGE"
MEDIA = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)

#: vLLM's ``--kv-offloading-backend`` values served here: ``native`` (the host tier alone, vLLM's default) and ``disk``
#: (the host tier spills to files shared by a node's engines: ``engine.kv.disk``).
KV_OFFLOADING_BACKENDS = ("native", "disk")

#: The replay socket's end-of-replay marker (a seq of -1 with an empty topic and payload).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

#: ``group_idx`` of every event: an engine's pool is one KV cache group (vLLM numbers its groups from 0).
KV_CACHE_GROUP = 0


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events: each encodes as a map, the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Complete blocks now held in ``medium``, each chained on the one before it: ``parent_block_hash`` is the
    first one's parent (None: it starts its chain), ``token_ids`` the blocks' tokens, ``block_size`` each."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


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
