"""An asyncio event loop on a background thread, for blocking APIs built on async code.

``MegatronLLM`` in coordinator mode hosts its ``InferenceClient`` here and waits on the results
from the caller's thread. Waiting *from the loop thread itself* could never finish (the loop
would wait on itself), so :meth:`EventLoopThread.run` refuses that with a ``RuntimeError``
instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


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

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join the thread (idempotent)."""
        if self.loop.is_closed():
            return
        if self.in_loop_thread:
            raise RuntimeError("EventLoopThread.stop() called from its own loop thread")
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
