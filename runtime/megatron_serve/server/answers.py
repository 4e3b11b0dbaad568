"""From finished engine requests to the parts of an answer that both endpoints share.

Finish reasons, usage, and the bookkeeping of a streamed choice are the same for
``/v1/completions`` and ``/v1/chat/completions``; only the objects they go into differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..client.outputs import StreamPartial
from ..wire.request import DynamicInferenceRequest
from .chunks import ChunkWriter, TextChunks
from .models import Usage
from .translate import EngineJob


def token_label(token: int) -> str:
    """How vLLM names a token in a log-prob listing when asked for ids instead of text
    (``return_tokens_as_token_ids``): an RL trainer reads ids back exactly, text may not round-trip."""
    return f"token_id:{token}"


def finish_reason(result: DynamicInferenceRequest) -> str | None:
    """The finish reason of a finished request: OpenAI's ``stop`` and ``length``, and vLLM's ``abort``
    for a request the fleet ended early (PAUSE in abort mode: the partial answer, to resubmit)."""
    reason = result.finish_reason.value if result.finish_reason is not None else None
    return reason if reason in ("stop", "length", "abort") else None


def cached_prompt_tokens(finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt like ``usage.prompt_tokens``.

    With ``n > 1`` each choice of a prompt is its own engine request with its own count; the count
    of the prompt's first choice (lowest choice index, submitted first) is the one reported: it says
    whether the prompt was already cached when the request arrived, while its siblings may also hit
    the blocks that this very request computed.
    """
    first: dict[int, tuple[int, int]] = {}  # prompt index -> (choice index, cached tokens)
    for job, result in finished:
        known = first.get(job.prompt_index)
        if known is None or job.index < known[0]:
            first[job.prompt_index] = (job.index, min(int(result.cached_tokens or 0), len(job.prompt.tokens)))
    return sum(cached for _, cached in first.values())


def running_usage(req: Any, prompt_tokens: int, choices: StreamedChoices) -> Callable[[], Usage] | None:
    """What makes the usage so far that every chunk carries with ``stream_options.continuous_usage_stats``
    (vLLM's; it needs ``include_usage`` too); None without it (the chunks then ask nothing)."""
    options = req.stream_options
    if options is None or not (options.include_usage and options.continuous_usage_stats):
        return None

    def usage() -> Usage:
        generated = choices.generated()
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)

    return usage


def make_usage(prompt_tokens: int, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> Usage:
    return Usage.model_validate(usage_fields(prompt_tokens, finished))


def usage_fields(prompt_tokens: int, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> dict[str, Any]:
    """:func:`make_usage` as plain data, its fields in the model's order (a stream's last chunk encodes it as the
    model would, without a model to build and serialize per request)."""
    completion_tokens = sum(len(r.generated_tokens) for _, r in finished)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_prompt_tokens(finished)}}


#: One token's alternatives as (id, log prob) pairs: a finished record's map's items, or a piece's parallel lists
#: zipped where they are rendered (read once).
TopPairs = Iterable[tuple[int, float]]


def zipped(ids: Sequence[list[int]], log_probs: Sequence[list[float]]) -> list[TopPairs]:
    """Each token's alternatives from top-n's parallel lists, as pairs (nothing built: read once, by a listing)."""
    return list(map(zip, ids, log_probs))


def paired(maps: list[dict[int, float]]) -> list[TopPairs]:
    """Each token's alternatives from a finished record's maps, as pairs."""
    return [top.items() for top in maps]


@dataclass
class Delta:
    """What one chunk of a streamed choice adds: its text, and the tokens (with log-probs) it lists.

    ``token_texts`` are the listed tokens' texts (what each adds to the choice's text), made by the
    client's output processor with the text itself; a token is listed only once all of its text has
    been sent, so listings never run ahead of the text.
    """

    text: str
    tokens: Sequence[int]
    log_probs: Sequence[float]
    top_n: list[TopPairs]
    token_texts: list[str]

    @classmethod
    def empty(cls) -> "Delta":
        """A final record's share of its chunk: the pieces carried all of the text and listing."""
        return cls("", [], [], [], [])


class StreamedChoices:
    """Which choices of a streamed answer have begun, and how many tokens they generated: each chunk is rendered
    from its piece alone.

    The client's output processor makes the text and each token's text once, and its pieces carry
    all of both (its last piece, at the end, what it held back: a possible stop string's start, and
    the listing of the tokens that held it); the final record adds nothing to them and is never
    compared with what was streamed. ``token_texts`` (log probs asked for): a piece lists the tokens of its
    listing (``StreamPartial.listed_tokens``, which may lag its tokens); without, every token as it comes
    (``return_token_ids``).
    """

    def __init__(self, token_texts: bool = False) -> None:
        self.token_texts = token_texts
        self._seen: set[int] = set()
        self._generated = 0

    def generated(self) -> int:
        """Tokens generated so far, all choices together (the running usage of ``continuous_usage_stats``)."""
        return self._generated

    def first_seen(self, index: int) -> bool:
        """True once per choice, for its first item (when its opening chunk is due)."""
        if index in self._seen:
            return False
        self._seen.add(index)
        return True

    def piece(self, item: StreamPartial) -> Delta:
        """A streamed piece, counted as sent."""
        self._generated += len(item.new_tokens)
        if self.token_texts:
            return Delta(item.new_text or "", item.listed_tokens, item.listed_log_probs,
                         zipped(item.listed_top_ids, item.listed_top_log_probs), item.token_texts)
        return Delta(item.new_text or "", item.new_tokens, item.new_log_probs,
                     zipped(item.new_top_ids, item.new_top_log_probs), item.token_texts)


class StreamedAnswer:
    """What both endpoints' streamed answers keep (their choices so far, the finished requests) and how they end:
    a usage chunk with ``stream_options.include_usage``. Every chunk comes from its ``writer``; subclasses make the
    chunks of the items that are not later plain pieces (:meth:`whole_item`)."""

    def __init__(self, handler: Any, kind: str, text_choice: Callable[[int, str], dict[str, Any]], token_texts: bool,
                 prompt_tokens: int) -> None:
        """``handler``: the request's (its ``id``, ``created`` and ``req``); ``kind`` and ``text_choice``: its chunks'
        ``object`` and plain text choice (:class:`~.chunks.ChunkWriter`); ``prompt_tokens``: the answer's prompt
        tokens, as its usage counts them."""
        req = self.req = handler.req
        self.choices = StreamedChoices(token_texts)
        self.results: list[tuple[EngineJob, DynamicInferenceRequest]] = []
        self._prompt_tokens = prompt_tokens
        usage = running_usage(req, prompt_tokens, self.choices)
        self.writer = ChunkWriter(handler.id, kind, handler.created, req.model, text_choice, usage)
        self._text = self.writer.text  # bound once: the plain pieces' path is most of a stream's work
        # Choices whose pieces are text alone (no log probs, token ids or running usage; in a chat, no tool calls to
        # read): a subclass marks each after its first piece, and the later pieces' chunks are the writer's plain
        # text chunks (ChunkWriter.text), without the choices' bookkeeping (which serves only the others)
        self.plain = not (token_texts or req.return_token_ids or usage is not None)
        self.texted: set[int] = set()  # by id(job): finding whether a job is plain reads nothing of the job

    def item(self, job: EngineJob, item: Any) -> bytes:
        """The events of one arrived item: a plain text piece's from the writer's :meth:`~.chunks.ChunkWriter.text`,
        any other's from the subclass (:meth:`whole_item`), which marks the plain choices with their first piece."""
        if id(job) in self.texted and type(item) is StreamPartial:
            return self._text(job.index, item.new_text) if item.new_text else b""
        return self.whole_item(job, item)

    def text_chunks(self, job: EngineJob) -> TextChunks | None:
        """What makes the events of a plain choice's later pieces from their text alone, as :meth:`item` makes them;
        None before the choice's first piece, or for a choice that is not plain."""
        return self.writer.text_chunks(job.index) if id(job) in self.texted else None

    def whole_item(self, job: EngineJob, item: Any) -> bytes:
        """The events of an item that is not a later piece of a plain choice (the subclass's chunks)."""
        raise NotImplementedError

    def end(self) -> bytes:
        """The events after the last item: the usage chunk, when asked for."""
        options = self.req.stream_options
        if options is not None and options.include_usage:
            return self.writer.chunk([], usage=usage_fields(self._prompt_tokens, self.results))
        return b""
