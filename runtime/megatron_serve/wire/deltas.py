"""The output path's bodies: what one engine step added to each request (``ENGINE_STEP``), and the same deltas
forwarded to a client (``STEP_TOKENS``), with the one cut a catch-up needs (:func:`delta_past`); docs/wire-protocol.md.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .body import Body, ClientId, TokenId


class RoutingRows(Body):
    """Routing replay: the expert-routing rows of a request's positions ``start, start + 1, ...``
    (``expert_routing``: ``shape`` [rows, MoE layers, top_k], ``dtype`` uint8/uint16, ``data`` the raw ids)."""

    start: Annotated[int, msgspec.Meta(ge=0)]
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    dtype: str
    data: bytes


class PromptScores(Body):
    """``return_prompt_log_probs``: the log probs of prompt tokens 1.. and, with ``top_n_logprobs``, the
    n most likely tokens at each of those positions, as parallel lists; ``ranks``: each prompt token's rank at its
    position (1 = the most likely; vLLM reports it for every prompt token, in the top n or not)."""

    log_probs: list[float]
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    ranks: list[int] | None = None


class TokenDelta(Body):
    """What one engine step added to one request: its new token ids and, when asked, what goes with them.

    Only ids travel: the text is made where it is read (the client side,
    :mod:`megatron_serve.client.output_processor`), which keeps detokenization and stop strings off the
    engine's step thread. Top-n log probs are parallel lists (``top_ids[i]`` and
    ``top_log_probs[i]`` for new token ``i``), not a map per token.
    """

    new_tokens: list[TokenId]
    new_log_probs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    top_p_token_ids: list[list[int]] | None = None  # return_top_p_token_ids: the ids kept at each new token
    epochs: list[list[int]] | None = None  # [policy epochs, KV epochs, LoRA adapter versions] of the new tokens
    routing: RoutingRows | None = None  # return_routing_indices: the rows processed since the last delta
    # With the request's first tokens (an engine that stops at the first token sends them with none):
    cached_tokens: int | None = None  # prompt tokens its engine found in the prefix cache
    prompt_scores: PromptScores | None = None  # return_prompt_log_probs
    # The last of new_tokens is the stop id that ended the request (EOS or stop_token_ids): it stays in the ids,
    # counted and with its log prob, and the text is made without it unless include_stop_str_in_output (vLLM's)
    stop_token: bool = False


class RequestDelta(TokenDelta, kw_only=True):
    """One request's share of an engine step (a finished one's final record travels beside it: :class:`EngineStep`).

    (Not the engine's ``megatron_serve.engine.StepOutput``, the in-process result this is built from.)"""

    request_id: str
    finished: bool


class ClientShare(Body):
    """One client's part of an engine step (protocol 11), built by the engine: ``frame`` is a whole ``STEP_TOKENS``
    message (:class:`StepTokens`, each delta a :class:`RequestDelta` with new tokens and none of routing rows, prompt
    scores or kept ids) for the requests ``request_ids``, in order, of which ``finished`` ended in this step (their
    final records are in the step's ``records``). The coordinator checks the ids against the requests it gave the
    engine for that client and forwards ``frame`` unread."""

    client_id: str
    request_ids: list[str]
    frame: bytes
    finished: list[str] = []


class EngineStep(Body):
    engine_id: str
    # Each item decoded on its own, so that one unreadable output does not lose the others.
    outputs: list[msgspec.Raw]
    # The final records (``wire.request.FinalRecord``, without what travelled in deltas; maybe nil) of the requests
    # whose delta here is finished, by request id: apart from the deltas, so that the coordinator forwards both as
    # the engine's bytes (each delta in ``STEP_TOKENS``, each record in ``RESULT``) and reads only a record's status.
    records: dict[str, msgspec.Raw] = {}
    # The request ids of the first ``len(plain_ids)`` outputs, in order, each a plain delta (:func:`is_plain`): the
    # coordinator files and forwards those without decoding any (protocol 9; absent, every output is read).
    plain_ids: list[str] = []
    # Each client's share of the step's deltas besides ``outputs`` (protocol 11), forwarded whole.
    shares: list[ClientShare] = []


def is_plain(delta: RequestDelta) -> bool:
    """A delta whose passage through the coordinator reads nothing but its request id: new tokens, the request not
    finished, and none of the fields the coordinator reads at once (routing rows, prompt scores, kept ids)."""
    return bool(delta.new_tokens) and not delta.finished and delta.routing is None and delta.prompt_scores is None \
        and delta.top_p_token_ids is None


def is_shared(delta: RequestDelta) -> bool:
    """A delta that may travel in its client's share of a step (:class:`ClientShare`): a plain one
    (:func:`is_plain`), or the same finishing its request (the coordinator learns that from the share's
    ``finished``)."""
    return bool(delta.new_tokens) and delta.routing is None and delta.prompt_scores is None \
        and delta.top_p_token_ids is None


class EngineStepOut(Body):
    """:class:`EngineStep` as an engine writes it: every request's delta of one step and the final records of those
    that finished, one message (``records`` typed ``Any`` here because ``wire.request`` builds on this module)."""

    engine_id: str
    outputs: list[RequestDelta]
    records: dict[str, Any] = {}
    plain_ids: list[str] = []
    shares: list[ClientShare] = []


class StepTokens(Body):
    """The token message (protocol 6: the only one): the deltas one engine step made for the requests of one client,
    ``deltas[i]`` for its request ``client_request_ids[i]``.

    The coordinator forwards each delta as the engine encoded it (a ``RequestDelta``, whose engine-side fields
    a client ignores) and only decodes it to keep its mirror of the request's tokens: no message to build
    and encode per request and step.

    ``starts`` is set on catch-ups only (what a reconnected or resubmitting client lacked, from the coordinator's
    mirror): ``starts[i]`` is the index of ``deltas[i]``'s first token in its request's generated tokens. The count
    the coordinator went by is old by the time the catch-up arrives (the steps it forwarded since reach the client
    first, and the catch-up repeats them), so the client keeps only what lies past the tokens it has
    (:func:`delta_past`).
    """

    client_request_ids: list[ClientId]
    deltas: list[TokenDelta]
    starts: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None

    def __post_init__(self) -> None:
        if len(self.client_request_ids) != len(self.deltas):
            raise ValueError(f"{len(self.client_request_ids)} client_request_ids for {len(self.deltas)} deltas")
        if self.starts is not None and len(self.starts) != len(self.deltas):
            raise ValueError(f"{len(self.starts)} starts for {len(self.deltas)} deltas")


def delta_past(delta: TokenDelta, start: int, have: int) -> TokenDelta | None:
    """A catch-up ``delta`` whose first token is generated token ``start``, without the tokens before index ``have``
    (a client's count when it arrives); None when it brings nothing new. Per-token lists end with the tokens (they
    may cover only the last ones: a resubmission's own tokens came without them) and are cut alike."""
    if have <= start:
        return delta
    drop = have - start
    count = len(delta.new_tokens)
    if drop >= count:
        return None

    def cut(values: list[Any]) -> list[Any]:
        return values[max(drop - (count - len(values)), 0):]

    def cut_some(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else cut(values)

    epochs = None if delta.epochs is None else [cut(e) for e in delta.epochs]
    return msgspec.structs.replace(delta, new_tokens=delta.new_tokens[drop:], epochs=epochs,
                                   new_log_probs=cut_some(delta.new_log_probs), top_ids=cut_some(delta.top_ids),
                                   top_log_probs=cut_some(delta.top_log_probs),
                                   top_p_token_ids=cut_some(delta.top_p_token_ids))


def delta_array(deltas: list[msgspec.Raw]) -> bytes:
    """Encoded deltas as one msgpack array of them (decoded in one call: ``Decoder(list[TokenDelta])``)."""
    return b"\xdd" + len(deltas).to_bytes(4, "big") + b"".join(deltas)


class StepTokensOut(Body):
    """:class:`StepTokens` as the coordinator writes it: the engine's deltas spliced in as they came."""

    client_request_ids: list[ClientId]
    deltas: list[msgspec.Raw]
    starts: list[int] | None = None
