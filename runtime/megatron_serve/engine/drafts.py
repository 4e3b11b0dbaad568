"""Drafts as data, what the plain engine knows of speculation: a request's draft tokens sit at the end of its
``token_ids``, counted by ``num_drafts`` (not scheduled yet) and ``drafts_in_flight`` (in a step launched, not read),
and a step's rows come back as one :class:`~.steps.Emitted` each, with the number of drafts accepted. The scheduler
schedules a request's ``1 + drafts`` tokens as query rows, and when a step is read rolls the rejected ones back by
these counts (:func:`roll_back`, :func:`restore`); the worker marks them in flight at launch (:func:`mark_in_flight`).
Who proposes and verifies drafts is :mod:`.speculative`'s, behind the worker's and the engine's hooks.
"""

from __future__ import annotations

from .kv.blocks import SequenceBlocks
from .kv.cache import blocks_for_tokens
from .sequence import Sequence


def mark_in_flight(sampling: list[Sequence], counts: list[int]) -> None:
    """A verify step was launched for ``sampling`` (``counts``: each request's drafts): its drafts are now in
    flight (the next step may draft after them), and its next input is the draw after its last draft (planned
    as if all were accepted; the next step's rows are corrected on the device by the step's ``shifts``)."""
    row = 0
    for index, (sequence, drafts) in enumerate(zip(sampling, counts)):
        row += drafts
        sequence.pending_tokens += 1
        sequence.pending_row = row
        sequence.verify_row = index
        sequence.drafts_in_flight += drafts
        sequence.num_drafts = 0
        row += 1


def roll_back(sequence: Sequence, drafts: int, accepted: int, blocks: SequenceBlocks) -> list[int]:
    """Take a read step's ``drafts`` drafts (``accepted`` of them accepted) back out of ``sequence`` and keep
    the KV of the accepted ones; blocks past what it computed (plus the one token to come) return to the
    pool. Returns the drafts of the step launched after it, taken off the end of ``token_ids`` too, so that
    the read step's tokens are appended before them (:func:`restore` puts them back). A request preempted
    meanwhile computed nothing that is kept: only its tokens change."""
    if not sequence.drafts_in_flight:
        return []
    later = sequence.drafts_in_flight - drafts
    tokens = sequence.token_ids
    kept = tokens[len(tokens) - later:] if later else []
    del tokens[len(tokens) - later - drafts:]
    sequence.drafts_in_flight = 0
    if drafts and sequence.block_table:
        sequence.num_computed -= drafts - accepted
        keep = blocks_for_tokens(sequence.num_computed + 1, blocks.block_size)
        if len(sequence.block_table) > keep:
            blocks.allocator.free(sequence.block_table[keep:])
            del sequence.block_table[keep:]
    return kept


def restore(sequence: Sequence, later: list[int]) -> None:
    """Put back the drafts of a step still in flight that :func:`roll_back` took off."""
    sequence.token_ids.extend(later)
    sequence.drafts_in_flight = len(later)
