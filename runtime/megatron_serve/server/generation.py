"""Running the engine requests of one HTTP request: submit, wait or stream, and always clean up.

One HTTP request becomes several engine requests (``n`` choices, several prompts). This module
submits them through the backend, gathers their results (or merges their streams in arrival
order), and guarantees that an HTTP request that goes away — client disconnect, cancellation,
an error in a sibling choice — aborts every engine request it still owns, so the engine frees
their KV blocks at once instead of generating for nobody.

Failed engine requests become HTTP errors here: a request the engine refused before running it
(it never reached prefill) is the caller's fault (400); one that failed while running is ours (500).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..wire.connection import CoordinatorError, CoordinatorLost
from ..client.outputs import StreamPartial
from ..errors import ClientNotStarted
from ..limits import KeptIdsMeter
from ..wire.placement import PlacementError
from ..wire.request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
from .drain import Stopping
from .errors import APIError, shutting_down
from .backend import Backend
from .metrics import ServerMetrics
from .placement import placement_refused
from .request_log import RequestLog
from .chunks import TextChunks, write_text_event
from .streaming import DONE, EventWriter, Renderer

if TYPE_CHECKING:  # annotations only: the translation of bodies is not this module's to load
    from .tenant_admission import Ticket
    from .translate import EngineJob

logger = logging.getLogger("megatron_serve.server")


def _nothing() -> None:
    pass


#: Engine request ids: a random prefix per process and a counter (a uuid4 per request read the system's random
#: source each time; the ids only need to be unique among this process's client's requests).
_ID_PREFIX = f"{uuid.uuid4().hex[:16]}-"
_ID_NUMBERS = itertools.count()
#: Engine requests of one HTTP request in the fleet at once; the rest are submitted as earlier ones finish. One
#: request may ask for ``--max-choices`` of them (prompts x ``n``): sent at once, 160,000 of them filled the
#: coordinator's queue and tables in one go (issue 86); as a window, the queue holds what the fleet can start soon,
#: and the request's own order is kept (a later job starts only as an earlier one ends).
SUBMIT_WINDOW = 1024


class _Tagged:
    """A sink that hands a job's items to its submission (:meth:`Submission.deliver`): its ``put_nowait`` is that
    method with the job bound (no call of its own per item)."""

    __slots__ = ("put_nowait",)

    def __init__(self, submission: "Submission", job: EngineJob, request_id: str) -> None:
        self.put_nowait = functools.partial(submission.deliver, job, request_id)


class _TextTagged(_Tagged):
    """:class:`_Tagged` for a stream whose pieces go out as they come (no ``stream_interval``), as a
    ``client.streams.TextSink``: once the job's first piece went, a plain choice's later text goes straight from
    here to the answer's connection, its chunk made from the bytes around the text that the renderer's
    :class:`~.chunks.TextChunks` cut. It is the writer's :class:`~.streaming.Lane`: while the writer lets it
    (:attr:`direct`), a step's token touches this object, those bytes and the transport alone, not the submission,
    the renderer's bookkeeping, the writer or its body; otherwise the chunk goes through the writer."""

    __slots__ = ("_render", "_writer", "_job", "_chunks", "_before", "_after", "direct")

    def __init__(self, submission: "Submission", job: EngineJob, request_id: str, render: Renderer[Any],
                 writer: EventWriter) -> None:
        super().__init__(submission, job, request_id)
        self._render, self._writer, self._job = render, writer, job
        self._chunks: TextChunks | bool | None = None  # asked once (then False: every piece goes whole)
        self._before = self._after = b""
        self.direct: Any = None  # the transport to write into, while the writer says so (EventWriter.add_lane)

    def put_text(self, text: str) -> bool:
        """The job's new ``text`` alone, as :meth:`Submission.deliver` delivers a piece of that text and nothing
        else; False when the renderer wants whole pieces. Asked only after the job's first piece (the client's
        collector takes the first token the general way), so the renderer's answer then holds for the stream."""
        transport = self.direct
        if transport is not None:  # (set only once the chunks below were made)
            if text:  # (an empty text would end the body)
                event = write_text_event(transport, self._before, text, self._after)
                if event is not None:  # the connection's buffer is full: the writer queues it
                    self._writer.write(event)
            return True
        chunks = self._chunks
        if chunks is None:
            chunks = self._chunks = self._render.text_chunks(self._job) or False
            if chunks is not False:
                self._before, self._after = chunks.before, chunks.after
                self._writer.add_lane(self)
        if chunks is False:
            return False
        if text:
            self._writer.write(chunks.event(text))  # (nothing once the answer ended: EventWriter.write)
        return True


class PendingCounter:
    """Engine requests this server is waiting on; bounded by the queue limit (429 beyond it). ``gauge``: a
    multiprocess gauge kept equal to it (``--api-server-count`` > 1 sums the processes' counts)."""

    def __init__(self, limit: int | None = None, gauge: Any = None) -> None:
        self.limit = limit
        self.value = 0
        self.gauge = gauge

    def acquire(self, count: int) -> None:
        if self.limit is not None and self.value + count > self.limit:
            raise APIError(429, f"the server's queue is full ({self.value} of {self.limit} requests pending, this one "
                                f"needs {count}); retry later", code="queue_full", headers={"Retry-After": "1"})
        self.value += count
        if self.gauge is not None:
            self.gauge.set(self.value)

    def release(self, count: int = 1) -> None:
        self.value = max(0, self.value - count)
        if self.gauge is not None:
            self.gauge.set(self.value)


def check_result(request: DynamicInferenceRequest) -> DynamicInferenceRequest:
    """Return a finished request, or raise the HTTP error its failure deserves."""
    if request.status is not RequestStatus.FAILED:
        return request
    message = request.error or "the request failed"
    if request.finish_reason is FinishReason.LENGTH:  # ended as it passed a budget (kept ids counted as produced)
        raise APIError(400, message, code="over_budget")
    if request.finish_reason is FinishReason.ABORT:
        raise APIError(503, f"the request was aborted by the fleet: {message}", code="request_aborted")
    if not any(e.type is EventType.PREFILL for e in request.events):
        raise APIError(400, f"the engine refused the request: {message}", code="invalid_request")
    raise APIError(500, f"the engine failed while generating: {message}", code="engine_error")


def _submission_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PlacementError):  # a data-parallel rank no engine holds
        return placement_refused(exc)
    if isinstance(exc, ValueError):  # the coordinator's INVALID_REQUEST
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, CoordinatorLost):
        return APIError(503, f"service unavailable: {exc}", code=exc.code, headers={"Retry-After": "5"})
    if isinstance(exc, (ConnectionError, ClientNotStarted)):
        return APIError(503, f"service unavailable: {exc}", code="coordinator_unreachable")
    if isinstance(exc, CoordinatorError):
        return APIError(503, f"the coordinator refused the request: {exc}", code=exc.code)
    if isinstance(exc, RuntimeError):  # e.g. an in-process engine whose step failed
        return APIError(500, f"the engine failed: {exc}", code="engine_error")
    return APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")


def merge_pieces(first: StreamPartial | None, then: StreamPartial) -> StreamPartial:
    """Two consecutive pieces of one stream as one."""
    if first is None:
        return then
    return StreamPartial(then.request_id, first.new_tokens + then.new_tokens, first.new_text + then.new_text,
                         first.new_log_probs + then.new_log_probs, [*first.new_top_ids, *then.new_top_ids],
                         [*first.new_top_log_probs, *then.new_top_log_probs], first.token_texts + then.token_texts,
                         [*first.listed_tokens, *then.listed_tokens], [*first.listed_log_probs, *then.listed_log_probs],
                         [*first.listed_top_ids, *then.listed_top_ids],
                         [*first.listed_top_log_probs, *then.listed_top_log_probs])


def _extras(job: EngineJob, meter: KeptIdsMeter | None) -> dict[str, Any]:
    """The backend's ``images``, ``placement`` and ``meter`` arguments, for jobs that have them only."""
    extra: dict[str, Any] = {"images": job.prompt.images} if job.prompt.images else {}
    if job.placement is not None:
        extra["placement"] = job.placement
    if meter is not None:
        extra["meter"] = meter
    return extra


@dataclass
class Submission:
    """The engine requests of one HTTP request, with the bookkeeping to abort what is unfinished."""

    backend: Backend
    metrics: ServerMetrics
    pending: PendingCounter
    stopping: Stopping  # the server stops: give up at once with a 503 (what is unfinished is aborted)
    jobs: list[EngineJob]
    label: str = ""  # the response id, for the request log
    log: RequestLog = field(default_factory=RequestLog)
    stream_interval: int = 1  # streamed tokens go in groups of this many (a choice's first token at once)
    ids: list[str] = field(default_factory=list)
    unfinished: set[str] = field(default_factory=set)
    cut_ids: set[str] = field(default_factory=set)  # ended by a control route (:meth:`cut`): an answer, not an error
    done: list[DynamicInferenceRequest] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    ticket: Ticket | None = None  # its tenant's reservation (server.tenant_admission), settled and freed here
    window: int | None = None  # engine requests submitted at once, the rest as these finish (None: SUBMIT_WINDOW)
    meter: KeptIdsMeter | None = None  # its kept ids' budget, all its engine requests' ids counted together

    def __post_init__(self) -> None:
        self.window = self.window or SUBMIT_WINDOW
        self.pending.acquire(len(self.jobs))
        self.ids = [f"{_ID_PREFIX}{next(_ID_NUMBERS)}" for _ in self.jobs]
        self.unfinished = set(self.ids)
        self._remaining = len(self.jobs)  # jobs whose final request did not come yet
        self._submit: Callable[[int], None] | None = None  # submits job i (set by results or start_stream)
        self._skip: Callable[[int], None] | None = None  # ends job i unsubmitted, as cut (:meth:`cut`)
        self._submitted = 0  # jobs submitted (or, once cut, ended unsubmitted): the first ones, in order
        self._ended = 0  # submitted jobs whose final request or error came
        self._refilling = False
        self._render: Renderer[Any] | None = None  # a stream's chunk producer, and its writer (start_stream)
        self._writer: EventWriter | None = None
        self._forget_stop: Callable[[], None] = _nothing
        self._held: dict[str, StreamPartial] = {}  # pieces merged while shorter than the interval
        self._opened: set[str] = set()  # jobs whose first piece went

    def _finished(self, request_id: str, request: DynamicInferenceRequest | None) -> None:
        if request is not None and request_id in self.cut_ids and request.finish_reason is FinishReason.ABORT:
            request.status, request.error = RequestStatus.COMPLETED, None  # see cut()
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self.pending.release()
            if request is not None:
                self.metrics.observe_finished(request)
                self.done.append(request)
                if self.ticket is not None:
                    self.ticket.finished(request)
            else:  # refused or lost on the way: no record came back
                self.metrics.observe_failed()
            if not self.unfinished:
                self.log.finished(self.label, self.done, self.started)

    def _refill(self) -> None:
        """Submit the next jobs while fewer than :attr:`window` submitted ones are unfinished (reentered from a
        submission that fails at once: the outer pass goes on)."""
        if self._refilling:
            return
        self._refilling = True
        try:
            while (self._submit is not None and self._submitted < len(self.jobs)
                   and self._submitted - self._ended < self.window):
                self._submitted += 1
                self._submit(self._submitted - 1)
        finally:
            self._refilling = False

    def _never_ran(self, index: int) -> DynamicInferenceRequest:
        """Job ``index`` ended before it was submitted (:meth:`cut`): its answer, with nothing generated."""
        job = self.jobs[index]
        request = DynamicInferenceRequest(request_id=self.ids[index], prompt=None,
                                          prompt_tokens=list(job.prompt.tokens), sampling_params=job.params)
        request.status, request.finish_reason = RequestStatus.COMPLETED, FinishReason.ABORT
        return request

    def _ended_one(self) -> None:
        """A submitted job's final request or error came: room for the next."""
        self._ended += 1
        self._refill()

    def cut(self) -> int:
        """End every unfinished engine request now, as the fleet's PAUSE in ``abort`` mode ends one: its answer comes
        with ``finish_reason`` ``abort`` and the tokens generated so far (vLLM's ``/abort_requests``, SGLang's
        ``/abort_request``: a trainer resubmits the rest), not with the error of a request its client gave up on.
        Returns how many it ended."""
        skipped = 0
        if self._submit is not None and self._skip is not None:  # the jobs not submitted yet end, cut, with nothing
            skipped = len(self.jobs) - self._submitted
            self._submit, self.window = self._skip, len(self.jobs)
            self._refill()
        cut = self.unfinished - self.cut_ids
        self.cut_ids |= cut
        for request_id in cut:
            self.backend.abort(request_id)
        return len(cut) + skipped

    def close(self) -> None:
        """Abort every engine request that has not finished (idempotent)."""
        self._forget_stop()
        self._forget_stop = _nothing  # it holds this submission (through its callback): no reference cycle left
        self._submit = self._skip = None  # nothing more is submitted; each held this submission: no cycle left
        if self.ticket is not None:
            self.ticket.close()
        if not self.unfinished:
            return
        count = len(self.unfinished)
        self.log.aborted(self.label, count, self.started)
        submitted = set(self.ids[:self._submitted])  # the others never reached the fleet: nothing to abort
        for request_id in [rid for rid in self.unfinished if rid in submitted]:
            try:
                self.backend.abort(request_id)
            except Exception:  # a closed client: nothing left to abort
                logger.debug("abort of %s failed", request_id, exc_info=True)
        self.pending.release(count)
        self.metrics.observe_aborted(count)
        self.unfinished.clear()

    # ------------------------------------------------------------------ whole results

    async def results(self) -> list[DynamicInferenceRequest]:
        """Every job's finished request, in job order; errors and cancellation abort the rest."""
        try:
            loop = asyncio.get_running_loop()
            futures: list[asyncio.Future[DynamicInferenceRequest]] = [loop.create_future() for _ in self.jobs]

            def submit(index: int) -> None:
                job, slot = self.jobs[index], futures[index]
                try:
                    landed = self.backend.add_request(job.prompt.tokens, job.params, request_id=self.ids[index],
                                                      **_extras(job, self.meter))
                except Exception as exc:  # refused synchronously (e.g. a closed client): its error, in its place
                    slot.set_exception(exc)
                    slot.exception()  # see _landed
                    self._ended_one()
                    return
                landed.add_done_callback(functools.partial(self._landed, slot))

            def skip(index: int) -> None:
                futures[index].set_result(self._never_ran(index))
                self._ended += 1

            self._submit, self._skip = submit, skip
            self._refill()
            results: list[DynamicInferenceRequest] = []
            stopped = asyncio.get_running_loop().create_future()
            forget = self.stopping.on_set(lambda: stopped.done() or stopped.set_result(None))
            try:
                for request_id, future in zip(self.ids, futures):
                    await asyncio.wait({future, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    if not future.done():
                        raise shutting_down()
                    try:
                        request = future.result()
                    except Exception as exc:
                        self._finished(request_id, None)
                        raise _submission_error(exc) from None
                    self._finished(request_id, request)
                    results.append(check_result(request))
            finally:
                forget()
            return results
        finally:
            self.close()

    def _landed(self, slot: "asyncio.Future[DynamicInferenceRequest]",
                landed: "asyncio.Future[DynamicInferenceRequest]") -> None:
        """A submitted job's future resolved: its outcome into the job's own slot, and the next job submitted."""
        if not slot.done():
            if landed.cancelled():
                slot.cancel()
            elif landed.exception() is not None:
                slot.set_exception(landed.exception())
                slot.exception()  # read here: after an earlier job's error nobody awaits it, and asyncio would log it
            else:
                slot.set_result(landed.result())
        self._ended_one()

    # ------------------------------------------------------------------ streams

    def start_stream(self, render: Renderer[Any], writer: EventWriter) -> None:
        """Submit every job streamed; each item that arrives becomes the answer's events through ``render`` and goes
        to ``writer`` at once (:meth:`deliver`), from the client's own delivery (its receive loop's one pass over a
        step makes and writes every stream's chunk: no task woken per stream and step). The answer ends with the
        last job's final request (``render.end`` and ``[DONE]``), a job's error, or the server stopping;
        :meth:`close` aborts what is unfinished.

        With ``stream_interval`` N > 1 (vLLM's ``--stream-interval``), a job's pieces are merged until they hold N
        tokens (its first piece goes at once, for the time to first token; what is held goes before the final
        request), so the answer has a chunk per N tokens instead of per step.
        """
        self._render, self._writer = render, writer
        if len(self.jobs) > 1:  # a step brings a piece of each: one chunk for them all
            writer.gather()
        self._forget_stop = self.stopping.on_set(lambda: self._fail(shutting_down()))

        def submit(index: int) -> None:
            job, rid = self.jobs[index], self.ids[index]
            try:
                sink = (_TextTagged(self, job, rid, render, writer) if self.stream_interval == 1
                        else _Tagged(self, job, rid))  # (pieces merged to an interval go whole)
                self.backend.add_request_streaming_to(job.prompt.tokens, job.params, sink,
                                                      request_id=rid, **_extras(job, self.meter))
            except Exception as exc:  # refused at once (e.g. a lost coordinator): reported as an item
                self.deliver(job, rid, exc)

        def skip(index: int) -> None:
            self.deliver(self.jobs[index], self.ids[index], self._never_ran(index))

        self._submit, self._skip = submit, skip
        self._refill()

    def deliver(self, job: EngineJob, request_id: str, item: Any) -> None:
        """One of ``job``'s items as it arrives (a piece, its final request or its error): its events made and
        written, in arrival order (see :meth:`start_stream`)."""
        writer = self._writer
        if writer is None or writer.last is not None:  # the answer ended (or the client left): nobody's
            return
        try:
            if type(item) is StreamPartial and self.stream_interval == 1:  # most items: a piece, as it is
                events = self._render.item(job, item)
            else:
                item_events = self._render.item
                events = b"".join([item_events(*pair) for pair in self._pass(job, request_id, item)])
                if not self._remaining:
                    writer.finish(events + self._render.end() + DONE)
                    self.close()
                    return
            if events:
                writer.write(events)
        except APIError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug making the events: the stream ends with an error, the server goes on
            logger.exception("the events of %s could not be made", self.label)
            self._fail(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    def _fail(self, error: APIError) -> None:
        if self._writer is not None:
            self._writer.fail(error)
        self.close()

    def _pass(self, job: EngineJob, request_id: str, item: Any) -> list[tuple[EngineJob, Any]]:
        """What one arrived item other than a piece without ``stream_interval`` lets through to the answer, in order
        (see :meth:`start_stream`); raises a job's error."""
        if isinstance(item, BaseException):
            self._finished(request_id, None)
            self._ended += 1  # the answer ends with this error: nothing more is submitted
            raise _submission_error(item) if isinstance(item, Exception) else item
        if isinstance(item, DynamicInferenceRequest):
            self._remaining -= 1
            self._finished(request_id, item)
            self._ended_one()
            result = check_result(item)
            held = self._held.pop(request_id, None)
            return [(job, result)] if held is None else [(job, held), (job, result)]
        if self.stream_interval > 1 and request_id in self._opened:
            item = merge_pieces(self._held.pop(request_id, None), item)
            if len(item.new_tokens) < self.stream_interval:
                self._held[request_id] = item
                return []
        self._opened.add(request_id)
        return [(job, item)]
