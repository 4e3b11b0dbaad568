"""Everything a route needs, built once per app: backend, tokenizer, model facts, monitor, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..tokenizer import Tokenizer
from ..generation_config import GenerationDefaults
from ..http_options import HTTPOptions
from ..limits import RequestLimits
from ..multimodal import ImageOptions
from .drain import DrainState, Stopping
from .errors import shutting_down
from .backend import Backend
from .fleet import FleetMonitor
from .generation import PendingCounter, Submission
from .intake import Workers, check_choices, kept_ids_meter
from .live import LiveSubmissions
from .metrics import ServerMetrics
from .params_memo import ParamsMemo
from .request_log import RequestLog
from .tenant_admission import Tenancy
from .translate import EngineJob
from .wake import WakeGate


@dataclass
class ServerContext:
    backend: Backend
    tokenizer: Tokenizer
    model_name: str
    monitor: FleetMonitor
    metrics: ServerMetrics
    pending: PendingCounter
    limits: RequestLimits
    workers: Workers
    vocab_size: int | None = None
    default_max_model_len: int | None = None  # from config.json, until engines report theirs
    tool_parser: str | None = None  # tool-call format read from outputs with tool_choice "auto"
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json
    #: The requests' sampling parameters by their values, validated once per distinct set (:mod:`.params_memo`).
    sampling_memo: ParamsMemo = field(default_factory=ParamsMemo)
    created: int = field(default_factory=lambda: int(time.time()))
    #: Set when the server stops: what it holds is answered with 503 at once, new requests get 503.
    stopping: Stopping = field(default_factory=Stopping)
    #: Admission and the requests admitted, for a drain before the server stops (see :mod:`.drain`).
    drain: DrainState = field(default_factory=DrainState)
    images: ImageOptions = field(default_factory=ImageOptions)  # how chat images are fetched
    options: HTTPOptions = field(default_factory=HTTPOptions)
    request_log: RequestLog = field(default_factory=RequestLog)  # --enable-log-requests
    stream_interval: int = 1  # streamed tokens per chunk (--stream-interval)
    configured_adapters: dict[str, str] = field(default_factory=dict)  # --lora-modules (name -> directory)
    #: What is being answered, by the ids its clients saw (the control routes abort by them: :mod:`.live`).
    live: LiveSubmissions = field(default_factory=LiveSubmissions)
    #: The tenants, their limits and the fleet's saturation (None: no tenants configured; :mod:`.tenant_admission`).
    tenancy: Tenancy | None = None
    #: Requests held while no engine is registered (None: none are held; :mod:`.wake`).
    wake: WakeGate | None = None

    @property
    def accepts_images(self) -> bool:
        """A vision-language model: its tokenizer came with an image processor."""
        return self.tokenizer.images is not None

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served by name (name -> directory): what the engines report (loads and unloads
        while serving included), else the configured ``--lora-modules`` until an engine with LoRA reports."""
        reported = self.monitor.adapters()
        return self.configured_adapters if reported is None else reported

    @property
    def served_names(self) -> list[str]:
        return [self.model_name, *self.adapters]

    def adapter_fields(self, model: str) -> dict[str, object]:
        """The ``SamplingParams`` fields of a request whose ``model`` names a LoRA adapter (none for the base)."""
        return {"lora_name": model} if model != self.model_name and model in self.adapters else {}

    def max_model_len(self) -> int | None:
        """Prompt + generation limit: what the engines report (the tightest), else the model's own."""
        return self.monitor.max_sequence_length() or self.default_max_model_len

    def submit(self, jobs: list[EngineJob], label: str = "") -> Submission:
        """Reserve queue room for ``jobs`` (429 when full) and, with tenants, admit them for the request's tenant
        (429 over its limits, 503 for a sheddable request while the fleet is saturated); the caller awaits or
        streams the result.

        ``label``: the response id (``cmpl-...``, ``chatcmpl-...``), which the request log names."""
        if self.stopping.is_set():
            raise shutting_down()
        check_choices(len(jobs), self.limits.max_choices)  # every route's (completions' was checked on its body)
        ticket = None if self.tenancy is None else self.tenancy.admit(jobs)  # 429, 503; tags the jobs
        try:
            submission = Submission(self.backend, self.metrics, self.pending, self.stopping, jobs, label,
                                    self.request_log, self.stream_interval, ticket=ticket,
                                    meter=kept_ids_meter(jobs, self.limits))
        except BaseException:
            if ticket is not None:
                ticket.close()
            raise
        self.live.add(submission)
        return submission
