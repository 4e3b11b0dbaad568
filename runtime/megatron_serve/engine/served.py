"""What the engine process needs of an engine: :class:`ServedEngine`, one typed interface.

``EngineProcess`` (:mod:`.process`) drives ``DynamicInferenceEngine`` in production and deterministic fakes in the
fleet tests. Both implement this protocol, so the process reads each fact directly: it used to probe the engine
with 18 ``getattr(engine, name, default)`` calls, which turned a misspelt or missing member into a
silently wrong HELLO (a fleet without a block size routes without prefix affinity) instead of an error.
Every lifecycle verb reaches the engine through one member, ``call(step, body)`` (:mod:`.verbs.actions`), and prefill/decode
disaggregation through two, ``kv_in`` and ``kv_out``, with a request's ``kv_transfer_params`` given as it is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np

    from ..weights.peer_pull import PeerWeights
    from ..weights.sources import WeightSource
    from .kv.events import KVEventLog
    from ..wire.kv_blocks import KVBlocks
    from ..wire.lifecycle import Step
    from ..wire.deltas import PromptScores
    from ..wire.request import EngineRequest, FinalRecord


class Turn(NamedTuple):
    """What one turn of the step loop does: step, act on the verb held, take a planned change. A lone engine steps
    when it has work; data-parallel attention ranks agree on it together (:mod:`.group.data_parallel`)."""

    step: bool  # some rank has work: every rank steps
    verb: bool  # every rank holds a verb that joins them all (:class:`.group.turns.HeldVerb`): every rank acts on it
    change: bool = False  # the leader saw a planned change asked for (.group.membership): every rank takes it now


@dataclass(frozen=True)
class EngineFacts:
    """What an engine tells the coordinator once, in its HELLO (``info``), besides the process's own facts."""

    capacity: int  # requests it runs at once (``max_requests``)
    kv_blocks_total: int
    tensor_parallel_size: int = 1  # ranks that join a weight transfer
    kv_cache_bytes: int | None = None
    max_sequence_length: int | None = None
    block_size: int | None = None  # prefix_affinity routing hashes prompts with the engines' block size
    prefix_caching: bool = False
    expert_parallel: bool = False  # the group's ranks hold whole experts (--enable-expert-parallel)
    pipeline_parallel_size: int = 1  # stages of tensor_parallel_size ranks each: they all join a weight transfer
    parameter_bytes: int | None = None  # the weights one rank holds (rank 0's; each rank holds about as much)
    kv_offload_blocks: int = 0  # blocks its host KV tier holds (--kv-offloading-size): prefix routing counts them
    weights_layout: str | None = None  # engines of one layout pull weights from each other (weights.peer_pull)
    dtype: str | None = None  # what activations and the KV cache are computed in ("bfloat16"): the servers' server_info
    max_loras: int | None = None  # adapters served at once, with LoRA on (None: off); the servers' lora_config
    max_lora_rank: int | None = None
    logprobs_mode: str | None = None  # --logprobs-mode: what its log probs are (the servers' server_info)
    vocab_size: int | None = None  # the coordinator bounds a request's kept ids (return_top_p_token_ids) by it

    def hello_info(self) -> dict[str, Any]:
        """The facts as HELLO's ``info`` carries them (absent ones left out, ``capacity`` travels beside)."""
        info: dict[str, Any] = {"kv_blocks_total": self.kv_blocks_total,
                                "tensor_parallel_size": self.tensor_parallel_size}
        known = {"parameter_bytes": self.parameter_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                 "max_sequence_length": self.max_sequence_length, "block_size": self.block_size,
                 "weights_layout": self.weights_layout, "dtype": self.dtype, "logprobs_mode": self.logprobs_mode,
                 "vocab_size": self.vocab_size}
        info.update((name, value) for name, value in known.items() if value is not None)
        if self.expert_parallel:
            info["expert_parallel"] = True
        if self.pipeline_parallel_size > 1:
            info["pipeline_parallel_size"] = self.pipeline_parallel_size
        if self.block_size is not None:
            info["prefix_caching"] = self.prefix_caching
        if self.kv_offload_blocks:
            info["kv_offload_blocks"] = self.kv_offload_blocks
        if self.max_loras is not None:
            info["max_loras"], info["max_lora_rank"] = self.max_loras, self.max_lora_rank
        return info


class EngineStepResult(Protocol):
    """What one step did for one request (the engine's ``StepOutput``), as the process reports it."""

    request_id: str
    new_tokens: list[int]
    new_log_probs: list[float]
    finished: bool
    top_ids: list[list[int]] | None
    top_log_probs: list[list[float]] | None
    top_p_token_ids: list[list[int]] | None
    new_routing: tuple[int, np.ndarray] | None
    epochs: tuple[int, int, int]
    cached_tokens: int | None
    prompt_scores: PromptScores | None
    final: FinalRecord | None
    stop_token: bool  # the last new token is the stop id that ended it


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds and has done, read once per heartbeat (and for a verb's answer)."""

    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    cached_tokens: int = 0  # prompt tokens skipped thanks to the prefix cache (either tier)
    computed_tokens: int = 0  # tokens run through the model (prefill and decode)


class MemoryVerbs(Protocol):
    """The device-memory verbs, an object the engine holds (the engine's :class:`~.memory_verbs.DeviceMemory`)."""

    @property
    def kept_kv_bytes(self) -> int: ...  # live requests' KV in host memory while suspended with keep_kv

    def suspend(self, level: int = 1, keep_kv: bool = False) -> int: ...

    def resume(self) -> None: ...

    def verify_refit(self, source: str | WeightSource) -> float: ...

    def refit(self, source: str | WeightSource, epoch: int | None = None) -> dict[str, Any]: ...

    def reset_prefix_cache(self, reset_running_requests: bool) -> dict[str, Any]: ...  # every KV tier's cached blocks

    def scale_expert_group(self, size: int) -> dict[str, Any]: ...  # SCALE_EP: this rank's part of its group's change

    @property
    def peers(self) -> PeerWeights: ...  # its side of peer pulls as a donor (weights.peer_pull)


class AdapterVerbs(Protocol):
    """The LoRA adapter verbs, an object the engine holds (the engine's :class:`~.lora_verbs.Adapters`)."""

    def names(self) -> dict[str, str] | None: ...  # adapters served (name -> directory); None: no LoRA

    def verify(self, name: str, path: str) -> float: ...

    def load(self, name: str, path: str) -> float: ...

    def unload(self, name: str) -> None: ...


@dataclass
class Serving:
    """What the verbs change beside the weights and the pools, and what the engine process's HELLO says of it: a
    restarted coordinator syncs the engine by its ``epoch``, ``weights`` and ``loras`` (``info``, the HELLO's, which
    the verbs keep current once the process attached it)."""

    lora_push_dir: str | None = None  # where a pushed adapter version is stored (``--lora-push-dir``)
    weights: str | None = None  # where the served weights came from (a REFIT replaces it)
    suspend_level: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    towards: str = ""  # the coordinator's host: a trainer's weights are offered to joiners on the route to it

    def attach(self, info: dict[str, Any], towards: str, epoch: int, loras: dict[str, str] | None) -> None:
        """Keep ``info`` (the HELLO's facts) current from now on; the weights came from its ``model``."""
        self.info, self.towards, self.weights = info, towards, info.get("model")
        info["epoch"], info["weights"] = epoch, self.weights
        if loras is not None:  # the adapters it serves: routed to at once, before its first heartbeat
            info["loras"] = loras


class ServedEngine(Protocol):
    """The engine as :class:`~megatron_serve.engine.process.loop.EngineProcess` serves it: the step loop's members,
    the verbs' one entry, and the verbs' objects it holds."""

    kv_events: KVEventLog  # what the KV tiers hold, as vLLM's KV events (the coordinator's index reads them)
    memory: MemoryVerbs  # suspend, resume, refit
    adapters: AdapterVerbs  # LoRA adapters
    serving: Serving  # what the verbs change beside weights and pools (source, suspend level), and HELLO says of it

    @property
    def epoch(self) -> int: ...  # generation of the weights being served (-1: a mix after a failed load)

    def load(self) -> EngineLoad: ...

    def facts(self) -> EngineFacts: ...

    def metrics_snapshot(self) -> dict[str, Any] | None: ...  # the heartbeat's ``metrics``, when it keeps them

    def has_unfinished_requests(self) -> bool: ...

    def group_turn(self, busy: bool, holding: bool = False) -> Turn: ...  # step now? act on a held verb now?

    def idle(self) -> None: ...  # a loop turn with no step: hand out what landed meanwhile (the disk tier's events)

    def call(self, step: Step | str, body: Any) -> dict[str, Any]: ...  # a verb's work: the acknowledgement's detail

    # a request, and vLLM's kv_transfer_params: its KV goes on after prefill, or it starts on blocks that arrived
    def add_request(self, request: EngineRequest, kv_transfer_params: dict[str, Any] | None = None) -> None: ...

    def kv_in(self, part: KVBlocks) -> None: ...  # a part of a prefilled request's blocks, ahead of the request

    def kv_out(self, engine_id: str) -> Sequence[KVBlocks]: ...  # blocks of requests prefilled here, to send on

    def step(self) -> Sequence[EngineStepResult]: ...

    def sync(self) -> Sequence[EngineStepResult]: ...

    def abort_request(self, request_id: str) -> object: ...  # how it ended (unused: the coordinator ends it itself)

    # the requests of EngineRequests handed back; with forget_transfers, every KV part and mark too (a new session)
    def take_unfinished_requests(self, forget_transfers: bool = False) -> Sequence[FinalRecord]: ...
