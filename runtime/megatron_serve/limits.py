"""What one HTTP request may carry: the front door's limits and the request budget, their defaults and why.

Every limit answers before the expensive step it protects: the body size before the body is
read, prompt characters before tokenization, ``n``, stop strings, ``logit_bias`` entries and
messages before anything is rendered or submitted. Without them one anonymous request could
occupy the server for a minute, tokenized on the event loop, with ``/health`` silent meanwhile:
Kubernetes restarts such a pod. The figures behind each default: docs/design-measurements.md.

This module is light (no FastAPI, no torch) so that the commands can build their flags from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from .wire.sampling_fields import MAX_TOP_N_LOGPROBS, SUBSET_FILTERS
from .wire.sampling_params import SamplingParams

MiB = 1 << 20

#: Seconds an HTTP connection may stay idle between two requests (``--timeout-keep-alive``). Longer than the idle
#: time after which the clients and proxies in front of a server stop reusing a connection: a server that closes
#: first races a request sent on the connection it is closing (a reset, or a 502 from the proxy). httpx (and so
#: the ``openai`` package) lets idle connections go after 5 s, aiohttp after 15, AWS ALB and ingress-nginx's
#: upstream pool after 60, Go's HTTP transport (Traefik, llm-d's routing sidecar) after 90. uvicorn's and vLLM's
#: 5 s met httpx's 5 s exactly: ``benchmarks/serving.py`` saw ``httpx.ReadError`` and 4-5 s stalls until its
#: client expired connections first. 130 s, ASP.NET Kestrel's default, is above them all (llm-d sets vLLM's
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` to 120 for its sidecar's 90).
DEFAULT_KEEP_ALIVE = 130.0
#: Seconds a new connection may stay idle before its first request (at most ``--timeout-keep-alive``): a connection
#: that sends nothing is closed (1,000 idle connections were never closed). Not shorter: a client whose own loop is
#: busy (400 streams in one process under load) sent its request more than 5 s after connecting and read a closed
#: connection; nginx's ``client_header_timeout`` is 60 s.
FIRST_REQUEST_IDLE = 30.0
#: Seconds a lost coordinator has to come back before what is pending on it fails (``--coordinator-grace``;
#: see :class:`megatron_serve.client.coordinator_client.InferenceClient`).
DEFAULT_COORDINATOR_GRACE = 30.0
#: The HTTP server's fleet-status timing in seconds (``--status-interval``, ``--status-timeout``,
#: ``--ready-timeout``; see :mod:`megatron_serve.server.fleet`).
STATUS_INTERVAL = 0.5
STATUS_TIMEOUT = 2.0
READY_TIMEOUT = 0.05
#: ``--health-stall-timeout``: a main event loop silent this long is hung, not busy (it ran 2 s late at worst
#: under 400 streams on 2 cores), and the probe port's ``/health`` says so (:mod:`megatron_serve.server.probe_port`).
HEALTH_STALL_TIMEOUT = 30.0
#: Seconds without a stamp from the server's event loop (twice a second) after which the probe port's ``/ready`` is 503
#: (:mod:`megatron_serve.server.probe_port`): the process that owns the main port does not answer (SIGSTOPped,
#: or its loop hangs). Above the 2 s a loop ran late at worst under 400 streams, and below a kubelet's probe period.
READY_STALL_TIMEOUT = 5.0
#: The probe port's (``--health-port``) listen backlog (the kernel caps it at ``net.core.somaxconn``, 4096 by
#: default): a connection beyond the backlog has its SYN dropped, and the client sends it again after 1 s, past a
#: kubelet's timeout (a backlog of 64 made a probe wait for that retry beside thousands of idle connections).
PROBE_BACKLOG = 4096
#: Connections the probe port holds open at once; a new one past it closes the oldest (a probe sends its request
#: at once, so the oldest is the likeliest idle one). The probe process raises its own open-file limit to hold
#: them: nothing is shared with the main port's ``--max-connections``.
PROBE_MAX_OPEN = 2048
#: The main port's listen backlog (uvicorn's default): it listens before the probe port can say ready, so that a
#: client sent there by a ready probe is queued until the server accepts, never refused.
MAIN_BACKLOG = 2048

#: Characters per token of context beyond which a prompt cannot fit with any common tokenizer:
#: English averages about 4 characters per token and code about 3; 32 leaves room for prompts
#: full of long whitespace-run tokens. Used when ``max_prompt_chars`` is not given.
PROMPT_CHARS_PER_CONTEXT_TOKEN = 32


# The request budget: what one request asks the fleet to compute and send, counted before any of it is done.
#
# Each field of a request has its own limit (``n``, ``logprobs``, ``prompt_logprobs``, the prompt's
# length), but their product is what costs: ``n=128``, ``prompt_logprobs=20`` and ``logprobs=20`` on
# a 1,000-token prompt, each within its limit, made 2.7 million log-prob entries, a 184 MB answer
# from a 4.8 KB request, and stalled every other client of the server for seconds. So the product is
# bounded too, where the request enters (the HTTP server for a whole request, the coordinator for each
# engine request), against two budgets:
#
# * **log-prob entries**: per choice, each scored prompt position gives its token's log prob and the
#   ``k`` likeliest alternatives, and so does each generated token when log probs are asked for
#   (``k`` is one count for both, the larger one asked). Output tokens count at their maximum
#   (``max_tokens``, or the rest of the context), since nothing shorter is promised. Kept ids
#   (``return_top_p_token_ids``, slime's top-p replay) count here too: up front where their most is known
#   (``top_k`` per generated token, one for a greedy request); with top-p alone their most is the whole
#   vocabulary per token (156 M ids for 1,024 tokens of a 151,936-id vocabulary, slime's defaults), which
#   would refuse every such request, so they are counted as the engine produces them instead
#   (:class:`KeptIdsMeter`, all the request's choices together) and the request ends once they pass it;
# * **answer bytes**: an estimate of the JSON answer, :data:`TOKEN_BYTES` per returned token,
#   :data:`LOGPROB_ENTRY_BYTES` per entry (the shapes of both endpoints hold an entry in 30 to 80
#   bytes: its id or text, its log prob, in vLLM's ``prompt_logprobs`` its rank and decoded text) and
#   :data:`KEPT_ID_BYTES` per kept id (those counted as produced too, by the same meter).

#: Estimated JSON bytes of one log-prob entry in an answer.
LOGPROB_ENTRY_BYTES = 64
#: Estimated JSON bytes of one returned token's text (or id) in an answer.
TOKEN_BYTES = 8
#: Estimated JSON bytes of one kept id: SGLang's answer holds them as base64 int32 (5.3 bytes each).
KEPT_ID_BYTES = 6
#: Default most log-prob entries per request (``--max-request-logprobs``): a 32k-token prompt scored with
#: ``prompt_logprobs=20`` (688k entries) fits; ``n=128`` such choices of a 1,000-token prompt (2.7 M) do not.
DEFAULT_MAX_REQUEST_LOGPROBS = 1 << 20
#: Default largest estimated answer in bytes (``--max-response-bytes``).
DEFAULT_MAX_RESPONSE_BYTES = 64 << 20


@dataclass(frozen=True)
class Cost:
    """What a request (or one of its engine requests) asks for: log-prob entries, kept ids (counted against the
    log-prob budget too) and estimated answer bytes."""

    logprobs: int = 0
    answer_bytes: int = 0
    kept_ids: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.logprobs + other.logprobs, self.answer_bytes + other.answer_bytes,
                    self.kept_ids + other.kept_ids)


def kept_ids_per_token(params: SamplingParams) -> int:
    """The most ids ``return_top_p_token_ids`` reports for one generated token where that is known before the
    logits are seen: one for a greedy request, ``top_k`` with it; 0 otherwise: none without a filter that keeps a
    subset (the engine reports none then), and top-p alone, whose ids :class:`KeptIdsMeter` counts as produced."""
    if not params.return_top_p_token_ids:
        return 0
    if params.is_greedy:
        return 1
    if all(getattr(params, row.name) == row.default for row in SUBSET_FILTERS):
        return 0
    return params.top_k


def engine_request_cost(prompt_len: int, params: SamplingParams, *, returns_prompt: bool = False) -> Cost:
    """The cost of one engine request (one choice) of a ``prompt_len``-token prompt; ``returns_prompt``: the answer
    repeats the prompt's tokens (``echo``, ``return_token_ids``)."""
    k = params.top_n_logprobs
    entries = max(prompt_len - 1, 0) * (1 + k) if params.return_prompt_log_probs else 0  # the first has no context
    per_token = k + (1 if params.return_log_probs or k else 0)
    entries += params.num_tokens_to_generate * per_token
    kept = params.num_tokens_to_generate * kept_ids_per_token(params)
    tokens = params.num_tokens_to_generate + (prompt_len if returns_prompt else 0)
    return Cost(entries, tokens * TOKEN_BYTES + entries * LOGPROB_ENTRY_BYTES + kept * KEPT_ID_BYTES, kept)


def over_budget(cost: Cost, max_logprobs: int, max_bytes: int | None = None, *,
                option: str = "--max-request-logprobs") -> str | None:
    """Why ``cost`` is over the budgets (a sentence naming the budget, the ``option`` that sets it and the
    request's figure), or None."""
    if cost.kept_ids and cost.logprobs + cost.kept_ids > max_logprobs:  # in SGLang's words for its length limits
        return (f"Requested top-p token ids and log probs exceed this server's budget of {max_logprobs:,} per request "
                f"({option}). You requested up to {cost.logprobs + cost.kept_ids:,}: {cost.kept_ids:,} top-p token "
                f"ids (top_k per new token) and {cost.logprobs:,} log probs. "
                "Please lower top_k, or reduce max_new_tokens or the number of choices.")
    if cost.logprobs > max_logprobs:
        return (f"the request asks for {cost.logprobs:,} log probs (choices x (prompt positions x (prompt_logprobs "
                f"+ 1) + max_tokens x (logprobs + 1))); this server's budget is {max_logprobs:,} per request "
                f"({option}): ask for fewer choices, log probs per token or tokens")
    if max_bytes is not None and cost.answer_bytes > max_bytes:
        return (f"the request's answer would be about {cost.answer_bytes:,} bytes ({TOKEN_BYTES} per token, "
                f"{LOGPROB_ENTRY_BYTES} per log prob, {KEPT_ID_BYTES} per top-p token id); this server's budget is "
                f"{max_bytes:,} bytes per answer (--max-response-bytes): ask for fewer choices, log probs or tokens")
    return None


class KeptIdsMeter:
    """A request's kept ids counted as its engines produce them, against the budgets it was admitted under, beside
    what those counted up front: top-p alone bounds nothing before the logits are seen, so its ids are counted here
    rather than refused at their most. Its log-prob entries and kept ids share the log-prob budget; where a front door
    sets one (``--max-response-bytes``), the answer's estimate grows by :data:`KEPT_ID_BYTES` per id too.

    One meter counts all the engine requests of a request (its ``n`` choices, its prompts): the budget is per
    request, as its up-front count and SGLang's and vLLM's request limits are, so two choices share it. Once over it
    stays over, and each of them ends at its next step. The count lives where the deltas arrive and is only ever
    added to, so the ids already delivered stay counted when the request moves to another engine. The HTTP server
    keeps one per HTTP request beside its client's pending requests; the coordinator and the in-process engine thread
    one per engine request, their own bound for any client."""

    __slots__ = ("budget", "option", "max_bytes", "logprobs", "base_bytes", "choices", "kept", "tokens", "reason")

    def __init__(self, cost: Cost, budget: int, option: str, *, max_bytes: int | None = None, choices: int = 1,
                 kept: int = 0, tokens: int = 0) -> None:
        """``cost``: the request's, all its choices, counted at admission (its kept ids there are their bound, not
        counted again); ``kept`` and ``tokens``: ids already delivered, and the tokens they came with (a request
        submitted again to go on from its tokens)."""
        self.budget, self.option, self.max_bytes, self.choices = budget, option, max_bytes, choices
        self.logprobs, self.base_bytes = cost.logprobs, cost.answer_bytes - cost.kept_ids * KEPT_ID_BYTES
        self.kept, self.tokens = kept, tokens
        self.reason: str | None = None

    def add(self, per_token: Sequence[Sequence[int]] | None) -> str | None:
        """Count one delta's kept ids (a list per new token); why the request is over a budget (SGLang's words for
        its length limits, naming the cap, the option that sets it and the figures), or None."""
        if self.reason is not None:
            return self.reason
        if per_token:
            self.kept += sum(map(len, per_token))
            self.tokens += len(per_token)
        over_logprobs = self.logprobs + self.kept > self.budget
        answer_bytes = self.base_bytes + self.kept * KEPT_ID_BYTES
        if not over_logprobs and (self.max_bytes is None or answer_bytes <= self.max_bytes):
            return None  # every delta passes here: the message is made only for the one that ends the request
        produced = f"{self.kept:,} top-p token ids in {self.tokens:,} new tokens" + (
            f" of its {self.choices} choices" if self.choices > 1 else "")
        advice = "and was ended. Please set top_k, lower top_p, or reduce max_new_tokens or the number of choices."
        if over_logprobs:
            self.reason = (f"Top-p token ids and log probs exceed this server's budget of {self.budget:,} per request "
                           f"({self.option}). The request produced {produced} beside {self.logprobs:,} log probs, "
                           f"{advice}")
        else:
            self.reason = (f"The answer with its top-p token ids exceeds this server's budget of {self.max_bytes:,} "
                           f"bytes per answer (--max-response-bytes). The request produced {produced}, about "
                           f"{answer_bytes:,} bytes with the rest of its answer ({KEPT_ID_BYTES} per top-p token id), "
                           f"{advice}")
        return self.reason


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits of the OpenAI server; each field is also a command-line flag (``flag``).

    The defaults and their reasons:

    * ``max_body_bytes`` 2 MiB: a 128k-token prompt is about 0.5 MiB as text and about 1 MiB as
      token ids (``json.dumps`` writes ``"128000, "`` per id), so 2 MiB holds a full Llama 3.1
      context either way. Parsing is the one step that cannot leave the event loop (the JSON
      parser holds the GIL), and costs tens of milliseconds per MiB in the worst case (dense small
      integers). Larger bodies get a 413 before they are read.
    * ``max_prompt_chars``: by default ``32 x`` the context length in tokens (see
      :data:`PROMPT_CHARS_PER_CONTEXT_TOKEN`): longer text cannot fit, so it is refused before
      a tokenizer thread spends seconds on it. It counts
      all prompts of a request, or all message text of a chat.
    * ``max_n`` 128: OpenAI's own maximum; each choice is an engine request.
    * ``max_choices`` 16,384 engine requests (prompts x ``n``) per request: the other limits bound each field, not
      their product, and one 40 KB completion of 5,000 prompts x ``n`` 32 asked the fleet for 160,000 engine
      requests at once (issue 86). 16,384 is 128 prompts at OpenAI's most choices, or a batch of 16,384 prompts; a
      larger batch is split into requests by its client (as OpenAI's batch of prompts is).
    * ``max_stop`` 16 stop strings of at most ``max_stop_chars`` 256 characters: the engine looks
      for each in the new text of every step and holds back ``longest - 1`` characters of a stream.
    * ``max_logit_bias`` 1024 entries: every entry is applied at every step of the request.
    * ``max_stop_token_ids`` 1024 ids: the engine makes a vocabulary-wide mask of them when it admits the
      request and compares each new token with them (ids outside the vocabulary are a 400 too).
    * ``max_messages`` 1024 messages per chat: the chat template renders each (in Python).
    * ``max_logprobs`` 20: vLLM's default, and the most the engine returns per token.
    * ``max_request_logprobs`` 1,048,576 log-prob entries and ``max_response_bytes`` 64 MiB of estimated
      answer per request: the budgets on the product of ``n``, the prompt's length, ``prompt_logprobs``,
      ``max_tokens`` and ``logprobs`` (:func:`engine_request_cost`), checked once the prompts are tokenized,
      before anything is submitted. Within them an answer is still written in pieces (``server/whole_answers.py``).
    * ``max_images`` 8 images per chat and ``max_image_bytes`` 10 MiB per image file (data: or
      fetched; vision-language models): every image is decoded by the server and preprocessed and
      encoded by an engine. 10 MiB rather than OpenAI's 20 MB: a request travels to its engine in
      one 16 MiB frame. A data: URL counts against ``max_body_bytes`` too.
    * ``max_guided_choices`` 1024 strings of ``guided_choice``, and ``max_constraint_bytes`` 128 KiB
      for any output constraint (a JSON schema as JSON, a regex, a grammar, all choices together):
      a constraint becomes a grammar that the server checks and the engine compiles (once per
      request, on its step loop, where every other request's next token waits for it). Checking
      grows faster than the size: a grammar under the body limit took half a minute to check.
    * ``grammar_compile_timeout`` 1 s: a constraint that the server cannot check within it is
      refused with a 400 instead of reaching an engine. Checks run on two threads of their own
      (llguidance releases the GIL but cannot be interrupted: a check past its deadline finishes
      on its thread, which the size limit bounds), so the event loop keeps answering meanwhile.
    """

    max_body_bytes: int = field(default=2 * MiB, metadata={
        "flag": "--max-request-bytes", "help": "largest request body in bytes; larger ones get 413"})
    max_prompt_chars: int | None = field(default=None, metadata={
        "flag": "--max-prompt-chars",
        "help": f"most prompt characters per request, checked before tokenization (default: "
                f"{PROMPT_CHARS_PER_CONTEXT_TOKEN} x the context length in tokens)"})
    max_n: int = field(default=128, metadata={"flag": "--max-n", "help": "most choices (n) per request"})
    max_choices: int = field(default=16_384, metadata={
        "flag": "--max-choices", "help": "most choices of all prompts together per request (prompts x n): each is "
                                         "an engine request"})
    max_stop: int = field(default=16, metadata={"flag": "--max-stop", "help": "most stop strings per request"})
    max_stop_chars: int = field(default=256, metadata={
        "flag": "--max-stop-chars", "help": "longest stop string, in characters"})
    max_logit_bias: int = field(default=1024, metadata={
        "flag": "--max-logit-bias", "help": "most logit_bias entries per request"})
    max_stop_token_ids: int = field(default=1024, metadata={
        "flag": "--max-stop-token-ids", "help": "most stop_token_ids per request"})
    max_messages: int = field(default=1024, metadata={
        "flag": "--max-messages", "help": "most messages per chat request"})
    max_images: int = field(default=8, metadata={
        "flag": "--max-images-per-request", "help": "most image_url parts per chat request (vision-language models)"})
    max_image_bytes: int = field(default=10 * MiB, metadata={
        "flag": "--max-image-bytes", "help": "largest image file of a chat request, data: or fetched, in bytes"})
    max_logprobs: int = field(default=MAX_TOP_N_LOGPROBS, metadata={
        "flag": "--max-logprobs", "help": f"most log probs per token a request may ask for (logprobs, top_logprobs, "
                                          f"prompt_logprobs), 0 to {MAX_TOP_N_LOGPROBS} (vLLM's option)"})
    max_request_logprobs: int = field(default=DEFAULT_MAX_REQUEST_LOGPROBS, metadata={
        "flag": "--max-request-logprobs",
        "help": "most log-prob entries one request may ask for: choices x (prompt positions x (prompt_logprobs + 1) "
                "+ max_tokens x (logprobs + 1)), with top-p token ids (SGLang's return_top_p_token_ids): top_k per token "
                "up front, or as produced without top_k (the request ends once they pass it)"})
    max_response_bytes: int = field(default=DEFAULT_MAX_RESPONSE_BYTES, metadata={
        "flag": "--max-response-bytes",
        "help": "largest estimated answer of one request, in bytes (tokens, log probs and top-p token ids of every "
                "choice; top-p token ids without top_k as they are produced: the request ends once they pass it)"})
    max_guided_choices: int = field(default=1024, metadata={
        "flag": "--max-guided-choices", "help": "most strings in guided_choice"})
    max_constraint_bytes: int = field(default=128 * 1024, metadata={
        "flag": "--max-constraint-bytes",
        "help": "largest output constraint in bytes: a JSON schema (as JSON), a regex, a grammar, or all choices "
                "together"})
    grammar_compile_timeout: float = field(default=1.0, metadata={
        "flag": "--grammar-compile-timeout", "type": float,
        "help": "seconds the server may take to check an output constraint (JSON schema, regex, grammar, "
                "choices); slower ones are refused with 400"})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_chars":
                continue
            if f.name == "max_logprobs":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_N_LOGPROBS:
                    raise ValueError(f"--max-logprobs must be an integer from 0 to {MAX_TOP_N_LOGPROBS} (the most "
                                     f"the engine returns), got {value!r}")
                continue
            if f.metadata.get("type") is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"{f.metadata['flag']} must be a number of seconds > 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.metadata['flag']} must be an integer >= 1, got {value!r}")

    def prompt_chars(self, max_model_len: int | None) -> int | None:
        """The prompt-character limit in force for a model with this context length (None = none)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return None if max_model_len is None else PROMPT_CHARS_PER_CONTEXT_TOKEN * max_model_len

    @staticmethod
    def flags() -> list[tuple[str, str, str]]:
        """``(field name, flag, help)`` of every limit, for the commands' option group."""
        return [(f.name, f.metadata["flag"], f.metadata["help"]) for f in fields(RequestLimits)]

    @staticmethod
    def flag_type(name: str) -> type:
        """The type of a limit's flag value (``int``, or ``float`` for seconds)."""
        return next(f.metadata.get("type", int) for f in fields(RequestLimits) if f.name == name)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "RequestLimits":
        """From parsed flags (``dest`` = field name); ``None`` keeps a default."""
        return cls(**{name: options[name] for name, _, _ in cls.flags() if options.get(name) is not None})
