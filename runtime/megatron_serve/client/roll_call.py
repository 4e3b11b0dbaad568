"""Which trainer ranks of a sharded refit are still there: rank 0 waits for the living, not for the dead.

Trainer rank 0 serves the transfer's store and hands the REFIT's outcome to the other trainer ranks through it;
the store goes with rank 0's ``send``, so rank 0 waits until every other rank read the outcome. A rank that died
never reads, and the store cannot tell a dead client from a slow one. So each other rank also holds one plain TCP
connection to rank 0 (:func:`attend`) from the moment it learns where rank 0 is until it has read the outcome:
it says ``read`` on it, or its connection closes when its process ends, however it ends (the kernel closes a
killed process's sockets). Rank 0 (:class:`RollCall`) waits until every other rank either said ``read`` or its
connection closed, so a dead rank costs milliseconds, not the timeout; a rank that is alive but slow is waited
for (up to the timeout), as is one whose machine vanished without closing its connections.

Who may answer: each rank opens with the transfer's random prefix, which only the trainer's own group (and the
encrypted REFIT) carries, and its rank; a connection that does not, or claims a rank already claimed, is dropped
without a word, so a process that reaches the port cannot make rank 0 give up on a living rank. The port listens
on the one address rank 0's store does.
"""

from __future__ import annotations

import hmac
import logging
import selectors
import socket
import time

logger = logging.getLogger("megatron_serve.weights")

_READ = b"read"
#: The longest line a connection may say (its hello: ``<prefix> <rank>``) before it is dropped.
_LINE_MAX = 128


class RollCall:
    """Rank 0's side: the port the other ranks attend on (``port``), and the wait for them (:meth:`wait`)."""

    def __init__(self, host: str, prefix: str, world_size: int) -> None:
        self.prefix, self.world_size = prefix, world_size
        # every other rank connects early and is accepted only once the outcome is published: the backlog holds them
        self._listener = socket.create_server((host, 0), backlog=max(world_size, 16))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]

    def wait(self, deadline: float) -> dict[int, str]:
        """Until each other rank read the outcome or is gone (its connection closed), or ``deadline``
        (``time.monotonic()``); returns each rank's ending: ``"read"``, ``"gone"`` or ``"missing"`` (still there,
        or never came, at the deadline). Logs the ranks that did not read."""
        endings: dict[int, str] = {}
        said: dict[socket.socket, bytes] = {}  # what each open connection said that is not a whole line yet
        ranks: dict[socket.socket, int] = {}  # the open connections that said who they are
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            try:
                while len(endings) < self.world_size - 1 and (left := deadline - time.monotonic()) > 0:
                    for key, _ in selector.select(left):
                        if key.fileobj is self._listener:
                            self._accept(selector, said)
                        elif not self._hear(key.fileobj, said, ranks, endings):
                            selector.unregister(key.fileobj)
                            del said[key.fileobj]
                            ranks.pop(key.fileobj, None)
                            key.fileobj.close()
            finally:
                for conn in said:
                    conn.close()
        for rank in range(1, self.world_size):
            ending = endings.setdefault(rank, "missing")
            if ending != "read":
                logger.warning("trainer rank %d did not read the refit's outcome: %s", rank,
                               "its process is gone" if ending == "gone" else "not done by the deadline")
        return endings

    def _accept(self, selector: selectors.BaseSelector, said: dict[socket.socket, bytes]) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        said[conn] = b""
        selector.register(conn, selectors.EVENT_READ)

    def _hear(self, conn: socket.socket, said: dict[socket.socket, bytes], ranks: dict[socket.socket, int],
              endings: dict[int, str]) -> bool:
        """Take what one connection said (its hello, then ``read``) or its end (a rank whose process is gone);
        whether to keep listening to it."""
        try:
            data = conn.recv(_LINE_MAX)
        except BlockingIOError:
            return True
        except OSError:  # reset: its process is gone too
            data = b""
        if not data:
            if conn in ranks:
                endings.setdefault(ranks[conn], "gone")
            return False
        said[conn] += data
        while b"\n" in said[conn]:
            line, _, said[conn] = said[conn].partition(b"\n")
            if conn in ranks:
                if line == _READ:
                    endings[ranks[conn]] = "read"
                return False  # nothing else is said on it
            rank = self._rank_of(line, endings, ranks)
            if rank is None:
                return False
            ranks[conn] = rank
        return len(said[conn]) < _LINE_MAX

    def _rank_of(self, hello: bytes, endings: dict[int, str], ranks: dict[socket.socket, int]) -> int | None:
        """The rank a hello names, when it carries this transfer's prefix and names a rank nobody claimed yet."""
        prefix, _, rank = hello.partition(b" ")
        if not hmac.compare_digest(prefix, self.prefix.encode()) or not rank.isdigit():
            return None
        number = int(rank)
        taken = number in endings or number in ranks.values()
        return number if 0 < number < self.world_size and not taken else None

    def close(self) -> None:
        self._listener.close()


def attend(host: str, port: int, prefix: str, rank: int, timeout: float) -> socket.socket:
    """Another rank's side: connect to rank 0's roll call and say who this is; :func:`read` once the outcome is
    read (closing the connection instead, or this process ending, tells rank 0 that this rank is gone)."""
    conn = socket.create_connection((host, port), timeout=timeout)
    conn.sendall(f"{prefix} {rank}\n".encode())
    return conn


def read(conn: socket.socket) -> None:
    """Tell rank 0 this rank read the outcome, and hang up."""
    try:
        conn.sendall(_READ + b"\n")
    except OSError:  # rank 0 is gone: nobody waits for it
        pass
    finally:
        conn.close()
