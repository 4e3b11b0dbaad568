"""Prefill/decode disaggregation through the coordinator (``run --prefill-engines N --decode-engines M``).

Each engine says in its HELLO which part it plays (``kv_role``, vLLM's ``--kv-transfer-config`` values):
``kv_producer`` (prefill), ``kv_consumer`` (decode) or ``kv_both`` (every engine of a colocated fleet). While
the fleet has prefill engines, a new request goes to one of them with ``kv_transfer_params``
``{"do_remote_decode": true}`` and sampling parameters cut to its first token: the prefill engine computes
the prompt and that token (streamed to the client at once), sends the request's KV blocks (``KV_BLOCKS``) and
then its step's output finishing the request there. That finish is not the request's end: the coordinator
queues the request again, ahead of all, and sends it to a decode engine, the blocks first (the same
``KV_BLOCKS`` parts), then the request with ``{"do_remote_prefill": true}`` (Megatron-core's
``SUBMIT_REQUEST_WITH_KV``); the decode engine continues from them.

The coordinator keeps the blocks until the decode engine's first output shows they landed. A decode engine
lost before that (killed, timed out, drained) leaves the request queued again with its blocks, and the next
decode engine gets them: nothing is lost and nothing is computed twice. Lost after that, the request moves
as any other does, from its mirrored tokens (the next engine computes its context). A fleet without prefill
engines (none registered, or none left) sends requests anywhere, as a colocated fleet does; one without
decode engines lets its prefill engines finish what they start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import msgspec

from ..wire.kv_blocks import KVBlocks, remote_decode, remote_prefill
from ..wire.deltas import RequestDelta
from ..wire.submission import EngineSubmitOut
from .droplog import DropLog
from .peers import EngineRecord
from .requests import RequestRecord, RequestTable, final_facts

PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"


_PARAMS = msgspec.msgpack.Encoder()


def kv_role(engine: EngineRecord) -> str:
    """The part an engine plays (its HELLO's ``kv_role``; absent: both, as every engine before disaggregation)."""
    role = engine.info.get("kv_role")
    return role if role in (PRODUCER, CONSUMER) else BOTH


@dataclass
class Handoffs:
    """Requests between a prefill engine and a decode engine: where each is prefilled, and the blocks held."""

    prefilling: dict[str, str] = field(default_factory=dict)  # request id -> the prefill engine it was sent to
    blocks: dict[str, list[KVBlocks]] = field(default_factory=dict)  # request id -> its parts, until they landed
    handed_on: int = 0  # requests a prefill engine handed on to decode
    _roles: frozenset[str] = frozenset()  # the parts the registered engines play, as of _roles_key
    _roles_key: tuple[int, int] = (-1, -1)  # (registrations, engines): any engine that joins or leaves changes it

    @property
    def active(self) -> bool:
        return bool(self.prefilling or self.blocks)

    def candidates(self, members: Mapping[str, EngineRecord], registrations: int, record: RequestRecord,
                   engines: Sequence[EngineRecord]) -> Sequence[EngineRecord]:
        """The engines that may take ``record`` now: prefill engines for a request with nothing generated,
        the others for the rest; all of them where the fleet has no engine of that part registered (and in a
        colocated fleet, at the cost of one comparison). ``members``: every registered engine, whose parts are
        read again only when ``registrations`` or their number changed."""
        registered = self._registered(members, registrations)
        if registered <= {BOTH}:
            return engines
        if record.generated_tokens or record.request_id in self.blocks:
            wanted = (CONSUMER, BOTH) if registered - {PRODUCER} else (PRODUCER,)
        else:
            wanted = (PRODUCER,) if PRODUCER in registered else (CONSUMER, BOTH)
        return [engine for engine in engines if kv_role(engine) in wanted]

    def colocated(self, members: Mapping[str, EngineRecord], registrations: int) -> bool:
        """Whether every registered engine both prefills and decodes (:meth:`candidates` keeps every engine)."""
        return self._registered(members, registrations) <= {BOTH}

    def _registered(self, members: Mapping[str, EngineRecord], registrations: int) -> frozenset[str]:
        """The parts the registered engines play, read again only when ``registrations`` or their number changed."""
        key = (registrations, len(members))
        if key != self._roles_key:
            self._roles_key, self._roles = key, frozenset(kv_role(engine) for engine in members.values())
        return self._roles

    def submit(self, record: RequestRecord, engine: EngineRecord,
               body: EngineSubmitOut) -> tuple[list[KVBlocks], EngineSubmitOut]:
        """What ``engine`` is sent for ``record``: the ``KV_BLOCKS`` to send first (for a decode, the blocks it
        continues from) and the ``ENGINE_SUBMIT`` (for a prefill, its first token only, the blocks asked for)."""
        rid = record.request_id
        self.prefilling.pop(rid, None)
        if kv_role(engine) == PRODUCER and not record.generated_tokens:
            if record.params.num_tokens_to_generate == 1:
                return [], body  # nothing to hand on: the prefill engine serves it whole
            self.prefilling[rid] = engine.engine_id
            first = msgspec.structs.replace(record.params, num_tokens_to_generate=1,
                                            min_tokens=min(record.params.min_tokens, 1))
            request = msgspec.structs.replace(body.request, sampling_params=msgspec.Raw(_PARAMS.encode(first)))
            return [], EngineSubmitOut(request=request, kv_transfer_params=remote_decode())
        parts = self.blocks.get(rid)
        if parts and kv_role(engine) != PRODUCER:
            return parts, EngineSubmitOut(request=body.request, kv_transfer_params=remote_prefill(parts[0].engine_id))
        return [], body

    def on_blocks(self, drop: DropLog, engine: EngineRecord, blocks: KVBlocks) -> None:
        """``KV_BLOCKS`` from ``engine``: kept for the request's decode engine when it is this engine's prefill."""
        problem = blocks.problem()
        if blocks.engine_id != engine.engine_id:
            problem = f"stale KV_BLOCKS for registration {blocks.engine_id!r}"
        elif self.prefilling.get(blocks.request_id) != engine.engine_id:
            problem = f"KV_BLOCKS of request {blocks.request_id!r}, which it was not prefilling"
        if problem is not None:
            drop(engine.engine_id, problem)
            return
        self.blocks.setdefault(blocks.request_id, []).append(blocks)

    def on_output(self, table: RequestTable, engine: EngineRecord, record: RequestRecord,
                  out: RequestDelta, final: msgspec.Raw | None) -> bool:
        """An engine's output for a request it runs (mirrored already; ``final``: a finished one's record, as the
        engine sent it); True when it ends the request's prefill and the request was queued for its decode engine
        (the caller does not finish it)."""
        rid = record.request_id
        if self.prefilling.get(rid) != engine.engine_id:
            if rid in self.blocks:
                del self.blocks[rid]  # its decode engine's first output: the blocks landed
            return False
        if not out.finished:
            return False
        del self.prefilling[rid]
        try:
            facts = None if final is None else final_facts(final)
        except (msgspec.ValidationError, msgspec.DecodeError):
            facts = None
        if facts is None or facts.status != "COMPLETED" or facts.finish_reason != "length" or record.exhausted():
            self.blocks.pop(rid, None)  # over where it started (a stop token, an error): finished as it is
            return False
        self.handed_on += 1
        record.add_event("EVICT", f"prefilled by engine {engine.engine_id}: handed on to decode "
                                  f"({'with' if rid in self.blocks else 'without'} its KV blocks)")
        table.enqueue(record, first=True)
        return True

    def forget(self, request_id: str) -> None:
        self.prefilling.pop(request_id, None)
        self.blocks.pop(request_id, None)
