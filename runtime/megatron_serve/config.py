"""Engine-wide settings (``InferenceConfig``): what one engine replica may hold and compute per step."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .processes.devices import default_device
from .wire.lora_names import name_problem, path_problem
from .wire.kv_events import KVEventsConfig, parse_kv_events_config
from .wire.lifecycle import KV_ON_REFIT
from .wire.kv_events import KV_OFFLOADING_BACKENDS
from .wire.sampling_params import LOGPROBS_MODES

if TYPE_CHECKING:
    import torch

# torch is imported where a dtype or a GPU is resolved, not with this module: the processes that only check options
# (the HTTP server's, ``run``'s) run without it, an import of some 2 s of CPU
_DTYPE_NAMES = ("float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
QUANTIZATIONS = ("fp8",)  # quantize a checkpoint's linear layers at load (vLLM's --quantization)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}  # vLLM's spellings -> ours (fp8 is e4m3)
# how expert-parallel MoE layers move tokens (vLLM's --all2all-backend; model.expert_dispatch, engine.experts.backend):
# auto = DeepEP where it runs, else alltoall (a plain all-to-all, fixed-capacity in CUDA graphs)
ALL2ALL_BACKENDS = ("auto", "alltoall", "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept ``"bfloat16"``-style names or a ``torch.dtype``; anything else is a clear error."""
    import torch  # noqa: PLC0415 - see _DTYPE_NAMES

    dtypes = {name: getattr(torch, name) for name in _DTYPE_NAMES}
    if isinstance(dtype, torch.dtype):
        if dtype not in dtypes.values():
            raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    return dtypes[name]


def batch_invariant_from_env() -> bool:
    """``VLLM_BATCH_INVARIANT=1`` turns ``batch_invariant`` on, as vLLM users set it (``0`` or unset: off)."""
    value = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"VLLM_BATCH_INVARIANT must be 0 or 1, got {value!r}")
    return value == "1"


def _from_json_object(cls: type, data: Any, option: str, fields: tuple[str, ...]) -> Any:
    """``cls`` from vLLM's JSON object ``data`` for ``option``; not an object, an unknown key or a bad value is an
    error naming it."""
    if not isinstance(data, dict):
        raise ValueError(f"{option} must be a JSON object, got {data!r}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{option}: unknown field {unknown[0]!r} (known: {', '.join(fields)})")
    return cls(**data)


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp", "eagle3")
_SPECULATIVE_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                       "adaptive")


@dataclass
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: which proposer guesses the next tokens, and how many per step.

    ``ngram`` (prompt lookup) finds the request's last ``prompt_lookup_max`` .. ``prompt_lookup_min``
    tokens earlier in its own tokens and proposes what followed them; ``draft_model`` runs the smaller
    model at ``model``; ``mtp`` chains the target's own MTP layer (checkpoints with ``num_nextn_predict_layers``).
    ``eagle3`` runs the EAGLE-3 head at ``model`` on the target's hidden states (Llama-3 layout).
    ``adaptive`` (default true; not a vLLM field) lets each engine choose K per request and step, down to 0
    where drafting does not pay (engine.speculative.adaptive); false drafts ``num_speculative_tokens`` always.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None
    adaptive: bool = True  # K per request and step from measured acceptance and cost (0..num_speculative_tokens)

    @classmethod
    def from_dict(cls, data: Any) -> "SpeculativeConfig":
        """From vLLM's JSON object; an unknown key or a bad value is an error naming it."""
        return _from_json_object(cls, data, "speculative_config", _SPECULATIVE_FIELDS)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model must name the draft's directory for method {self.method}")
        if self.method == "mtp" and self.model is not None:
            raise ValueError("speculative_config.model must be unset for method mtp: it reads the target's own "
                             "MTP layers (num_nextn_predict_layers)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path, got {self.model!r}")


_EPLB_FIELDS = ("window_size", "step_interval", "num_redundant_experts", "log_balancedness")


@dataclass
class EplbConfig:
    """vLLM's ``--eplb-config`` (with ``--enable-eplb``): expert-parallel load balancing (engine.experts.balancer).

    Each MoE layer's tokens per expert are counted over the last ``window_size`` steps; every ``step_interval``
    steps the experts are placed again, ``num_redundant_experts`` copies of the busiest ones included (each
    rank holds ``(E + num_redundant_experts) / ep`` experts); ``log_balancedness`` logs each step's balancedness
    (mean over max of the tokens per rank)."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False

    @classmethod
    def from_dict(cls, data: Any) -> "EplbConfig":
        """From vLLM's JSON object; an unknown key or a bad value is an error naming it."""
        return _from_json_object(cls, data, "eplb_config", _EPLB_FIELDS)

    def __post_init__(self) -> None:
        for name, least in (("window_size", 1), ("step_interval", 1), ("num_redundant_experts", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"eplb_config.{name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.log_balancedness, bool):
            raise ValueError(f"eplb_config.log_balancedness must be true or false, got {self.log_balancedness!r}")


def dtype_name(dtype: str | torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class InferenceConfig:
    """Sizing of one engine. Everything is optional; defaults suit a CPU and are scaled up on a GPU.

    The KV pool is sized by ``num_kv_blocks`` when given, else by ``kv_cache_memory_fraction`` of
    free device memory (on CPU: of a fixed 1 GiB budget, since host memory is shared with everything).

    ``quantization="fp8"`` quantizes a bf16 checkpoint's decoder linear layers to FP8 at load (one
    scale per output row; a checkpoint that is FP8 already is served as it is, without it).
    ``kv_cache_dtype="fp8"`` keeps the KV cache in e4m3 with one scale per token and KV head: about
    twice the tokens in the same memory (``auto``: the model dtype).

    ``verify_logprobs_fraction``: that fraction of the finished requests that reported log probs (chosen by
    a hash of the request id) is scored again as one prompt and compared bitwise with what was reported;
    counted in ``logprob_parity_checked_total`` / ``logprob_parity_mismatch_total`` (default 0: off).

    ``batch_invariant=True`` (default: the environment's ``VLLM_BATCH_INVARIANT``) makes a request's
    logits, log probs and tokens a function of that request alone, whatever else shares its steps, and
    equal to what ``megatron_serve.invariant`` computes in a trainer (docs/batch-invariance.md).

    ``speculative``: a :class:`SpeculativeConfig` turns speculative decoding on (docs/speculative.md).
    """

    dtype: str | torch.dtype | None = None
    device: str | None = None
    block_size_tokens: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    max_batch_tokens: int = 2048
    max_requests: int = 256  # vLLM's max_num_seqs; the KV pool is sized to hold that many full-length requests
    # where memory allows (the engine's start-up log says how many fit)
    # A prompt with more tokens than this left to compute is long: a step serves decodes and shorter prompts before
    # more than this many of its tokens, and at most max_long_partial_prefills long prompts first (engine.scheduler;
    # vLLM's options). None: a quarter of max_batch_tokens; 0: off (first come, first served).
    long_prefill_token_threshold: int | None = None
    max_long_partial_prefills: int = 1
    # vLLM's --scheduling-policy: "priority" also preempts running requests of a larger priority value for a waiting
    # one of a smaller (engine.tenancy, the tenants' classes' mechanism); "fcfs" only orders admission by it
    scheduling_policy: str = "fcfs"
    max_sequence_length: int | None = None
    enable_prefix_caching: bool = True
    enable_cuda_graphs: bool = True  # replay decode steps from CUDA graphs (GPU with Triton kernels only)
    cuda_graph_sizes: list[int] | None = None  # token counts captured (vLLM's --cuda-graph-sizes; engine.precompile.graphs)
    async_scheduling: bool = True  # prepare and launch step N+1 while step N runs (see engine.core)
    tensor_parallel_size: int = 1
    # the tensor-parallel ranks hold whole experts of MoE layers, tokens move by all-to-all (model.token_dispatcher)
    enable_expert_parallel: bool = False
    all2all_backend: str = "auto"  # one of ALL2ALL_BACKENDS
    # EPLB (vLLM's --enable-eplb, --eplb-config): experts placed by their measured load, busy ones copied
    enable_eplb: bool = False
    eplb_config: EplbConfig | None = None  # None: EplbConfig's defaults (with enable_eplb)
    # the layers split into this many stages (model.parallel.PipelineStage), tensor_parallel_size ranks each
    pipeline_parallel_size: int = 1
    # micro-batches a step's requests split into across the stages, so that stage s runs one while stage s - 1 runs
    # the next (engine.micro_batches); None: as many as stages
    pipeline_micro_batches: int | None = None
    # data-parallel attention ranks sharing the MoE layers (engine.group.data_parallel), and which one this engine is
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    seed: int = 0
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    verify_logprobs_fraction: float = 0.0  # finished requests scored again and compared bitwise (engine.sampling.logprob_parity)
    batch_invariant: bool = field(default_factory=batch_invariant_from_env)
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES
    # the tensor-parallel size of the trainer that recomputes log probs under megatron_serve.invariant (None:
    # not declared); with batch_invariant an engine at another size warns at start (trainer_seam_warning)
    trainer_tensor_parallel_size: int | None = None
    # LoRA adapters (engine.lora): slots on the device, the largest rank they hold, adapters kept on the host
    # (default: max_loras, or as many as lora_modules names), and adapters registered at start (name -> PEFT directory).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    max_lora_versions: int = 2  # versions of one adapter resident at once (a trainer's pushes; engine.lora)
    lora_push_dir: str | None = None  # pushed versions also written there, for engines joining later (engine.lora_store)
    lora_modules: dict[str, str] | None = None
    # where the fleet's LOAD_LORA (the load route, control load_lora) may read; None: the directories holding the
    # lora_modules adapters, or nowhere without them (engine.lora.allowed_lora_dirs)
    lora_allowed_dirs: list[str] | None = None
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine.speculative); None: off
    # The host tier of the KV cache, in GiB (vLLM's kv_offloading_size; engine.kv.offload); None: no tier.
    kv_offloading_size: float | None = None
    # Where the host tier's evicted blocks go: vLLM's kv_offloading_backend, "native" (nowhere) or "disk" (files in
    # kv_disk_dir, shared by the node's engines, kv_disk_size GiB in all: engine.kv.disk).
    kv_offloading_backend: str = "native"
    kv_disk_dir: str | None = None
    kv_disk_size: float | None = None
    kv_on_refit: str = "recompute"  # KV kept by suspend(keep_kv=True) across a refit: one of KV_ON_REFIT
    # vLLM's --kv-events-config (wire.kv_events): KV events published on a ZeroMQ socket of the engine's own
    kv_events_config: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):  # crossed a process boundary as plain values
            self.speculative = SpeculativeConfig.from_dict(self.speculative)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig, a dict or None, got {self.speculative!r}")
        self._check_eplb()
        if self.device is None:
            self.device = default_device()
        if self.block_size_tokens is None:
            self.block_size_tokens = 64 if str(self.device).startswith("cuda") else 16
        if self.dtype is not None:
            self.dtype = resolve_dtype(self.dtype)
        for name in ("block_size_tokens", "max_batch_tokens", "max_requests", "tensor_parallel_size",
                     "pipeline_parallel_size", "max_long_partial_prefills"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        micro = self.pipeline_micro_batches
        if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
            raise ValueError(f"pipeline_micro_batches must be a positive integer or unset, got {micro!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = self.max_batch_tokens // 4
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be a non-negative integer (0: off), got {threshold!r}")
        for name in ("enable_prefix_caching", "enable_cuda_graphs", "async_scheduling", "batch_invariant",
                     "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if (not isinstance(sizes, (list, tuple)) or not sizes
                    or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)):
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive integers, got {sizes!r}")
            self.cuda_graph_sizes = list(sizes)
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if not 0.0 < float(self.kv_cache_memory_fraction) <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.max_sequence_length is not None and self.max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2, got {self.max_sequence_length}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        fraction = self.verify_logprobs_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify_logprobs_fraction must be a number in [0, 1], got {fraction!r}")
        self.verify_logprobs_fraction = float(fraction)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        trainer_tp = self.trainer_tensor_parallel_size
        if trainer_tp is not None and (isinstance(trainer_tp, bool) or not isinstance(trainer_tp, int) or trainer_tp < 1):
            raise ValueError(f"trainer_tensor_parallel_size must be a positive integer or unset, got {trainer_tp!r}")
        self._check_lora()
        if self.pipeline_parallel_size > 1 and (self.enable_lora or self.speculative is not None):
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size} does not serve "
                             f"{'LoRA adapters' if self.enable_lora else 'speculative decoding'} yet")
        self._check_kv_tiers()
        self._check_data_parallel()
        self._check_all2all()

    def _check_eplb(self) -> None:
        if isinstance(self.eplb_config, dict):  # vLLM's JSON, or crossed a process boundary as plain values
            self.eplb_config = EplbConfig.from_dict(self.eplb_config)
        if self.eplb_config is not None and not isinstance(self.eplb_config, EplbConfig):
            raise ValueError(f"eplb_config must be an EplbConfig, a dict or None, got {self.eplb_config!r}")
        if not isinstance(self.enable_eplb, bool):
            raise ValueError(f"enable_eplb must be true or false, got {self.enable_eplb!r}")
        if not self.enable_eplb:
            if self.eplb_config is not None:
                raise ValueError("eplb_config needs enable_eplb")
            return
        if not self.enable_expert_parallel:
            raise ValueError("enable_eplb balances the experts of an expert-parallel group: it needs "
                             "enable_expert_parallel")
        self.eplb_config = self.eplb_config or EplbConfig()

    def _check_all2all(self) -> None:
        backend = self.all2all_backend
        if backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got {backend!r}")
        if backend == "allgather_reducescatter" and self.data_parallel_size > 1:
            raise ValueError("all2all_backend allgather_reducescatter is not implemented under data-parallel attention "
                             "(it needs every rank's tokens on every rank: over tensor-parallel ranks they are)")
        if backend.startswith("deepep"):
            if not str(self.device).startswith("cuda"):
                raise ValueError(f"all2all_backend {backend}: DeepEP's kernels run on GPUs, not on {self.device}")
            if self.batch_invariant:
                raise ValueError(f"all2all_backend {backend} cannot give batch_invariant's one-rank bits: DeepEP adds "
                                 "a token's experts in its own order (alltoall combines them in ascending id order)")

    def _check_data_parallel(self) -> None:
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"data_parallel_rank must be an integer in [0, {size}), got {rank!r}")
        if size == 1:
            return
        if not self.enable_expert_parallel:
            raise ValueError(f"data_parallel_size {size} inside an engine group is data-parallel attention, which "
                             "shares MoE layers: it needs enable_expert_parallel (replicas of a dense model are "
                             "engine groups: --engines)")
        refused = [name for name, on in (("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1),
                                         ("LoRA adapters", self.enable_lora),
                                         ("speculative decoding", self.speculative is not None)) if on]
        if refused:
            raise ValueError(f"data_parallel_size {size} does not serve {', '.join(refused)} yet")

    def _check_kv_tiers(self) -> None:
        size = self.kv_offloading_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
                raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size needs enable_prefix_caching: the host tier holds cached blocks")
            self.kv_offloading_size = float(size)
        self._check_disk_tier()
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)  # a dict when it crossed processes
        if self.kv_on_refit not in KV_ON_REFIT:
            raise ValueError(f"kv_on_refit must be one of {', '.join(KV_ON_REFIT)}, got {self.kv_on_refit!r}")

    def _check_disk_tier(self) -> None:
        backend = self.kv_offloading_backend
        if backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, got "
                             f"{backend!r} (lmcache is not served: the disk backend is this project's own)")
        disk = {"kv_disk_dir": self.kv_disk_dir, "kv_disk_size": self.kv_disk_size}
        if backend != "disk":
            given = [name for name, value in disk.items() if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} needs kv_offloading_backend 'disk'")
            return
        missing = [name for name, value in {"kv_offloading_size": self.kv_offloading_size, **disk}.items()
                   if value is None]
        if missing:
            raise ValueError(f"kv_offloading_backend 'disk' needs {', '.join(missing)} (the disk tier holds what the "
                             "host tier evicts, in a directory of a bounded size)")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("kv_offloading_backend 'disk' is not implemented with tensor or pipeline parallelism yet "
                             "(its files hold whole blocks, and each rank holds a part of one; the host tier is)")
        size = self.kv_disk_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"kv_disk_size must be a positive number of GiB, got {size!r}")
        self.kv_disk_size = float(size)

    @property
    def world_size(self) -> int:
        """Ranks of one engine group: ``tensor_parallel_size`` in each of ``pipeline_parallel_size`` stages, times
        ``data_parallel_size`` data-parallel attention ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def elastic_expert_group(self) -> bool:
        """Whether this engine's expert-parallel group serves on without a lost data-parallel rank and takes ranks in
        and out while it runs (``engine.group.survival``): each data-parallel rank one process on CPU (gloo,
        ``--tensor-parallel 1``, no stages), two ranks or more (one left alone holds every expert); with EPLB or
        without (its balancer is rebuilt over each new group). Here, torch-free: ``run``'s supervisor reads it too (it restarts a
        lost rank alone there, instead of the gang)."""
        return (self.data_parallel_size > 1 and self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1
                and str(self.device).split(":")[0] == "cpu")

    @property
    def micro_batches(self) -> int:
        """Micro-batches of a step across pipeline stages (1 without stages)."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size

    @property
    def gathers_rows(self) -> bool:
        """Whether the row-parallel layers gather their input (``model.layers.GatheredRowLinear``): under
        ``batch_invariant`` with expert parallelism at TP > 1, so that attention and dense layers compute one rank's
        bits as the MoE layers do, and the log probs are one rank's. With LoRA adapters too: each rank keeps such a
        layer's adapter whole and adds its delta as one rank does (``model.lora.shards``)."""
        return self.batch_invariant and self.enable_expert_parallel and self.tensor_parallel_size > 1

    def trainer_seam_warning(self) -> str | None:
        """What an engine logs at start when its log probs cannot equal the declared trainer's: in the
        batch-invariant mode each tensor-parallel size splits the reductions its own way (bitwise the same
        in any batch at one size, not across sizes), unless the row-parallel layers gather (:attr:`gathers_rows`:
        the engine computes one rank's bits, a trainer's at size 1)."""
        trainer = self.trainer_tensor_parallel_size
        computes_as = 1 if self.gathers_rows else self.tensor_parallel_size
        if not self.batch_invariant or trainer is None or trainer == computes_as:
            return None
        size = (f"{self.tensor_parallel_size} with expert parallelism (computing as one rank)" if self.gathers_rows
                else str(self.tensor_parallel_size))
        return (f"--batch-invariant at tensor-parallel size {size}, but the trainer runs at "
                f"{trainer} (--trainer-tensor-parallel-size): each size splits the reductions its own way, so the "
                "trainer's log probs will differ from the engine's in the last bits; serve at the trainer's size "
                "(docs/batch-invariance.md)")

    def _check_lora(self) -> None:
        optional = ("max_cpu_loras",) if self.max_cpu_loras is not None else ()
        for name in ("max_loras", "max_lora_rank", "max_lora_versions") + optional:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        for name, path in (self.lora_modules or {}).items():
            problem = name_problem(name) or path_problem(name, path)
            if problem is not None:
                raise ValueError(f"lora_modules: {problem}")
        if self.lora_allowed_dirs is not None:
            if isinstance(self.lora_allowed_dirs, str) or not all(isinstance(d, str) and d
                                                                  for d in self.lora_allowed_dirs):
                raise ValueError(f"lora_allowed_dirs must be a list of directories, got {self.lora_allowed_dirs!r}")
            self.lora_allowed_dirs = list(self.lora_allowed_dirs)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so the config can cross a process boundary (msgpack, argv)."""
        data = asdict(self)
        if self.dtype is not None:
            data["dtype"] = dtype_name(self.dtype)
        if self.kv_events_config is not None:
            data["kv_events_config"] = json.loads(self.kv_events_config.to_json())
        return data
