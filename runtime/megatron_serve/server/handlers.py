"""What the completion and chat handlers share: the answer's id and time, the checks every generation request
passes first, and the whole (not streamed) answer, which :mod:`.whole_answers` shapes through the handler."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..limits import Cost
from .context import ServerContext
from .translate import EngineJob, check_common, check_model
from .whole_answers import whole_answer


class GenerationHandler:
    """The base of :class:`~.completions.CompletionHandler` and :class:`~.chat.ChatHandler` (``id_prefix``: their
    answers' id before the request's; each sets ``want_logprobs``, ``jobs`` and ``cost`` as it reads its body)."""

    id_prefix: str
    want_logprobs: bool
    jobs: list[EngineJob]
    cost: Cost

    def __init__(self, ctx: ServerContext, req: Any) -> None:
        self.ctx = ctx
        self.req = req
        self.id = f"{self.id_prefix}-{req.request_id or uuid.uuid4().hex}"  # vLLM: the client's request_id names it
        self.created = int(time.time())
        self.n = req.n or 1
        if req.model is None:  # vLLM's field is optional: the base model then (AReaL's vLLM client sends none)
            req.model = ctx.model_name
        check_model(req.model, ctx.served_names)
        check_common(req)

    @property
    def prompt_logprobs(self) -> int | None:
        return self.req.prompt_logprobs

    async def complete(self) -> Any:
        return await whole_answer(self.ctx, self.jobs, self, self.cost,
                                  self.want_logprobs or self.req.prompt_logprobs is not None, self.id)
