"""The disk tier's file I/O off the engine's step thread: a writer and a reader thread over :class:`~.disk.DiskKVTier`.

A step that spilled a block or admitted a prefix found on disk used to write or read the files itself, so every
request in the batch waited for the disk (a block of Llama-3.1-8B at 64 tokens is 8 MiB). Here the step only hands
work over:

* a spill copies the block's bytes into one of ``depth`` staging rows (the host slot is reused at once) and queues
  the write; with every staging row taken, the spill is dropped and counted (``dropped``): the block is recomputed
  if it is asked for again, and the step never waits for the disk. The queue holds a burst: a long prompt that
  enters the device pool pushes as many blocks out of the host tier in one step (:func:`write_depth`). The file is published by its rename, whole
  (:meth:`~.disk.DiskKVTier.write`), so a reader of another engine never sees it in part;
* a read fills a host slot that the caller keeps out of use until the read's future is done.

A full filesystem (``ENOSPC``, or a quota's ``EDQUOT``) turns writing off: the failed write removes its temporary
file, one warning says so, and spills are dropped (counted in ``dropped``) until the filesystem has room for
:data:`ROOM_BLOCKS` blocks again, looked at once a second at most; another line says when writing resumes. Other
write and read errors log one line per :data:`LOG_EVERY_S` with the count since the last. Before, each failed write of
a full disk left its temporary file (6,609 in 2 minutes, past a restart) and logged a warning (12,957).

Reads and writes have a thread each, so that a prefix a request waits for is not queued behind writes nobody waits
for. The executors' threads are joined at interpreter exit after the work queued (``concurrent.futures``), so an
engine process that ends leaves its queued blocks written for the next one.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from .disk import DiskKVTier, Found
from .events import BlockOrigin

logger = logging.getLogger("megatron_serve.engine")

WRITE_QUEUE_BYTES = 256 * 2**20  # the staging rows of the blocks queued for writing, at most
#: Errors that mean the filesystem is full: writing stops until it has room again.
FULL = (errno.ENOSPC, errno.EDQUOT)
#: Free room, in blocks, that turns writing on again after a full filesystem.
ROOM_BLOCKS = 8
#: Seconds between two looks at the free room while writing is off.
ROOM_CHECK_S = 1.0
#: Seconds between two log lines of the same kind of failed file operation.
LOG_EVERY_S = 60.0


class RateLimitedLog:
    """One warning per ``every`` seconds, with how many failures it stands for."""

    def __init__(self, what: str, every: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.every = every
        self.clock = clock
        self.last = -float("inf")
        self.unlogged = 0

    def __call__(self, error: OSError) -> None:
        self.unlogged += 1
        now = self.clock()
        if now - self.last >= self.every:
            logger.warning("KV disk tier: %d block(s) not %s in the last %.0f s (last: %s); the blocks are recomputed",
                           self.unlogged, self.what, min(now - self.last, self.every), error)
            self.last, self.unlogged = now, 0


def write_depth(block_bytes: int, host_slots: int) -> int:
    """How many spills may wait for the writer: as many as the host tier can let go at once (every slot), within
    :data:`WRITE_QUEUE_BYTES` (pages of a staging row never used are never touched: no memory)."""
    return max(1, min(host_slots, WRITE_QUEUE_BYTES // block_bytes))


class DiskIO:
    """Writes and reads of ``disk``'s files on two threads (see the module docstring); ``rows``: one host slot's
    tensors, the shape of a staging row."""

    def __init__(self, disk: DiskKVTier, rows: list[torch.Tensor], depth: int):
        self.disk = disk
        self._staging = [torch.empty((depth, *row.shape), dtype=row.dtype) for row in rows]
        self._spare: queue.SimpleQueue[int] = queue.SimpleQueue()  # staging rows free for a spill
        for index in range(depth):
            self._spare.put(index)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self.dropped = 0  # spills dropped: every staging row was queued, or the filesystem is full
        self.write_errors = self.read_errors = 0  # file operations the OS refused (the block is recomputed)
        self.full = False  # the filesystem was full at the last write: spills are dropped until it has room
        self._room_checked = 0.0
        self._write_log, self._read_log = RateLimitedLog("written"), RateLimitedLog("read")

    def spill(self, block_hash: int, rows: list[torch.Tensor], origin: BlockOrigin | None, epoch: int) -> Future | None:
        """Copy a block out of ``rows`` and queue its write under ``epoch``; None when the queue or the filesystem is
        full (dropped)."""
        if self.full and not self._room_again():
            self.dropped += 1
            return None
        try:
            index = self._spare.get_nowait()
        except queue.Empty:
            self.dropped += 1
            return None
        staged = [buffer[index] for buffer in self._staging]
        for target, source in zip(staged, rows):
            target.copy_(source)
        return self._writer.submit(self._write, index, block_hash, staged, origin, epoch)

    def _write(self, index: int, block_hash: int, staged: list[torch.Tensor], origin: BlockOrigin | None,
               epoch: int) -> None:
        try:
            if not self.full:  # queued before the filesystem filled: dropped with the rest
                self.disk.write(block_hash, staged, origin, epoch)
        except OSError as error:  # a full or failing disk costs the block, not the engine
            self.write_errors += 1
            if error.errno in FULL:
                self.full, self._room_checked = True, time.monotonic()
                logger.warning("KV disk tier: the filesystem of %s is full (%s): writing stops until it has room for "
                               "%d blocks again", self.disk.root, error, ROOM_BLOCKS)
            else:
                self._write_log(error)
        finally:
            self._spare.put(index)

    def _room_again(self) -> bool:
        """Whether the full filesystem has room again (looked at once per :data:`ROOM_CHECK_S`): writing resumes."""
        now = time.monotonic()
        if now - self._room_checked < ROOM_CHECK_S:
            return False
        self._room_checked = now
        try:
            stat = os.statvfs(self.disk.root)
        except OSError:
            return False
        if stat.f_bavail * stat.f_frsize < ROOM_BLOCKS * self.disk.block_bytes:
            return False
        self.full = False
        logger.warning("KV disk tier: the filesystem of %s has room again: writing resumes", self.disk.root)
        return True

    def read(self, block_hash: int, rows: list[torch.Tensor], epoch: int) -> Future:
        """Start reading a block of ``epoch`` into ``rows``; the future holds its :class:`~.disk.Found`, or None."""
        return self._reader.submit(self._read, block_hash, rows, epoch)

    def _read(self, block_hash: int, rows: list[torch.Tensor], epoch: int) -> Found | None:
        try:
            return self.disk.read(block_hash, rows, epoch)
        except OSError as error:  # unreadable: a miss, recomputed
            self.read_errors += 1
            self._read_log(error)
            return None

    def to_wire(self) -> dict[str, int]:
        """The disk tier's counts for the engine's heartbeat (:data:`~megatron_serve.wire.engine_stats.KV_DISK`):
        this engine's since it started, and the directory's usage, every engine's. Read on the step thread while the
        threads count: each figure is an int, whole, at worst one operation behind."""
        disk = self.disk
        usage_bytes, files = disk.usage()
        return {"written": disk.written, "hits": disk.hits, "misses": disk.misses, "corrupt": disk.corrupt,
                "evicted": disk.evicted, "dropped": self.dropped, "read_errors": self.read_errors,
                "write_errors": self.write_errors, "read_bytes": disk.bytes_read, "write_bytes": disk.bytes_written,
                "usage_bytes": usage_bytes, "files": files}

    def flush(self) -> None:
        """Wait until every write queued so far is done (a reset removes files; a test reads what was written)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes and reads and stop both threads."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
