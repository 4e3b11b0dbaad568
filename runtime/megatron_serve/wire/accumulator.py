"""What a request's token deltas carried so far: the one accumulation of the output path.

Engines send ids and what was asked to go with them, step by step (``deltas.RequestDelta``), and leave
those fields out of the final record (``request.FinalRecord``). Two places keep them, with this one code:
the coordinator's mirror of each request (a request that moves continues from it; a client that
reconnects gets what it missed from it; ``coordinator.requests.RequestRecord``) and the client's
collector, which completes the result from it (``client.output_processor.OutputCollector``). They used
to do the same job in two codes, with two spellings of the rule for unreported epochs.
"""

from __future__ import annotations

import logging

import msgspec

from .expert_routing import RoutingRecord, mirror_rows
from .deltas import PromptScores, TokenDelta

logger = logging.getLogger(__name__)


class DeltaAccumulator:
    """One request's ids and, per id, its log prob, top-n, epochs and expert rows; and its prompt facts.

    ``tokens`` may begin with ids that came without the rest (a client's resubmission carries its
    tokens only): :attr:`resumed` counts them, and the per-token lists cover the ids after them.
    """

    __slots__ = ("tokens", "resumed", "log_probs", "top_ids", "top_log_probs", "top_p_token_ids", "_epochs",
                 "cached_tokens", "prompt_scores", "routing", "stop_token")

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = list(tokens or ())
        self.resumed = len(self.tokens)
        self.log_probs: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_log_probs: list[list[float]] = []
        self.top_p_token_ids: list[list[int]] = []  # return_top_p_token_ids: the ids kept at each token
        # Each id's policy, KV and adapter epochs, one after the other: one list to extend per delta (the client
        # collects a delta per stream and step, and each list is one more object to fetch from memory)
        self._epochs: list[int] = []
        self.cached_tokens: int | None = None  # prompt tokens found in the prefix cache, once reported
        self.prompt_scores: PromptScores | None = None  # the first engine's (a next one scores them again)
        self.routing: RoutingRecord | None = None
        self.stop_token = False  # the last id is the stop id that ended the request (TokenDelta.stop_token)

    @property
    def policy_epochs(self) -> list[int]:
        """Each id's policy (weights) epoch; -1 where an engine did not report one."""
        return self._epochs[0::3]

    @property
    def kv_epochs(self) -> list[int]:
        """Each id's KV epoch; -1 where an engine did not report one."""
        return self._epochs[1::3]

    @property
    def lora_epochs(self) -> list[int]:
        """Each id's adapter version; -1 for the base model, or where none was reported."""
        return self._epochs[2::3]

    def add(self, delta: TokenDelta, request_id: str) -> None:
        """Keep all of ``delta``."""
        self.tokens.extend(delta.new_tokens)
        self.add_rest(delta, len(delta.new_tokens), request_id)

    def plain_lists(self) -> tuple[list[int], list[int]]:
        """The ids and their epochs (each id's policy, KV and adapter epochs, one after the other): a plain stream's
        collector appends a delta of one id and its epochs to them itself (``client.output_processor``), so that its
        token reads no accumulator. Both lists stay these objects."""
        return self.tokens, self._epochs

    def add_rest(self, delta: TokenDelta, kept: int, request_id: str) -> None:
        """Keep what goes with ``delta``'s first ``kept`` ids, which the caller appended to :attr:`tokens`
        itself (the client stops at a stop string, token by token).

        A delta of ids and epochs alone (what a plain completion's steps carry) is kept without the checks
        of the rest: the coordinator mirrors one per request per engine step, and the client collects one.
        Engines report epochs with every token: checked without a generator per delta, ``add`` of a one-token
        delta with epochs takes 0.29 us instead of 0.64 (in-process, CPU time).
        """
        if (delta.new_log_probs is None and delta.top_ids is None and delta.top_p_token_ids is None
                and delta.routing is None
                and delta.cached_tokens is None and delta.prompt_scores is None and not delta.stop_token):
            epochs = delta.epochs
            if kept == 1 and epochs is not None and len(epochs) == 3:  # most deltas: one id and its three epochs
                policy, kv, lora = epochs
                if len(policy) == len(kv) == len(lora) == len(delta.new_tokens) == 1:
                    self._epochs += (policy[0], kv[0], lora[0])
                    return
            self._add_epochs(epochs, len(delta.new_tokens), kept)
            return
        if delta.stop_token and kept == len(delta.new_tokens):
            self.stop_token = True
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens
        if delta.prompt_scores is not None and self.prompt_scores is None:
            self.prompt_scores = delta.prompt_scores
        if delta.new_log_probs:
            self.log_probs.extend(delta.new_log_probs[:kept])
        if delta.top_ids is not None and delta.top_log_probs is not None:
            self.top_ids.extend(delta.top_ids[:kept])
            self.top_log_probs.extend(delta.top_log_probs[:kept])
        if delta.top_p_token_ids is not None:
            self.top_p_token_ids.extend(delta.top_p_token_ids[:kept])
        self._add_epochs(delta.epochs, len(delta.new_tokens), kept)
        if delta.routing is not None:
            try:
                self.routing = mirror_rows(self.routing, msgspec.structs.asdict(delta.routing))
            except ValueError as exc:  # kept out, never fatal: a next engine recomputes those rows
                logger.warning("request %s: expert rows not kept: %s", request_id, exc)

    def _add_epochs(self, epochs: list[list[int]] | None, n: int, kept: int) -> None:
        """The epochs of the first ``kept`` of ``n`` new ids: ``[policy, KV]`` or ``[policy, KV, LoRA]``, each of
        ``n``; -1 for what was not reported (no epochs, or lists of another length)."""
        if epochs is not None and 2 <= len(epochs) <= 3:
            policy, kv = epochs[0], epochs[1]
            lora = epochs[2] if len(epochs) == 3 else None
            if len(policy) == n and len(kv) == n and (lora is None or len(lora) == n):
                self._epochs += [e for each in zip(policy[:kept], kv[:kept], [-1] * kept if lora is None else lora)
                                 for e in each]
                return
        self._epochs += [-1] * (3 * kept)
