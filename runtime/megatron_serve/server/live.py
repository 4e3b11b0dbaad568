"""The submissions this server is answering, found by the ids their clients saw, so that a control route can end
some of them: vLLM's ``POST /abort_requests {request_ids}`` and SGLang's ``POST /abort_request {rid}``.

A client knows a request by the id of its answer (``cmpl-...``, ``chatcmpl-...``) or by the id it gave (vLLM's
``request_id`` or ``X-Request-Id``, which the answer's id carries after its prefix, as vLLM names it); either one
finds it. Entries are weak: a submission answered and dropped leaves by itself, and an abort of an id that is not
live (finished, or never seen) finds nothing, as vLLM's does.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .generation import Submission

#: The prefixes of this server's answer ids; the rest is the client's own id, when it gave one.
_PREFIXES = ("chatcmpl-", "cmpl-")


def names_of(label: str) -> tuple[str, ...]:
    """The ids that find a submission labelled ``label``: the label, and the client's id inside it."""
    for prefix in _PREFIXES:
        if label.startswith(prefix) and len(label) > len(prefix):
            return label, label[len(prefix):]
    return (label,)


class LiveSubmissions:
    """Submissions by the ids that name them, held weakly (see the module docstring)."""

    def __init__(self) -> None:
        self._held: weakref.WeakValueDictionary[int, Submission] = weakref.WeakValueDictionary()

    def add(self, submission: Submission) -> None:
        self._held[id(submission)] = submission

    def named(self, ids: Iterable[str]) -> list[Submission]:
        """The live submissions that any of ``ids`` names."""
        wanted = set(ids)
        return [s for s in list(self._held.values()) if s.unfinished and wanted.intersection(names_of(s.label))]

    def unfinished(self) -> list[Submission]:
        """Every live submission with engine requests still running."""
        return [s for s in list(self._held.values()) if s.unfinished]
