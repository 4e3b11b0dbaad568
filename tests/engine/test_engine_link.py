"""The engine's coordinator link closes without blocking, whatever its thread is doing."""

from __future__ import annotations

import threading
import time

import zmq

from megatron_serve.engine.process.link import CoordinatorLink


class _EndsAfterOneLook:
    """A thread handle that says 'alive' once more after the real thread ended: the race between
    ``is_alive()`` and the close request, made certain."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread, self.looks = thread, 0

    def is_alive(self) -> bool:
        self.looks += 1
        return self.looks == 1

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def test_close_returns_when_the_link_thread_ended_on_its_own():
    with zmq.Context() as ctx:
        link = CoordinatorLink("tcp://127.0.0.1:9", {"info": {}}, context=ctx)
        link.start()
        link._tx.send_multipart([b"close", b""])  # the thread ends by itself (as after a refused token)
        link._thread.join(10)
        assert not link._thread.is_alive()
        link._tx.getsockopt(zmq.EVENTS)  # the main end learns that its peer is gone (zmq does so lazily)
        link._thread = _EndsAfterOneLook(link._thread)  # type: ignore[assignment]
        closer = threading.Thread(target=link.close, kwargs={"timeout": 0.5}, daemon=True)
        began = time.monotonic()
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() blocked on a pipe whose reader is gone"
        assert time.monotonic() - began < 5
