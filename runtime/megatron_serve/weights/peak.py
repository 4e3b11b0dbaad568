"""How far a process's memory rose over a stretch of work: its peak, measured by the kernel.

A refit must never make a process hold a full tensor it does not serve (issue 50), and only the kernel sees every
byte a process holds (torch's allocations, gloo's buffers alike). Linux keeps the high-water mark of a process's
resident set (``VmHWM`` in ``/proc/self/status``) and resets it to the current size on a write of ``5`` to
``/proc/self/clear_refs``: :func:`start_peak` does that and notes the sizes, :func:`peak_since` reads how far above
them the mark went. What it counts is growth: memory the process already held (freed earlier but kept by the C
allocator, which returns it to the kernel only when asked) is reused without a rise. ``trim=True`` asks first
(``malloc_trim``), so that the rise counts all that the work held; it costs the work fresh pages (a refit's staging
of tensors below glibc's mapping threshold, 32 MiB, then faults its pages in instead of reusing the heap, which
slows the receive measurably), so an engine does not trim (its staging of large tensors is mapped fresh anyway, and
counted); a test's trainer does. Pages of mapped files (the libraries' code, faulted in the
first time a transfer runs a path of theirs) are no copy of any tensor: what the file-backed part of the resident
set grew by is subtracted. (A tensor held as a view of a mapped file is not counted either: the trainers of the
tests read their pieces into memory.)

The reset is the process's own (its ``ru_maxrss`` follows it), so only processes that own their memory figures
call it: an engine around a refit's receive, staging and load. Elsewhere (no ``/proc``, a kernel that refuses the
write) both return None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from dataclasses import dataclass

_STATUS, _CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"


def _status_kib(*fields: str) -> list[int]:
    with open(_STATUS) as status:
        text = status.read()
    out = []
    for field in fields:
        found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
        if found is None:
            raise OSError(f"{_STATUS} has no {field}")
        out.append(int(found[1]) * 1024)
    return out


def _trim() -> None:
    """Hand the memory the C allocator keeps free back to the kernel (glibc; nothing elsewhere)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class Baseline:
    resident: int
    file_backed: int


def start_peak(trim: bool = False) -> Baseline | None:
    """Reset this process's resident-memory high-water mark to its size now (``trim``: after returning freed memory
    to the kernel); returns the sizes now (None where the kernel does not offer them)."""
    try:
        if trim:
            _trim()
        with open(_CLEAR_REFS, "w") as clear:
            clear.write("5")
        resident, file_backed = _status_kib("VmRSS", "RssFile")
    except OSError:
        return None
    return Baseline(resident, file_backed)


def peak_since(baseline: Baseline | None) -> int | None:
    """Bytes by which the resident set rose at its highest since :func:`start_peak` returned ``baseline``, less
    what mapped files added."""
    if baseline is None:
        return None
    try:
        high, file_backed = _status_kib("VmHWM", "RssFile")
    except OSError:
        return None
    return max(0, high - baseline.resident - max(0, file_backed - baseline.file_backed))
