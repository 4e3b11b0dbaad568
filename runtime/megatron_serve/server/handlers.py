"""What the completion and chat handlers share: the answer's id and time, the checks every generation request
passes first, and the whole (not streamed) answer, which :mod:`.whole_answers` shapes through the handler."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from ..limits import Cost
from ..wire.sampling_params import SamplingParams
from .context import ServerContext
from .intake import check_budget
from .translate import EngineJob, Prompt, check_common, check_model, make_jobs, sampling_params
from .whole_answers import whole_answer


class GenerationHandler:
    """The base of :class:`~.completions.CompletionHandler` and :class:`~.chat.ChatHandler` (``id_prefix``: their
    answers' id before the request's; each sets ``want_logprobs`` as it reads its body, and ``jobs`` and ``cost``
    through :meth:`plan`)."""

    id_prefix: str
    want_logprobs: bool
    jobs: list[EngineJob]
    cost: Cost

    def __init__(self, ctx: ServerContext, req: Any) -> None:
        self.ctx = ctx
        self.req = req
        # vLLM: the client's request_id names it; else 32 random hex digits as a uuid4's, without the UUID object
        # (1.8 -> 0.4 us): unguessable, since the control routes abort a request by the id its client saw
        self.id = f"{self.id_prefix}-{req.request_id or os.urandom(16).hex()}"
        self.created = int(time.time())
        self.n = req.n or 1
        if req.model is None:  # vLLM's field is optional: the base model then (AReaL's vLLM client sends none)
            req.model = ctx.model_name
        check_model(req.model, ctx.served_names)
        check_common(req)

    def plan(self, prompts: list[Prompt], max_tokens: Callable[[Prompt], int], top_n: int, extra: dict[str, Any],
             returns_prompt: bool) -> None:
        """The request's engine requests, ``n`` per prompt, each with its sampling parameters (``max_tokens`` of its
        prompt, ``top_n`` alternatives, the ``extra`` controls), and their cost checked against the request budget
        (``returns_prompt``: the answer repeats each prompt)."""
        def params_for(prompt: Prompt, choice: int) -> SamplingParams:
            return sampling_params(self.req, max_tokens=max_tokens(prompt), logprobs=self.want_logprobs,
                                   top_logprobs=top_n, choice=choice, defaults=self.ctx.generation_defaults,
                                   extra=extra, memo=self.ctx.sampling_memo)

        self.jobs = make_jobs(prompts, self.n, params_for)
        self.cost = check_budget(self.jobs, self.ctx.limits, returns_prompt=returns_prompt)

    @property
    def prompt_logprobs(self) -> int | None:
        return self.req.prompt_logprobs

    async def complete(self) -> Any:
        return await whole_answer(self.ctx, self.jobs, self, self.cost,
                                  self.want_logprobs or self.req.prompt_logprobs is not None, self.id)
