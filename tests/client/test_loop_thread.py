"""EventLoopThread's shutdown: a teardown that overruns is cut short, not raised, and no task is left pending.

CI once saw `megatron-serve run`'s probe process end Ctrl-C with a traceback: on a loaded machine its fleet watch's
teardown took longer than its 5 s bound, the TimeoutError escaped, and the tasks still pending were destroyed with
an error logged for each."""

from __future__ import annotations

import asyncio
import threading

from megatron_serve.client.loop_thread import EventLoopThread


async def _until_cancelled(cancelled: threading.Event) -> None:
    """Wait forever; record the cancellation that ends it."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.set()
        raise


def _task_that_records_its_end(loop_thread: EventLoopThread) -> threading.Event:
    cancelled = threading.Event()

    async def start() -> None:
        asyncio.ensure_future(_until_cancelled(cancelled))
        await asyncio.sleep(0)

    loop_thread.run(start())
    return cancelled


def test_a_teardown_that_overruns_is_cut_short_and_the_tasks_left_are_cancelled() -> None:
    loop_thread = EventLoopThread("test-loop")
    left_running = _task_that_records_its_end(loop_thread)
    teardown_cancelled = threading.Event()

    loop_thread.close(_until_cancelled(teardown_cancelled), timeout=0.2)  # raises nothing
    assert left_running.is_set(), "a task left on the loop was not cancelled"
    assert teardown_cancelled.is_set(), "the overrunning teardown was not cancelled"
    assert loop_thread.loop.is_closed()
    loop_thread.close(_until_cancelled(threading.Event()))  # idempotent: a closed loop runs nothing


def test_a_failing_teardown_still_stops_the_loop() -> None:
    loop_thread = EventLoopThread("test-loop")

    async def teardown_that_fails() -> None:
        raise ConnectionError("never connected")

    loop_thread.close(teardown_that_fails())
    assert loop_thread.loop.is_closed()


def test_stop_cancels_what_is_left_before_closing_the_loop() -> None:
    loop_thread = EventLoopThread("test-loop")
    left_running = _task_that_records_its_end(loop_thread)
    loop_thread.stop()
    assert left_running.is_set()
    assert loop_thread.loop.is_closed()
