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
Hugging Face tokenizer files through llguidance's own converter, once per engine, on a thread of its
own at engine start (:meth:`StructuredOutputs.warm`): built by the first constrained request, it stopped the
step, and every request in it, for as long as it took. The masks are filled through llguidance's numpy
binding, not ``llguidance.torch``: that module compiles a kernel with ``torch.compile`` when imported,
which pulls in ``torch._dynamo`` (4-6 s in a fresh process), for a function this engine does not use.

End of output: when the grammar is complete the mask allows the request's own stop tokens (and
only those); when no further token can extend it, the request finishes at once with ``stop``.

Speculation (``engine.speculative``): a request's drafts are cut at the first one its grammar does not
accept (:meth:`StructuredOutputs.draft_prefix`, before the step is scheduled, so no row is spent on a
guess the grammar forbids), and a verify step gets one mask per verified position
(:meth:`StructuredOutputs.bitmask` with ``drafts``): the matcher is advanced through the drafts, each
position's mask filled in the state the plain engine fills it in once the tokens before it were
accepted, then rolled back (llguidance's ``rollback``), so the matcher only ever advances over the tokens
the step emits. Cost: one mask fill per verified position, the same as the plain engine's per token.
"""

from __future__ import annotations

import logging
import threading
from functools import cached_property
from typing import Any

import torch

from ...grammar import grammar_for
from ...wire.sampling_params import StructuredOutputsParams
from ...tokenizer import Vocabulary

logger = logging.getLogger(__name__)


class StructuredOutputs:
    """The matchers of the constrained requests of one engine."""

    def __init__(self, tokenizer: Vocabulary, vocab_size: int, pin_memory: bool = False):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory  # the engine runs on a GPU
        self._matchers: dict[str, Any] = {}  # request id -> llguidance.LLMatcher

    @cached_property
    def _ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once, when first needed), from the tokenizer's JSON as
        ``llguidance.hf.from_tokenizer`` makes it, without that module's ``transformers`` import."""
        import llguidance  # noqa: PLC0415

        return llguidance.LLTokenizer(self._tokenizer.grammar_json(), n_vocab=self.vocab_size,
                                      eos_token=list(self._tokenizer.eos_token_ids) or None)

    @cached_property
    def _executor(self) -> Any:
        import llguidance  # noqa: PLC0415

        return llguidance.LLExecutor()

    def warm(self) -> threading.Thread:
        """Load llguidance and build the vocabulary view, the executor and one matcher's first mask on a thread of
        its own, off the step, so that the first constrained request finds them ready; returns the thread. A
        constrained request that comes sooner waits for the part still being built (``cached_property``'s lock).

        Not a daemon: the interpreter joins it before it finalizes. A daemon thread still inside llguidance or
        torch when a short script ended crashed the process at exit (SIGSEGV, or SIGABRT from a C++ thread
        destroyed while running); the join costs a script at most the warm-up's own time."""
        thread = threading.Thread(target=self._warm, name="megatron-serve-grammar-warmup", daemon=False)
        thread.start()
        return thread

    def _warm(self) -> None:
        import llguidance  # noqa: PLC0415

        try:
            matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar_for(StructuredOutputsParams(regex="a")),
                                           log_level=0)
            mask = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            fill_par(self._executor, [(matcher, 0)], mask.numpy())
        except ValueError as exc:  # the tokenizer cannot serve grammars (no tokenizer.json): said once, no traceback
            logger.info("structured outputs are not available: %s", exc)
        except Exception:  # noqa: BLE001 - a first constrained request meets the same problem and reports it
            logger.exception("warming the grammar engine failed")

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

    def draft_prefix(self, request_id: str, drafts: list[int], stop_token_ids: frozenset[int]) -> int:
        """How many of ``drafts`` (in order) the request's grammar accepts: all for an unconstrained request. A
        stop or end-of-sequence token ends the count (it would end the request, not extend it: the mask allows
        only the request's own stop tokens where the grammar is complete, and never the grammar's EOS)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return len(drafts)
        ends = stop_token_ids.union(self._ll_tokenizer.eos_tokens)
        count = next((i for i, token in enumerate(drafts) if token in ends), len(drafts))
        return matcher.validate_tokens(drafts[:count]) if count else 0

    def bitmask(self, request_ids: list[str], stop_token_ids: list[frozenset[int]],
                drafts: list[list[int]] | None = None) -> torch.Tensor | None:
        """The allowed tokens of each row (``request_ids``) as an int32 bitmask, or None when no row is constrained.

        Unconstrained rows allow every token. One parallel fill for the constrained ones (llguidance's
        executor, without the GIL). Each row's end-of-sequence bits are then set to its own stop tokens:
        allowed where the grammar is complete, forbidden everywhere else. A complete grammar with nothing
        left to allow (a request with ``ignore_eos``) allows EOS, which the grammar consumes and then stops.

        ``drafts``: each request's speculative guesses (a verify step). Then the mask has a row per verified
        position, in the verify step's logits order: first one per request for the position after all its
        drafts, then, request by request, one per draft for the position of that draft (the state after the
        drafts before it). Each is filled depth by depth with the matcher advanced over the drafts before it,
        then rolled back. Drafts the grammar does not accept (cut by :meth:`draft_prefix` before the step, so
        never expected here) leave the positions from there on allowing nothing.
        """
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._matchers]
        if not rows:
            return None
        drafts = drafts if drafts is not None else [[] for _ in request_ids]
        offsets, total = [], len(request_ids)
        for guesses in drafts:
            offsets.append(total)
            total += len(guesses)

        def row_of(i: int, depth: int) -> int:
            return offsets[i] + depth if depth < len(drafts[i]) else i

        # Pinned where a GPU takes it: a copy from pageable memory would wait for the forward queued before it.
        bitmask = torch.full((total, (self.vocab_size + 31) // 32), -1, dtype=torch.int32,
                             pin_memory=self.pin_memory)
        walks = []  # (request row, its matcher, how many of its drafts it walks through)
        for i in rows:
            valid = self.draft_prefix(request_ids[i], drafts[i], stop_token_ids[i]) if drafts[i] else 0
            for depth in range(valid + 1, len(drafts[i]) + 1):  # past a refused draft: never reached
                bitmask[row_of(i, depth)] = 0
            walks.append((i, self._matchers[request_ids[i]], valid))
        for depth in range(max(valid for *_, valid in walks) + 1):
            at_depth = [walk for walk in walks if depth <= walk[2]]
            self._fill(bitmask, [(matcher, row_of(i, depth), stop_token_ids[i]) for i, matcher, _ in at_depth])
            for i, matcher, valid in at_depth:
                if depth < valid:
                    matcher.consume_token(drafts[i][depth])  # validated by draft_prefix
        for _i, matcher, valid in walks:
            if valid:
                matcher.rollback(valid)
        return bitmask

    def _fill(self, bitmask: torch.Tensor, targets: list[tuple[Any, int, frozenset[int]]]) -> None:
        """Fill row ``row`` of ``bitmask`` from ``matcher``'s current state, for each ``(matcher, row, stop
        tokens)``, in one parallel call; then set each row's end-of-sequence bits (see :meth:`bitmask`)."""
        fill_par(self._executor, [(m, row) for m, row, _ in targets], bitmask.numpy())
        view = bitmask.numpy().view("uint32")
        eos = [t for t in self._ll_tokenizer.eos_tokens if t < self.vocab_size]
        for matcher, row, stop_token_ids in targets:
            for token in eos:
                view[row, token >> 5] &= ~(1 << (token & 31)) & 0xFFFFFFFF
            allowed = list(stop_token_ids) if matcher.is_accepting() else []
            if not view[row].any() and not allowed:
                allowed = eos  # the grammar is complete and the request has no stop token of its own (ignore_eos)
            for token in allowed:
                if token < self.vocab_size:
                    view[row, token >> 5] |= 1 << (token & 31)


def fill_par(executor: Any, targets: list[tuple[Any, int]], bitmask: Any) -> None:
    """llguidance's parallel mask fill into ``bitmask`` (a C-contiguous int32 numpy array, rows of the vocabulary's
    bits), without the GIL: ``llguidance.numpy``'s, which imports no ``torch._dynamo`` (see the module docstring)."""
    import llguidance.numpy  # noqa: PLC0415

    llguidance.numpy.fill_next_token_bitmask_par(executor, targets, bitmask)
