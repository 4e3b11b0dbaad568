"""How the OpenAI server behaves beyond its request limits: tool calls, CORS, logs, metric names.

:class:`HTTPOptions` is built once from the command line (:meth:`HTTPOptions.from_args`, vLLM's
flags among them: ``--tool-call-parser``, ``--allowed-origins``, ``--enable-log-requests`` ...) or
given to ``create_app`` / ``serve_async_llm`` directly. It is light (no FastAPI) so that the
commands can build and check it before anything starts.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Literal

#: Tool-call formats the server reads (``--tool-call-parser``); ``qwen3_xml`` is ``qwen3_coder``'s format.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "qwen3_xml")
#: ``--metrics-compat``: ``vllm`` also exports the ``vllm:``-named series (megatron_serve.server.vllm_metrics).
METRICS_COMPAT = ("vllm", "none")
#: Seconds between two stats log lines (vLLM's ``VLLM_LOG_STATS_INTERVAL`` default).
STATS_INTERVAL = 10.0


@dataclass(frozen=True)
class CORS:
    """Cross-origin access for browser pages (Starlette's ``CORSMiddleware`` settings)."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(frozen=True)
class WakeOptions:
    """Scale from zero (:mod:`megatron_serve.server.wake`): ``timeout``, how long a request waits for a first engine
    (``--scale-from-zero-timeout``; 0, the default: holding is off, as in vLLM a server without an engine is not
    ready); ``queue``, how many may wait at once (``--scale-from-zero-queue``; 0: none, a 503 at once)."""

    timeout: float = 0.0
    queue: int = 256

    def __post_init__(self) -> None:
        if not (self.timeout >= 0 and math.isfinite(self.timeout)):
            raise ValueError(f"--scale-from-zero-timeout must be a number of seconds >= 0 (0: off), got "
                             f"{self.timeout!r}")
        if isinstance(self.queue, bool) or not isinstance(self.queue, int) or self.queue < 0:
            raise ValueError(f"--scale-from-zero-queue must be an integer >= 0, got {self.queue!r}")

    @property
    def enabled(self) -> bool:
        """Whether requests are held at all (with ``queue`` 0 every one is refused at once, and ``/ready`` is 503)."""
        return self.timeout > 0


@dataclass(frozen=True)
class HTTPOptions:
    """``auto_tool_choice`` with ``tool_call_parser`` (vLLM's ``--enable-auto-tool-choice --tool-call-parser``,
    given together): ``tool_choice: auto`` reads calls in that format whatever the chat template;
    without them, in the format the template shows (when it shows one). ``cors``: None = no cross-origin access. ``log_requests``: one
    log line per request arriving and ending, its prompt cut to ``max_log_len`` characters.
    ``log_stats``: a throughput / queue / KV-cache line every ``stats_interval`` seconds while busy.
    ``uvicorn_log_level`` (None: the server's log level) and ``access_log``: uvicorn's own log.
    ``metrics_compat``: ``"vllm"`` adds the ``vllm:`` series to ``/metrics``. ``docs``: serve
    ``/docs``, ``/redoc`` and ``/openapi.json``. ``weight_transfer_backend``: vLLM's ``--weight-transfer-config``
    backend (``nccl``, or ``gloo`` for CPU trainers) through which a trainer's group pushes weights to the weight
    routes (:mod:`megatron_serve.server.rl.weight_updates`); None: no trainer group is joined.
    """

    tool_call_parser: str | None = None
    auto_tool_choice: bool = False
    cors: CORS | None = None
    log_requests: bool = False
    max_log_len: int | None = None
    log_stats: bool = True
    stats_interval: float = STATS_INTERVAL
    uvicorn_log_level: str | None = None
    access_log: bool = True
    metrics_compat: Literal["vllm", "none"] = "vllm"
    docs: bool = True
    weight_transfer_backend: Literal["nccl", "gloo"] | None = None
    wake: WakeOptions = field(default_factory=WakeOptions)  # requests held while no engine is registered

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.auto_tool_choice != (self.tool_call_parser is not None):  # vLLM's pairing: both or neither
            if self.auto_tool_choice:
                raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                                 f"{', '.join(TOOL_CALL_PARSERS)}): the format the model writes its calls in")
            raise ValueError(f"--tool-call-parser {self.tool_call_parser} takes effect with --enable-auto-tool-choice "
                             "(as in vLLM): add it")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if not self.stats_interval > 0:
            raise ValueError(f"the stats interval must be > 0, got {self.stats_interval}")
        if self.metrics_compat not in METRICS_COMPAT:
            raise ValueError(f"--metrics-compat must be one of {', '.join(METRICS_COMPAT)}, got {self.metrics_compat!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HTTPOptions":
        """From the flags of ``run``, ``serve`` and ``server`` (``ValueError`` names a bad one)."""
        cors = None
        if args.allowed_origins:
            cors = CORS(tuple(args.allowed_origins), tuple(args.allowed_methods or ("*",)),
                        tuple(args.allowed_headers or ("*",)), bool(args.allow_credentials))
        elif args.allowed_methods or args.allowed_headers or args.allow_credentials:
            raise ValueError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins "
                             "(no origin may call the API cross-origin without it)")
        return cls(tool_call_parser=args.tool_call_parser, auto_tool_choice=args.enable_auto_tool_choice, cors=cors,
                   log_requests=args.log_requests, max_log_len=args.max_log_len,
                   log_stats=not args.disable_log_stats, uvicorn_log_level=args.uvicorn_log_level,
                   access_log=not args.disable_uvicorn_access_log, metrics_compat=args.metrics_compat,
                   docs=not args.disable_fastapi_docs,
                   weight_transfer_backend=(args.weight_transfer_config or {}).get("backend"),
                   wake=WakeOptions(args.scale_from_zero_timeout, args.scale_from_zero_queue))


#: The Gateway API Inference Extension's header naming a request's tenant (its fairness id).
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


@dataclass(frozen=True)
class Shedding:
    """When the fleet counts as saturated, so that ``sheddable`` requests get a 503 with ``Retry-After`` instead of
    a place in an unbounded queue (the Gateway API Inference Extension's saturation detector): every engine has at
    least ``queue_depth`` requests waiting (its own queue and its share of the coordinator's) or ``kv_cache_usage``
    of its KV blocks in use, or the fleet's last status is older than ``stale_after`` seconds. None turns one
    signal off. ``retry_after``: the seconds a shed request is told to wait."""

    queue_depth: float | None = 8.0
    kv_cache_usage: float | None = 0.95
    stale_after: float | None = 5.0
    retry_after: int = 1

    def __post_init__(self) -> None:
        for name in ("queue_depth", "stale_after"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"shedding's {name} must be > 0 (None: off), got {value!r}")
        if self.kv_cache_usage is not None and not 0 < self.kv_cache_usage <= 1:
            raise ValueError(f"shedding's kv_cache_usage must be in (0, 1] (None: off), got {self.kv_cache_usage!r}")
        if isinstance(self.retry_after, bool) or not isinstance(self.retry_after, int) or self.retry_after < 1:
            raise ValueError(f"shedding's retry_after must be a whole number of seconds >= 1, got {self.retry_after!r}")


@dataclass(frozen=True)
class TenancyOptions:
    """The server's tenancy settings besides the key file: ``header``, the fairness header (None: the Gateway API
    Inference Extension's, read only when the key file is a document; "" never read; a name: read, tenants on even
    with a single key or none), and ``shedding``."""

    header: str | None = None
    shedding: Shedding = field(default_factory=Shedding)

    @property
    def header_name(self) -> str | None:
        """The header read for a fairness id, lowercase (None: none)."""
        if self.header == "":
            return None
        return (self.header or FAIRNESS_HEADER).lower()

    @classmethod
    def from_args(cls, args: Any) -> "TenancyOptions":
        """From ``--tenant-header`` and the ``--shed-*`` flags (0 turns a signal off); ``ValueError`` names a bad one."""
        def off(value: float | None) -> float | None:
            return None if value is not None and value == 0 else value

        defaults = Shedding()
        shedding = Shedding(
            queue_depth=off(args.shed_queue_depth) if args.shed_queue_depth is not None else defaults.queue_depth,
            kv_cache_usage=(off(args.shed_kv_cache_usage) if args.shed_kv_cache_usage is not None
                            else defaults.kv_cache_usage),
            stale_after=off(args.shed_stale_after) if args.shed_stale_after is not None else defaults.stale_after,
            retry_after=args.shed_retry_after if args.shed_retry_after is not None else defaults.retry_after)
        return cls(args.tenant_header, shedding)
