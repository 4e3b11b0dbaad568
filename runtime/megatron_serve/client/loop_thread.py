"""An asyncio event loop on a background thread, for blocking APIs built on async code.

``MegatronLLM`` in coordinator mode hosts its ``InferenceClient`` here and waits on the results
from the caller's thread. Waiting *from the loop thread itself* could never finish (the loop
would wait on itself), so :meth:`EventLoopThread.run` refuses that with a ``RuntimeError``
instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

logger = logging.getLogger("megatron_serve.client")


class EventLoopThread:
    def __init__(self, name: str = "megatron-serve-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    @property
    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it finishes; its exception propagates."""
        if self.in_loop_thread:
            coro.close()
            raise RuntimeError("a blocking MegatronLLM call was made from its own event-loop thread, where it "
                               "would deadlock: use MegatronAsyncLLM (await) in async code instead")
        if not self._thread.is_alive() or self.loop.is_closed():
            coro.close()
            raise RuntimeError("the event-loop thread has stopped (was shutdown() called?)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self, teardown: Coroutine[Any, Any, None], timeout: float = 5.0) -> None:
        """Run the owner's ``teardown`` for at most ``timeout``, then :meth:`stop` (idempotent). A teardown that
        overruns (its loop starved of CPU while the machine is loaded) or fails is logged, not raised: whoever
        closes is on its way out, and :meth:`stop` cancels what the teardown left running, within its own bound
        (a short ``timeout`` for the teardown left the cancellations none on a loaded machine: tasks then stayed
        pending)."""
        if self.loop.is_closed():
            teardown.close()
            return
        try:
            self.run(teardown, timeout=timeout)
        except Exception:  # noqa: BLE001 - TimeoutError, or a connection that never came up: nothing left to close
            logger.debug("closing %s", self._thread.name, exc_info=True)
        finally:
            self.stop()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the tasks still on the loop and let them end, stop the loop and join the thread (idempotent):
        a task left pending when its loop is closed would be destroyed pending, with an error logged for each."""
        if self.loop.is_closed():
            return
        if self.in_loop_thread:
            raise RuntimeError("EventLoopThread.stop() called from its own loop thread")
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_others(), self.loop).result(timeout)
            except Exception:  # noqa: BLE001 - a loop that does not turn within the timeout: stop it all the same
                logger.debug("cancelling the tasks of %s", self._thread.name, exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one, and wait until they have ended."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
