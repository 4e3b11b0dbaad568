"""Structured outputs: one grammar matcher per constrained request, and the batched token mask of a step.

The grammar engine is llguidance (Rust, from PyPI, CPU only). Chosen over xgrammar because:

* it has no dependencies (a 3 MB wheel), where xgrammar requires torch, transformers, triton
  (~1 GB on disk on Linux x86-64) and apache-tvm-ffi in the runtime image;
* it compiles nothing ahead: a JSON schema, regex or grammar becomes a matcher in about a
  millisecond and masks are computed lazily (llguidance reports ~50 us per mask on a 128k
  vocabulary, p99 0.5 ms), so arbitrary per-request schemas cost no compile latency or cache;
* it reads vLLM's ``guided_grammar`` as GBNF/EBNF (``root ::= ...``) or Lark, has the broadest JSON
  Schema coverage, and fills the masks of a whole batch on its own threads without the GIL.

Matchers live next to the engine's other per-request state and are rebuilt from
``generated_tokens`` whenever a request (re-)enters an engine, so a preempted, recomputed or
moved request continues in the same grammar state. The tokenizer's vocabulary is read from the
Hugging Face tokenizer files through llguidance's own converter, once per engine, on first use.

End of output: when the grammar is complete the mask allows the request's own stop tokens (and
only those); when no further token can extend it, the request finishes at once with ``stop``.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

import torch

from ..grammar import grammar_for
from ..wire.sampling_params import StructuredOutputsParams
from ..tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class StructuredOutputs:
    """The matchers of the constrained requests of one engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}  # request id -> llguidance.LLMatcher

    @cached_property
    def _ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (~1 s for a 128k vocabulary, so built once, when first needed)."""
        import llguidance.hf  # noqa: PLC0415

        return llguidance.hf.from_tokenizer(self._tokenizer.hf_tokenizer, n_vocab=self.vocab_size,
                                            eos_token=list(self._tokenizer.eos_token_ids) or None)

    @cached_property
    def _executor(self) -> Any:
        import llguidance  # noqa: PLC0415

        return llguidance.LLExecutor()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, spec: StructuredOutputsParams, generated_tokens: list[int]) -> str | None:
        """Start a matcher, advanced over the tokens already generated; returns why it cannot, or None."""
        import llguidance  # noqa: PLC0415

        try:
            grammar = grammar_for(spec)
            tokenizer = self._ll_tokenizer
        except (ValueError, TypeError) as exc:
            return f"structured_outputs: {exc}"
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"structured_outputs: {matcher.get_error().strip()}"
        if not generated_tokens and matcher.is_stopped():
            return "structured_outputs: the constraint allows no output"
        if generated_tokens and not matcher.consume_tokens(list(generated_tokens)):
            return f"structured_outputs: the tokens generated so far do not fit the grammar: {matcher.get_error()}"
        self._matchers[request_id] = matcher
        return None

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def clear(self) -> None:
        self._matchers.clear()

    def accept(self, request_id: str, token: int) -> tuple[bool, str | None]:
        """Advance over a sampled token: ``(grammar complete, error)``; complete means nothing may follow."""
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token):
            return False, f"structured_outputs: token {token} does not fit the grammar: {matcher.get_error()}"
        return matcher.is_stopped(), None

    def bitmask(self, request_ids: list[str], stop_token_ids: list[frozenset[int]]) -> torch.Tensor | None:
        """The allowed tokens of each row (``request_ids``) as an int32 bitmask, or None when no row is constrained.

        Unconstrained rows allow every token. One parallel fill for the constrained ones (llguidance's
        executor, without the GIL). Each row's end-of-sequence bits are then set to its own stop tokens:
        allowed where the grammar is complete, forbidden everywhere else. A complete grammar with nothing
        left to allow (a request with ``ignore_eos``) allows EOS, which the grammar consumes and then stops.
        """
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._matchers]
        if not rows:
            return None
        import llguidance.torch  # noqa: PLC0415

        words = (self.vocab_size + 31) // 32
        # Pinned where a GPU takes it: a copy from pageable memory would wait for the forward queued before it.
        bitmask = torch.full((len(request_ids), words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        matchers = [self._matchers[request_ids[row]] for row in rows]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, list(zip(matchers, rows)), bitmask)
        view = bitmask.numpy().view("uint32")
        eos = [t for t in self._ll_tokenizer.eos_tokens if t < self.vocab_size]
        for row, matcher in zip(rows, matchers):
            for token in eos:
                view[row, token >> 5] &= ~(1 << (token & 31)) & 0xFFFFFFFF
            allowed = list(stop_token_ids[row]) if matcher.is_accepting() else []
            if not view[row].any() and not allowed:
                allowed = eos  # the grammar is complete and the request has no stop token of its own (ignore_eos)
            for token in allowed:
                if token < self.vocab_size:
                    view[row, token >> 5] |= 1 << (token & 31)
        return bitmask
