"""What generation hands back, whichever engine client ran it: streamed pieces, then the finished request.

A stream yields :class:`StreamPartial` items as engine steps add tokens, then the final
:class:`~megatron_serve.wire.request.DynamicInferenceRequest` (the one record of the request, see
:mod:`megatron_serve.wire.request`). The in-process engine and the coordinator client produce the same
items, so ``MegatronAsyncLLM`` and the HTTP server never ask which one they talk to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..wire.request import DynamicInferenceRequest


@dataclass(slots=True)
class StreamPartial:
    """One streamed piece of a request: the tokens (and text) an engine step added (one per stream and step: slots).

    Top-n log probs stay parallel lists, as the deltas carry them (``new_top_ids[i]`` and ``new_top_log_probs[i]``
    for new token ``i``), until whoever shows them renders them (:attr:`new_top_logprobs` as maps)."""

    request_id: str
    new_tokens: list[int]
    new_text: str
    new_log_probs: list[float] = field(default_factory=list)
    # Fields most pieces leave empty default to one shared empty tuple (a list each per piece cost a plain stream's
    # pieces a tenth more CPU time); the collector sets lists.
    new_top_ids: Sequence[list[int]] = ()  # per new token, when asked for
    new_top_log_probs: Sequence[list[float]] = ()
    # With return_log_probs, the listing: the next tokens a log-prob listing may show (all of their text was sent, by
    # this piece or before), continuing where the stream's earlier pieces left off: their texts, ids, log probs and
    # top-n. A listing may lag the tokens (their text held back: a possible stop string, an unfinished character).
    token_texts: list[str] = field(default_factory=list)
    listed_tokens: Sequence[int] = ()
    listed_log_probs: Sequence[float] = ()
    listed_top_ids: Sequence[list[int]] = ()
    listed_top_log_probs: Sequence[list[float]] = ()
    finished: bool = False  # partials never finish; the final item is the DynamicInferenceRequest

    @property
    def new_top_logprobs(self) -> list[dict[int, float]]:
        """The new tokens' top-n as one map each (id to log prob), for readers that show them so."""
        return [dict(zip(ids, log_probs)) for ids, log_probs in zip(self.new_top_ids, self.new_top_log_probs)]


#: One item of a stream.
StreamItem = StreamPartial | DynamicInferenceRequest
