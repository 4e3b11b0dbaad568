"""Routing replay: the experts every processed token of a request was routed to, recorded once.

RL trainers replay the rollout's routing so that training sees the experts inference chose. A
request that asks (``SamplingParams.return_routing_indices``) gets ``routing_indices``: a
``[tokens, moe_layers, top_k]`` array of expert ids, row ``i`` for token ``i`` of prompt plus
generation, experts in router order (most probable first). Every token the model processed has a
row; the last generated token has none when generation stopped at its length limit (it was sampled,
never processed).

Rows are written once per position and never again: recomputation after a preemption, a suspend or
a move to another engine (which starts from the rows the coordinator mirrored) skips the positions
already recorded, so floating-point noise of a differently shaped batch can never change a recorded
choice, and nothing is recorded twice. The engine keeps a position count and the rows not delivered yet
(:class:`RoutingCapture`): each step output carries the rows recorded since the one before, and the readers
keep them all (:class:`RoutingRecord`). Such requests never read the prefix cache (the rows of
cached blocks were computed by another request, or not recorded at all); they still publish their
blocks to it.

On the wire the rows are one bytes field (uint8 ids up to 256 experts, else uint16) with its shape:
as nested integer lists they are about as many bytes, but packing them is twenty times slower and
unpacking them (on every hop) builds tens of MB of Python objects (docs/design-measurements.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence as SequenceType

if TYPE_CHECKING:  # this module travels with the request record into torch-free processes (client, coordinator)
    import numpy as np

# numpy is imported where rows are made or read, not with this module: a coordinator, a `control` command or a
# client that never meets routing rows does without it (a tenth of a CPU-second per process, 40% of `control`'s
# imports)
DTYPES = ("uint8", "uint16")


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned type that holds every expert id."""
    import numpy as np  # noqa: PLC0415 - see DTYPES

    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


class RoutingRows:
    """One request's rows by position, appended as the steps compute them: ``count`` positions so far, and the rows
    not yet taken. Its two kinds differ in what they keep: a :class:`RoutingRecord` every row, a
    :class:`RoutingCapture` only those its next output takes."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype, count: int = 0) -> None:
        self.shape = (num_layers, top_k)
        self.dtype = dtype
        self.count = count
        self._chunks: list[np.ndarray] = []

    def record(self, start: int, rows: np.ndarray) -> None:
        """Rows of positions ``start, start + 1, ...``; positions already recorded keep their first rows, and a gap
        before ``start`` is a bug (``RuntimeError``)."""
        if start > self.count:
            raise RuntimeError(f"routing of position {start} computed before position {self.count}")
        fresh = rows[self.count - start:]
        if len(fresh):
            self._chunks.append(fresh.astype(self.dtype, copy=True))
            self.count += len(fresh)


class RoutingRecord(RoutingRows):
    """Every row of one request so far, as its readers keep them (the coordinator's mirror, the client's collector,
    the expert API's adapter)."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype, recorded: np.ndarray | None = None):
        super().__init__(num_layers, top_k, dtype)
        if recorded is not None and len(recorded):
            if recorded.shape[1:] != self.shape:
                raise ValueError(f"routing_indices of shape {recorded.shape} do not fit this model's "
                                 f"{num_layers} MoE layers x top-{top_k}")
            self._chunks.append(recorded.astype(dtype, copy=False))
            self.count = len(recorded)

    def array(self) -> np.ndarray:
        """Every recorded row, ``[count, layers, top_k]``."""
        import numpy as np  # noqa: PLC0415 - see DTYPES

        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0] if self._chunks else np.empty((0, *self.shape), dtype=self.dtype)


class RoutingCapture(RoutingRows):
    """One request's rows on the engine: how many positions are recorded (a continuation's first count is the rows
    it brings), and the rows recorded since the last output, which that output takes. Nothing delivered stays: the
    readers of the outputs keep the rows (the coordinator's mirror and the client's collector, a
    :class:`RoutingRecord` each; the expert API's adapter for a public request)."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype, recorded: int = 0):
        super().__init__(num_layers, top_k, dtype, count=recorded)
        self.delivered = recorded

    def take_undelivered(self) -> tuple[int, np.ndarray] | None:
        """``(first position, rows)`` recorded since the last call, or None; they are not kept."""
        if self.delivered == self.count:
            return None
        import numpy as np  # noqa: PLC0415 - see DTYPES

        start, self.delivered = self.delivered, self.count
        chunks, self._chunks = self._chunks, []
        return start, chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def record_step(entries: SequenceType[tuple[Any, int, int, int]], rows: np.ndarray) -> dict[int, np.ndarray]:
    """Hand one step's rows ``[step tokens, layers, top_k]`` to the sequences that record them.

    ``entries``: ``(sequence, first position, token count, drafts)`` in the step's row order. The last
    ``drafts`` rows of an entry are speculative guesses (engine.speculative), not verified yet: they are
    not recorded but returned, by ``id(sequence)``, for the engine to record each once its guess is
    accepted (a rejected guess's row is never a position's routing).
    """
    offset = 0
    held: dict[int, np.ndarray] = {}
    for sequence, start, count, drafts in entries:
        if sequence.routing is not None:
            sequence.routing.record(start, rows[offset:offset + count - drafts])
            if drafts:
                held[id(sequence)] = rows[offset + count - drafts:offset + count]
        offset += count
    return held


def routing_to_wire(rows: np.ndarray) -> dict[str, Any]:
    return {"shape": list(rows.shape), "dtype": rows.dtype.name, "data": rows.tobytes()}


def mirror_rows(mirror: RoutingRecord | None, wire: dict[str, Any]) -> RoutingRecord:
    """The coordinator's copy of a request's rows, extended by one step's ``{"start", ...wire form}``.

    ``ValueError`` on a malformed or out-of-order delivery.
    """
    rows = routing_from_wire(wire)
    start = wire.get("start")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"routing start must be a non-negative integer, got {start!r}")
    if mirror is None:
        mirror = RoutingRecord(rows.shape[1], rows.shape[2], rows.dtype)
    if start > mirror.count or rows.shape[1:] != mirror.shape:
        raise ValueError(f"routing rows {rows.shape} from position {start} do not continue the {mirror.count} "
                         f"rows of shape {mirror.shape} recorded")
    mirror.record(start, rows)
    return mirror


def routing_from_wire(data: Any) -> np.ndarray:
    """Parse the wire form; ``ValueError`` naming what is wrong."""
    import numpy as np  # noqa: PLC0415 - see DTYPES

    if not isinstance(data, dict):
        raise ValueError(f"routing_indices must be a map with shape, dtype and data, got {type(data).__name__}")
    shape, dtype, payload = data.get("shape"), data.get("dtype"), data.get("data")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ValueError(f"routing_indices shape must be three non-negative integers, got {shape!r}")
    if dtype not in DTYPES:
        raise ValueError(f"routing_indices dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    np_dtype = np.dtype(dtype)
    if not isinstance(payload, bytes) or len(payload) != shape[0] * shape[1] * shape[2] * np_dtype.itemsize:
        raise ValueError(f"routing_indices data does not hold {shape} {dtype} values")
    return np.frombuffer(payload, dtype=np_dtype).reshape(shape)
