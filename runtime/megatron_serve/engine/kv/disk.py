"""The node's disk tier of the KV cache (``--kv-offloading-backend disk``): blocks the host tier lets go, in files
that every engine of the node reads.

The host tier (:mod:`.offload`) spills its least recently used block here instead of dropping it, and goes on
looking here where its own prefix stops; what it finds is read into a host slot and copied to the device as a host
hit is. The directory is shared: engine B finds the blocks engine A wrote, so a node computes a prefix once.

Sharing is only safe if a file can never be taken for another block. A file's path is
``<dir>/<layout>/e<epoch>/<hash>.kv``: ``layout`` digests the model (its checkpoint's path and its tensors' names,
shapes and dtypes) and the pool's block shape and dtype, ``epoch`` is the weights' refit epoch and ``hash`` the
block's chained hash, whose root already holds the request's cache salt, its adapter registration and the epoch
(:mod:`megatron_serve.wire.prefix_hash`). A refit therefore makes every earlier file unreachable without touching it;
the size bound removes them in time. Every file repeats its key in a header and carries a checksum of its bytes: a
file that is short, torn, of another key or corrupt is never served, it is removed and its block recomputed.

Engines are separate processes, so nothing here is held in memory between them: a file appears whole or not at all
(written to a temporary name, then renamed), its modification time is its last use (a read touches it), and the
directory's total size and file count are kept in a ledger file under an ``flock`` (the count for the metrics). When the
ledger goes over the bound, the engine holding the lock measures the directory and removes the least recently used files
down to 90% of it: a scan per tenth of the bound written, not per block. A file removed while another engine reads it
stays readable through the open handle (POSIX), and one removed before the open is a miss.

The engine runs these file operations on threads of its own (:mod:`.disk_io`), so everything here may run off the
step thread: the lock is a thread lock as well as an ``flock`` (an ``flock`` excludes other processes, not other
threads of this one), and what the KV events should say is left as notices that :meth:`DiskKVTier.announce` hands
to the event log on the step thread (the log is the step thread's).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import msgspec
import torch

from ...processes.pids import process_exists
from ...wire.kv_events import MEDIUM_DISK
from .events import BlockOrigin, KVEventLog

logger = logging.getLogger("megatron_serve.engine")

MAGIC = b"MSKVDSK1"
#: magic, block hash, epoch, layout digest, origin length, payload length, checksum of origin and payload
HEADER = struct.Struct("<8sQq16sIQ16s")
SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
LEDGER, LOCK = ".usage", ".lock"
STALE_TEMP_S = 60.0  # a temporary file this old belongs to a writer that died: the scan removes it
EVICT_TO = 0.9  # an over-full directory is trimmed to this share of its bound


class _Origin(msgspec.Struct, array_like=True):
    parent: int | None
    tokens: list[int]
    lora: tuple[int, str] | None


class Found(NamedTuple):
    """A block read back from disk, with what its writer knew of it (its chain parent, tokens and adapter)."""

    origin: BlockOrigin | None


def layout_key(model_identity: str, block_tensors: list[torch.Tensor]) -> bytes:
    """16 bytes naming what a block's bytes mean: the model (``model_identity``) and each host slot's shape and
    dtype."""
    digest = hashlib.blake2b(model_identity.encode("utf-8"), digest_size=16, person=b"kv_disk_layout")
    for tensor in block_tensors:
        digest.update(f"{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.digest()


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous slot row as a flat byte view (its dtype aside: a copy is a copy)."""
    return tensor.view(torch.uint8).reshape(-1)


class DiskKVTier:
    """Complete KV blocks in files under ``directory``, shared by the engines of a node (see the module docstring).

    ``capacity_bytes`` bounds the directory as a whole (every engine's files); ``layout`` is :func:`layout_key`;
    ``epoch`` returns the weights' epoch now (-1, a mix of two generations, writes and finds nothing)."""

    def __init__(self, directory: str | Path, capacity_bytes: int, layout: bytes, block_bytes: int,
                 epoch: Callable[[], int] = lambda: 0, events: KVEventLog | None = None):
        self.root = Path(directory)
        self.capacity_bytes = int(capacity_bytes)
        if self.capacity_bytes < block_bytes + HEADER.size:
            raise ValueError(f"kv_disk_size holds no KV block: one takes {block_bytes + HEADER.size} bytes, "
                             f"{self.capacity_bytes} were given")
        self.layout = layout
        self.block_bytes = block_bytes
        self.epoch = epoch
        self.events = events
        self._notices: deque[tuple[bool, int, BlockOrigin | None]] = deque()  # (stored?, hash, origin) for the log
        self.home = self.root / layout.hex()
        self.home.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        self._thread_lock = threading.Lock()
        self._scan_every = max(1, self.capacity_bytes // 10)
        self._written_since_scan = 0
        self.written = self.hits = self.misses = self.corrupt = self.evicted = 0
        self.bytes_written = self.bytes_read = 0  # this engine's file I/O (the metrics' kv_disk_io_bytes)
        with self._locked():
            self._trim(force=True, starting=True)  # the ledger starts from what is there (a writer may have died)

    def close(self) -> None:
        os.close(self._lock_fd)

    def path(self, block_hash: int, epoch: int) -> Path:
        return self.home / f"e{epoch}" / f"{block_hash:016x}{SUFFIX}"

    def has(self, block_hash: int) -> bool:
        """Whether a file of ``block_hash`` is there now, under the current epoch (a lookup: its bytes are checked
        when it is read)."""
        epoch = self.epoch()
        found = epoch >= 0 and self.path(block_hash, epoch).exists()
        if not found:
            self.misses += 1
        return found

    def announce(self) -> None:
        """Tell the event log what the file operations since the last call stored and removed (step thread)."""
        notices, events = self._notices, self.events
        while notices:
            stored, block_hash, origin = notices.popleft()
            if events is None:
                continue
            if stored:
                events.stored(MEDIUM_DISK, block_hash, origin)
            else:
                events.removed(MEDIUM_DISK, [block_hash])

    def _notice(self, stored: bool, block_hashes: list[int], origin: BlockOrigin | None = None) -> None:
        if self.events is not None:
            self._notices.extend((stored, block_hash, origin) for block_hash in block_hashes)

    def write(self, block_hash: int, slot: list[torch.Tensor], origin: BlockOrigin | None,
              epoch: int | None = None) -> bool:
        """Store one block (``slot``: its host rows, :meth:`HostKVTier` order) under ``epoch`` (None: the current
        one, which the caller should read when the block leaves memory: a refit may come before the write); False
        when the epoch is a mix. An existing file of the same key is replaced: its bytes are the same block's."""
        epoch = self.epoch() if epoch is None else epoch
        if epoch < 0:
            return False
        target = self.path(block_hash, epoch)
        target.parent.mkdir(parents=True, exist_ok=True)
        meta = b"" if origin is None else msgspec.msgpack.encode(_Origin(origin.parent, list(origin.tokens),
                                                                          origin.lora))
        payload = [_raw_bytes(t).numpy() for t in slot]
        checksum = hashlib.blake2b(meta, digest_size=16)
        for part in payload:
            checksum.update(part)
        length = sum(part.nbytes for part in payload)
        temporary = target.with_name(f"{TEMP_PREFIX}{os.getpid()}-{target.name}")
        try:
            with open(temporary, "wb") as file:
                file.write(HEADER.pack(MAGIC, block_hash, epoch, self.layout, len(meta), length, checksum.digest()))
                file.write(meta)
                for part in payload:
                    file.write(part.data)
            os.replace(temporary, target)  # whole or not at all, for every reader
        except BaseException:
            self._unlink(temporary)  # a full disk (ENOSPC) left it in part: nobody else would remove it
            raise
        size = HEADER.size + len(meta) + length
        self.written += 1
        self.bytes_written += size
        self._notice(True, [block_hash], origin)  # the other tiers may have forgotten it by the announce
        self._account(size)
        return True

    def read(self, block_hash: int, slot: list[torch.Tensor], epoch: int | None = None) -> Found | None:
        """Read a block of ``epoch`` (None: the current one) into ``slot`` (its host rows); None when no sound file
        holds it (a bad one is removed)."""
        epoch = self.epoch() if epoch is None else epoch
        if epoch < 0:
            return None
        path = self.path(block_hash, epoch)
        try:
            with open(path, "rb") as file:
                data = bytearray(os.fstat(file.fileno()).st_size)  # writable: the tensors below view it
                del data[file.readinto(data):]  # a file cut short since the stat: what was read (no copy)
        except FileNotFoundError:
            self.misses += 1
            return None
        self.bytes_read += len(data)
        expected = sum(t.numel() * t.element_size() for t in slot)
        origin = self._check(data, block_hash, epoch, expected)
        if origin is False:
            self.corrupt += 1
            logger.warning("KV disk tier: %s is truncated or corrupt; removed, its block is recomputed", path)
            self._remove(path, len(data))
            return None
        offset = len(data) - expected  # the payload ends the file
        for target in slot:
            flat = _raw_bytes(target)
            flat.copy_(torch.frombuffer(data, dtype=torch.uint8, count=flat.numel(), offset=offset))
            offset += flat.numel()
        try:
            os.utime(path)  # its last use, for the least-recently-used order of every engine
        except FileNotFoundError:
            pass  # removed by another engine since the read: the bytes read are whole and checked
        self.hits += 1
        self._notice(True, [block_hash], origin)
        return Found(origin)

    def _check(self, data: bytearray, block_hash: int, epoch: int, expected: int) -> BlockOrigin | None | bool:
        """The origin a sound file says (None: its writer did not know it); False when the file is not sound."""
        if len(data) < HEADER.size:
            return False
        magic, stored_hash, stored_epoch, layout, meta_len, length, checksum = HEADER.unpack_from(data)
        if (magic != MAGIC or stored_hash != block_hash or stored_epoch != epoch or layout != self.layout
                or length != expected or len(data) != HEADER.size + meta_len + length):
            return False
        body = memoryview(data)[HEADER.size:]
        if hashlib.blake2b(body, digest_size=16).digest() != checksum:
            return False
        if not meta_len:
            return None
        try:
            meta = msgspec.msgpack.decode(body[:meta_len], type=_Origin)
        except msgspec.DecodeError:
            return False
        return BlockOrigin(meta.parent, tuple(meta.tokens), meta.lora)

    def forget(self) -> None:
        """Remove this layout's files of the current epoch (a prefix-cache reset: their KV is not to be trusted)."""
        removed = []
        epoch_dir = self.home / f"e{self.epoch()}"
        with self._locked():
            for entry in _entries(epoch_dir):
                removed.append(_hash_of(entry.name))
                self._unlink(entry.path)
            self._trim(force=True)
        self._notice(False, [h for h in removed if h is not None])

    def usage(self) -> tuple[int, int]:
        """The bytes and the number of block files in the directory, every engine's, as the shared ledger says
        (read without the lock: a gauge for the metrics, exact again at the next scan)."""
        return self._read_ledger()

    def _remove(self, path: Path, size: int) -> None:
        with self._locked():
            if self._unlink(str(path)):
                self._ledger(-size, -1)

    def _account(self, size: int) -> None:
        """Add a written file to the ledger; trim the directory when it went over its bound."""
        self._written_since_scan += size
        with self._locked():
            total, _files = self._ledger(size, 1)
            if total > self.capacity_bytes or self._written_since_scan >= self._scan_every:
                self._trim(force=total > self.capacity_bytes)

    def _trim(self, force: bool, starting: bool = False) -> None:
        """Measure the directory (lock held), set the ledger to it and, over the bound (``force``: check it), remove
        the least recently used files down to :data:`EVICT_TO` of it, and temporary files left by dead writers (of a
        process that is gone, or older than :data:`STALE_TEMP_S`; ``starting``: this process's own too, left by an
        earlier process of the same id)."""
        self._written_since_scan = 0
        files, total, now = [], 0, time.time()
        for layout_dir in _dirs(self.root):
            for epoch_dir in _dirs(layout_dir):
                for entry in os.scandir(epoch_dir):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(TEMP_PREFIX):
                        if now - stat.st_mtime > STALE_TEMP_S or _orphaned(entry.name, starting):
                            self._unlink(entry.path)
                        continue
                    if entry.name.endswith(SUFFIX):
                        files.append((stat.st_mtime, stat.st_size, entry.path))
                        total += stat.st_size
        removed = 0
        if force and total > self.capacity_bytes:
            files.sort()
            gone: list[int] = []
            mine = str(self.home)
            for _mtime, size, path in files:
                if total <= self.capacity_bytes * EVICT_TO:
                    break
                if self._unlink(path):
                    total -= size
                    removed += 1
                    self.evicted += 1
                    if path.startswith(mine) and (block_hash := _hash_of(os.path.basename(path))) is not None:
                        gone.append(block_hash)
            self._notice(False, gone)
        self._set_ledger(total, len(files) - removed)

    def _ledger(self, delta: int, files_delta: int) -> tuple[int, int]:
        total, files = self._read_ledger()
        total, files = max(0, total + delta), max(0, files + files_delta)
        self._set_ledger(total, files)
        return total, files

    def _read_ledger(self) -> tuple[int, int]:
        """The ledger: the directory's bytes, then its block files (8 bytes each, little-endian)."""
        data = os.pread(self._lock_fd, 16, 0)
        total = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
        return total, int.from_bytes(data[8:16], "little") if len(data) == 16 else 0

    def _set_ledger(self, total: int, files: int) -> None:
        os.pwrite(self._lock_fd, total.to_bytes(8, "little") + files.to_bytes(8, "little"), 0)

    def _locked(self) -> "_Flock":
        return _Flock(self._lock_fd, self._thread_lock)

    @staticmethod
    def _unlink(path: str | Path) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False  # another engine removed it first


class _Flock:
    """The directory's lock, across the node's engines (``flock`` on the lock file, which also holds the ledger) and
    the threads of this one (``thread_lock``)."""

    def __init__(self, fd: int, thread_lock: threading.Lock):
        self.fd = fd
        self.thread_lock = thread_lock

    def __enter__(self) -> None:
        self.thread_lock.acquire()
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.thread_lock.release()


def _dirs(path: Path | str) -> Iterator[str]:
    try:
        with os.scandir(path) as entries:
            yield from (entry.path for entry in entries if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return


def _entries(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return [entry for entry in entries if entry.name.endswith(SUFFIX)]
    except FileNotFoundError:
        return []


def _orphaned(name: str, starting: bool) -> bool:
    """Whether the temporary file ``name`` (``.tmp-<pid>-<hash>.kv``) was left by a writer that is gone: its process
    no longer exists, or it is this process's own while it starts (its id reused)."""
    try:
        pid = int(name.removeprefix(TEMP_PREFIX).split("-", 1)[0])
    except ValueError:
        return False
    return (starting and pid == os.getpid()) or not process_exists(pid)


def _hash_of(name: str) -> int | None:
    try:
        return int(name.removesuffix(SUFFIX), 16)
    except ValueError:
        return None
