"""The requests' way through the coordinator: in from a client (SUBMIT), out to an engine and back (its step
outputs, mirrored), finished (by its engine, an abort, or nothing left to compute), delivered (RESULT) and forgotten
once the client acknowledged it. A request that loses its engine goes back to the head of the queue.

:class:`RequestFlow` owns the request table, the prefill/decode handoffs and the decoder of the clients' sampling
parameters; it reads the fleet's members (engines, clients) and writes its messages to the core's outbox. The core
routes each message here; dispatch (:mod:`.dispatch`) moves queued requests to engines.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..limits import KeptIdsMeter, engine_request_cost, over_budget
from ..wire.accumulator import DeltaAccumulator
from ..wire.deltas import ClientShare, EngineStep, RequestDelta
from ..wire.handshake import PROTOCOL_VERSION, SUBMIT_PROTOCOL, Error
from ..wire.protocol import ErrorCode, Header
from ..wire.request import FinalRecord, FinishReason, RequestStatus
from ..wire.sampling_params import SharedParams
from ..wire.submission import ClientAbort, EngineAbort, ResultAck, ResultOut, Submit
from . import prompts
from .disaggregation import Handoffs
from .droplog import DropLog
from .effects import Outbox, Send
from .peers import ClientRecord, EngineRecord
from .placement import admit, pinned_gone, refusal_code
from .requests import DeltaFacts, Phase, RequestRecord, RequestTable, final_facts
from .step_log import share_deltas
from .step_tokens import StepShares, catch_up

_STEP_OUTPUT = msgspec.msgpack.Decoder(RequestDelta)
#: How a share's frame begins: a list of two, ``STEP_TOKENS`` (an engine writes no other message to a client).
_STEP_TOKENS_FRAME = bytes((0x92, int(Header.STEP_TOKENS)))
_FACTS = msgspec.msgpack.Decoder(DeltaFacts)
_FINAL_RECORD = msgspec.msgpack.Decoder(FinalRecord)
_ENCODE = msgspec.msgpack.Encoder()
_FINISHED = ("COMPLETED", "FAILED")


class RequestFlow:
    """Every request's way from SUBMIT to its acknowledged RESULT (see the module docstring)."""

    def __init__(self, *, engines: dict[str, EngineRecord], clients: dict[str, ClientRecord], outbox: Outbox,
                 drop: DropLog, max_image_bytes: int, max_request_logprobs: int) -> None:
        """``engines`` and ``clients``: the fleet's members, read (a client with nothing left is removed from
        ``clients``); ``max_image_bytes`` and ``max_request_logprobs``: what one request may carry (more is refused
        with ERROR)."""
        self.table = RequestTable()
        self.handoffs = Handoffs()  # prefill/decode disaggregation: requests between their two engines
        self.stale_outputs = 0  # outputs of requests aborted or moved meanwhile: never delivered twice
        self._engines, self._clients, self._out, self._drop = engines, clients, outbox, drop
        self._params = SharedParams()
        self.max_image_bytes = int(max_image_bytes)
        self.max_request_logprobs = int(max_request_logprobs)

    # ------------------------------------------------------------------ from clients

    def on_submit(self, client: ClientRecord, identity: bytes, body: Submit, now: float) -> None:
        if body.acks:  # protocol 10: the results the client acknowledges ride with its next request
            self.forget_acked(client, body.acks)
        crid = body.client_request_id
        key = f"{client.client_id}/{crid}"
        record = self.table.get(key)
        if record is not None:
            # Resubmission after a reconnect: the request is already ours. Send what the client missed.
            have = len(body.generated_tokens or ())
            missed = record.tokens_after(have)
            for message in catch_up(crid, missed, have) if missed is not None else ():
                self._out.send(identity, Header.STEP_TOKENS, message)
            if record.phase is Phase.FINISHED:
                self.deliver(record)
            return
        if client.protocol < SUBMIT_PROTOCOL:
            self._out.send(identity, Header.ERROR, Error(
                code=ErrorCode.UNSUPPORTED.value, client_request_id=crid,
                message=f"this client speaks protocol {client.protocol}; this coordinator speaks {PROTOCOL_VERSION} "
                        f"and serves clients of {SUBMIT_PROTOCOL} or later (tokens travel only as STEP_TOKENS, "
                        f"and the client makes the text): upgrade the client"))
            return
        try:
            raw = body.sampling_params
            params, params_wire = self._params.read(b"" if raw is msgspec.UNSET else bytes(raw))
            record = RequestRecord(request_id=key, client_id=client.client_id, client_request_id=crid,
                                   prompt_tokens=prompts.prompt_ids(body.prompt), params=params,
                                   params_wire=params_wire, stream=bool(body.stream),
                                   mirror=DeltaAccumulator(body.generated_tokens),
                                   images=prompts.submitted_images(body.images, self.max_image_bytes))
            cost = engine_request_cost(len(record.prompt_tokens), params)
            over = over_budget(cost, self.max_request_logprobs)
            if over is not None:
                raise ValueError(over)
            if params.return_top_p_token_ids:  # top-p alone bounds nothing up front: counted as produced (on_step)
                kept = body.kept_ids or 0  # a resubmission's, delivered before: still counted
                record.kept = KeptIdsMeter(cost, self.max_request_logprobs, "--max-request-logprobs", kept=kept,
                                           tokens=len(body.generated_tokens or ()) if kept else 0)
            admit(record, body.placement, self._engines.values())  # its session, its engine if pinned
        except ValueError as exc:
            self._out.send(identity, Header.ERROR,
                           Error(code=refusal_code(exc), message=str(exc), client_request_id=crid))
            return
        client.requests.add(key)
        self.table.add(record, Phase.QUEUED, now)
        if record.exhausted():
            self.finish_here(record, "COMPLETED", "length", "length reached before resubmission")

    def on_abort(self, client: ClientRecord, body: ClientAbort) -> None:
        record = self.table.get(f"{client.client_id}/{body.client_request_id}")
        if record is not None and record.phase is not Phase.FINISHED:
            self.abort(record, "aborted by the client")

    def on_result_ack(self, client: ClientRecord, body: ResultAck) -> None:
        self.forget_acked(client, body.client_request_ids)

    def forget_acked(self, client: ClientRecord, client_request_ids: list[Any]) -> None:
        """Forget the finished requests whose RESULTs ``client`` acknowledged (an unfinished one is kept)."""
        for crid in client_request_ids:
            record = self.table.get(f"{client.client_id}/{crid}")
            if record is not None and record.phase is Phase.FINISHED:
                self.forget(record)

    # ------------------------------------------------------------------ endings

    def abort(self, record: RequestRecord, message: str, by_client: bool = True) -> None:
        """End an unfinished request now with the tokens mirrored so far (its engine is told to drop it).

        A client's abort is ``FAILED``; the fleet's (PAUSE in abort mode) is ``COMPLETED``: the
        partial output is a valid answer that the caller may resubmit to continue.
        """
        self._release(record)
        if by_client:
            self.finish_here(record, "FAILED", "abort", message, error=message)
        else:
            self.finish_here(record, "COMPLETED", "abort", message)

    def _release(self, record: RequestRecord) -> None:
        """Tell a dispatched request's engine to drop it (it stops computing it)."""
        if record.phase is Phase.DISPATCHED:
            engine = self._engines.get(record.engine_id or "")
            if engine is not None:
                engine.assigned.discard(record.request_id)
                self._out.send(engine.identity, Header.ABORT, EngineAbort(request_id=record.request_id),
                               engine.batches)

    def end_over_budget(self, record: RequestRecord, reason: str) -> None:
        """End a request whose kept ids passed the budget as they were produced: its engine drops it, its client has
        the tokens so far and gets a FAILED result, reason ``length``, its error naming the cap (the server answers
        it as a request over a limit)."""
        self._release(record)
        self.finish_here(record, "FAILED", "length", reason, error=reason)

    def abort_unfinished(self, message: str) -> int:
        """PAUSE in abort mode: end every unfinished request (queued, on an engine); how many."""
        unfinished = [r for r in self.table if r.phase is not Phase.FINISHED]
        for record in unfinished:
            self.abort(record, message, by_client=False)
        return len(unfinished)

    def finish_here(self, record: RequestRecord, status: str, finish_reason: str, detail: str,
                    error: str | None = None) -> None:
        """Finish a request without an engine's record (aborted, or nothing left to compute): the record
        has what an engine's final one has (the client got the tokens in ``STEP_TOKENS``)."""
        record.add_event("FAIL" if status == "FAILED" else "FINISH", detail)
        self._finish(record, FinalRecord(
            request_id=record.request_id, status=RequestStatus(status), finish_reason=FinishReason(finish_reason),
            error=error, events=record.events, arrival_time=record.arrival_time, finish_time=time.time(),
            cached_tokens=record.cached_tokens or 0))

    def _finish(self, record: RequestRecord, final: FinalRecord) -> None:
        reason = None if final.finish_reason is None else final.finish_reason.value
        self.table.finish(record, _ENCODE.encode(final), final.status.value, reason)
        self.deliver(record)

    def deliver(self, record: RequestRecord) -> None:
        """Send a finished request's RESULT; it stays in the table until acknowledged (or the client
        does not acknowledge at all)."""
        client = self._clients.get(record.client_id)
        if client is None or client.identity is None:
            return  # kept until the client comes back (or times out)
        self._out.send(client.identity, Header.RESULT,
                       ResultOut(client_request_id=record.client_request_id, request=msgspec.Raw(record.final)),
                       client.batches)
        if not client.acks:
            self.forget(record)

    def forget(self, record: RequestRecord) -> None:
        """Drop a delivered request, and its client once that has left with nothing more to receive."""
        self.table.forget(record)
        self.handoffs.forget(record.request_id)
        client = self._clients.get(record.client_id)
        if client is not None:
            client.requests.discard(record.request_id)
            if client.identity is None and not client.requests:
                del self._clients[client.client_id]

    def requeue(self, record: RequestRecord, reason: str) -> None:
        """Put a request that lost its engine back at the head of the queue, keeping its tokens; one pinned to that
        engine (a data-parallel rank: :mod:`.placement`) fails instead, with the tokens it has."""
        if record.pinned is not None:
            return self.finish_here(record, *pinned_gone(reason))
        record.moves += 1
        record.add_event("EVICT", reason)
        if record.exhausted():
            self.finish_here(record, "COMPLETED", "length", "length reached before the move")
        else:
            self.table.enqueue(record, first=True)

    def hand_back(self, engine: EngineRecord, keys: list[Any], why: str) -> int:
        """``engine`` handed back the requests ``keys`` names (draining, or leaving its expert-parallel group): each
        still dispatched to it goes back to the head of the queue; how many did."""
        moved = 0
        for key in keys:
            record = self.table.get(key) if isinstance(key, str) else None
            if record is not None and record.phase is Phase.DISPATCHED and record.engine_id == engine.engine_id:
                engine.assigned.discard(key)
                self.requeue(record, f"handed back by engine {engine.engine_id}{why}")
                moved += 1
        return moved

    # ------------------------------------------------------------------ from engines

    def on_step(self, engine: EngineRecord, body: EngineStep) -> None:
        """An engine's step: each request's share mirrored and sent on to its client in one ``STEP_TOKENS``, then
        the finished ones' RESULTs.

        A plain share (ids and epochs, what most steps carry) is filed as its bytes (:meth:`RequestRecord.file`) and
        forwarded: unread when the engine named it in ``plain_ids`` (:meth:`_file_plain`), else read only for its
        request id, its ids and whether it ends the request. One with routing rows, prompt scores or kept ids, one of
        a request with a kept-ids budget, and every share while a prefill hands requests on to decode engines, is read
        whole and mirrored at once. A client's share that the engine built (protocol 11) is forwarded whole and kept in
        the engine's log (:meth:`_pass_shares`)."""
        if body.engine_id != engine.engine_id:
            # Output of an earlier registration of this same socket: its requests were re-queued.
            self._drop(engine.engine_id, f"stale message for registration {body.engine_id!r}")
            return
        records, engine_id, clients, facts_of = self.table.records, engine.engine_id, self._clients, _FACTS.decode
        steps = StepShares()  # what each client gets of this step, one message
        finished: list[tuple[RequestRecord, msgspec.Raw | None, bool]] = []
        over: list[tuple[RequestRecord, str]] = []
        careful = self.handoffs.active
        outputs = body.outputs
        if body.shares:
            outputs = outputs + self._pass_shares(engine, body, careful, finished)
        if body.plain_ids and not careful:
            outputs = self._file_plain(engine, body.plain_ids, outputs, steps)
        for raw in outputs:
            try:
                facts = facts_of(raw)
                record = records.get(facts.request_id)
                whole = (careful or facts.routing or facts.prompt_scores or facts.top_p_token_ids
                         or (record is not None and record.kept is not None))
                out = _STEP_OUTPUT.decode(raw) if whole else None
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self._drop(engine.engine_id, f"ENGINE_STEP output: {exc}")
                continue
            if record is None or record.phase is not Phase.DISPATCHED or record.engine_id != engine_id:
                self.stale_outputs += 1  # aborted, or moved to another engine: never deliver twice
                continue
            if out is None:
                if facts.new_tokens:
                    record.file(raw)
                    client = clients.get(record.client_id)
                    if client is not None and client.identity is not None:
                        steps.add(client.identity, client.batches, record.client_request_id, raw)
                if facts.finished:
                    finished.append((record, body.records.get(facts.request_id), False))
                continue
            if out.new_tokens or out.routing is not None or out.prompt_scores is not None:
                self._mirror(record, out, raw, steps)
            reason = None if record.kept is None else record.kept.add(out.top_p_token_ids)
            if reason is not None:
                over.append((record, reason))
                continue
            final = body.records.get(out.request_id) if out.finished else None
            handed_on = self.handoffs.active and self.handoffs.on_output(self.table, engine, record, out, final)
            if out.finished:
                finished.append((record, final, handed_on))
        self._out.add(steps.sends())
        for record, reason in over:  # after the tokens that passed the budget
            self.end_over_budget(record, reason)
        for record, final, handed_on in finished:  # their RESULTs after their last tokens
            engine.assigned.discard(record.request_id)
            engine.completed += 1
            if not handed_on:  # a prefill engine's finish hands the request on to a decode engine
                self._finish_from_engine(engine, record, final)

    def _pass_shares(self, engine: EngineRecord, body: EngineStep, careful: bool,
                     finished: list[tuple[RequestRecord, msgspec.Raw | None, bool]]) -> list[msgspec.Raw]:
        """Forward each client's share of the step (protocol 11) as the engine wrote it, kept in the engine's log for
        the mirrors (:mod:`.step_log`), once one set check says that every request it names is one this engine holds
        for that client; its finished ones go to ``finished``. Returns the deltas of the shares that fail the check
        (a request aborted or moved meanwhile), or of every share while a prefill hands requests on, to read one by
        one."""
        records, clients, log, held_of = self.table.records, self._clients, engine.log, engine.assigned.of_client
        rest: list[msgspec.Raw] = []
        for share in body.shares:
            held = None if careful else held_of(share.client_id)
            if (held is None or not held.issuperset(share.request_ids) or not held.issuperset(share.finished)
                    or not share.frame.startswith(_STEP_TOKENS_FRAME)):
                rest += self._opened(engine, share)
                continue
            if log.append(share):
                log.trim(records)
            client = clients.get(share.client_id)
            if client is not None and client.identity is not None:
                self._out.add((Send(client.identity, share.frame, client.batches),))
            for request_id in share.finished:
                record = records.get(request_id)
                if record is not None:
                    finished.append((record, body.records.get(request_id), False))
        return rest

    def _opened(self, engine: EngineRecord, share: ClientShare) -> list[msgspec.Raw]:
        """A share's deltas, to be read one by one (an unreadable share is dropped by name)."""
        try:
            deltas = share_deltas(share.frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._drop(engine.engine_id, f"ENGINE_STEP share: {exc}")
            return []
        if len(deltas) != len(share.request_ids):
            self._drop(engine.engine_id, f"ENGINE_STEP share names {len(share.request_ids)} requests for "
                                         f"{len(deltas)} deltas")
            return []
        return deltas

    def _file_plain(self, engine: EngineRecord, plain_ids: list[str], outputs: list[msgspec.Raw],
                    steps: StepShares) -> list[msgspec.Raw]:
        """File and forward the step's plain deltas, the first ``len(plain_ids)`` outputs, by the ids the engine named
        them with: none is decoded here. Returns the outputs left to read one by one: the rest, and a plain delta of a
        request with a kept-ids budget (counted as it comes)."""
        count = len(plain_ids)
        if count > len(outputs):
            self._drop(engine.engine_id, f"ENGINE_STEP names {count} plain outputs of {len(outputs)}")
            return []
        records, engine_id, clients, dispatched = self.table.records, engine.engine_id, self._clients, Phase.DISPATCHED
        rest: list[msgspec.Raw] = []
        for request_id, raw in zip(plain_ids, outputs):
            record = records.get(request_id)
            if record is None or record.phase is not dispatched or record.engine_id != engine_id:
                self.stale_outputs += 1  # aborted, or moved to another engine: never deliver twice
            elif record.kept is not None:
                rest.append(raw)
            else:
                record.file(raw)
                client = clients.get(record.client_id)
                if client is not None and client.identity is not None:
                    steps.add(client.identity, client.batches, record.client_request_id, raw)
        return rest + outputs[count:] if rest else outputs[count:]

    def _mirror(self, record: RequestRecord, out: RequestDelta, raw: msgspec.Raw, steps: StepShares) -> None:
        """Keep the step's share (a request that moves continues from its tokens) and file it for the client's
        ``STEP_TOKENS``, which makes the text (for every request: stop strings are its job): the delta as the engine
        encoded it (a finished request's record came apart from it, for ``RESULT``)."""
        record.keep(out)
        client = self._clients.get(record.client_id)
        if client is not None and client.identity is not None:
            steps.add(client.identity, client.batches, record.client_request_id, raw)

    def _finish_from_engine(self, engine: EngineRecord, record: RequestRecord, final: msgspec.Raw | None) -> None:
        """Finish with the engine's record ``final``, forwarded as its bytes when it is complete (the client
        parses it, once): only its status and reason are read here. A record without a final status is parsed
        here, and mended."""
        try:
            facts = None if final is None else final_facts(final)  # None when the engine sent nil
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._drop(engine.engine_id, f"unreadable final request {record.request_id}: {exc}")
            facts = None
        if facts is None or final is None:  # no record (or an unreadable one): the coordinator's mirror is the result
            self.finish_here(record, "COMPLETED", "length", "finished without a record")
            return
        if facts.status in _FINISHED:
            self.table.finish(record, bytes(final), facts.status, facts.finish_reason)
            self.deliver(record)
            return
        try:
            whole = _FINAL_RECORD.decode(final)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._drop(engine.engine_id, f"unreadable final request {record.request_id}: {exc}")
            self.finish_here(record, "COMPLETED", "length", "finished without a readable record")
            return
        self._finish(record, msgspec.structs.replace(whole, status=RequestStatus.COMPLETED))
