"""What every framework's control routes share: the lifecycle verbs a route runs, strict query values, the fleet's
state and shape as the anchors ask for them, aborts by id and the prefix-cache reset.

A control route is a translation: vLLM's ``/pause``, SGLang's ``/pause_generation`` and TRL's nothing-at-all all
end in the lifecycle verbs of :mod:`megatron_serve.wire.lifecycle`, run as ``/v1/admin/{verb}`` runs them
(:func:`..admin.run_verb`: 503 at once without a coordinator, 409 with the lifecycle's reason when a verb is refused
in the fleet's state). The anchors' query strings are parsed here, strictly: FastAPI would take ``mode=Abort`` or
``level=one`` as its own 422, and ignore a parameter it does not know; an RL framework that sent either would run
on something other than what it asked for, so both are a 400 naming the parameter.

Resetting the prefix cache (vLLM's ``/reset_prefix_cache``, SGLang's ``/flush_cache``, TRL's
``/reset_prefix_cache/``) is the RESET_PREFIX_CACHE verb: every engine forgets every cached prefix block, in the
device pool and the host tier, between two steps (its KV events say ``AllBlocksCleared``). A block's key is chained
from the weights' epoch, so after a weight update nothing stale could be found anyway; the reset the frameworks send
then is what makes the cache cold, for a measurement or a fresh start. As vLLM's scheduler, an engine whose running
requests hold blocks does not reset unless ``reset_running_requests`` sends them back to be recomputed: the reset
answers False (vLLM's ``/reset_prefix_cache`` a 409, TRL's message ``status: False``, SGLang's ``/flush_cache`` a
400 with its own text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, TypeVar

from fastapi import Request

from ...wire.lifecycle import FleetState, Verb
from ..admin import run_verb
from ..errors import APIError, bad_request

if TYPE_CHECKING:  # annotations only: the context's imports are deep, and the routes' modules hold one
    from ..context import ServerContext

T = TypeVar("T")

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def query_doc(*parameters: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    """``openapi_extra`` listing a route's query parameters (``name``, JSON schema, what it does): the routes read
    them themselves (:class:`Query`), so FastAPI does not see them."""
    return {"parameters": [{"name": name, "in": "query", "required": False, "schema": schema, "description": about}
                           for name, schema, about in parameters]}


def one_of(*values: Any) -> dict[str, Any]:
    """The JSON schema of a query parameter that takes one of ``values``."""
    return {"enum": list(values)}


FLAG: dict[str, Any] = {"type": "boolean"}


class Control:
    """The lifecycle verbs and the fleet's facts, for the control routes of one app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.backend = ctx.backend

    async def run(self, route: str, verb: Verb, **arguments: Any) -> dict[str, Any]:
        """Run ``verb`` for ``route`` (the route's path names it in every refusal) and return its acknowledgement."""
        return await run_verb(self.ctx.monitor, route, lambda: self.backend.control(verb, **arguments))

    async def state(self, route: str) -> str:
        """The fleet's state as of now (a poll of its own: a pause a moment ago shows); 503 without a coordinator."""
        monitor = self.ctx.monitor
        await monitor.refresh()
        if not monitor.reachable or monitor.state is None:
            raise APIError(503, f"{route}: {monitor.refusal_reason()}", code="coordinator_unreachable",
                           headers={"Retry-After": "5"})
        return monitor.state

    async def not_stepping(self, route: str) -> bool:
        """Whether the fleet does not step now (paused, suspended or stopped): vLLM's ``is_paused``."""
        return await self.state(route) != FleetState.RUNNING.value

    def shape(self) -> "FleetShape":
        return FleetShape.of(self.ctx.monitor.engines)

    def abort(self, request_ids: list[str] | None) -> int:
        """End the submissions ``request_ids`` name (None or empty: every one in flight) with ``finish_reason``
        ``abort`` and their tokens so far (:meth:`~..generation.Submission.cut`); how many engine requests ended."""
        live = self.ctx.live
        return sum(submission.cut() for submission in (live.named(request_ids) if request_ids else live.unfinished()))

    async def reset_prefix_cache(self, route: str, reset_running_requests: bool = False) -> bool:
        """RESET_PREFIX_CACHE on every engine: True when every one reset (see the module docstring), False when
        running requests kept one from it; 503 without a coordinator, 409 in STOPPED."""
        ack = await self.run(route, Verb.RESET_PREFIX_CACHE, reset_running_requests=reset_running_requests)
        return (ack.get("detail") or {}).get("reset") is True


@dataclass(frozen=True)
class FleetShape:
    """The parallel layout of the fleet as the anchors report theirs: every engine is a data-parallel replica of
    ``tensor x pipeline`` ranks (the first engine's layout; a fleet's engines share one)."""

    tensor: int
    pipeline: int
    data: int
    expert: bool

    @classmethod
    def of(cls, engines: list[dict[str, Any]]) -> "FleetShape":
        info = dict(engines[0].get("info") or {}) if engines else {}
        return cls(int(info.get("tensor_parallel_size") or 1), int(info.get("pipeline_parallel_size") or 1),
                   max(len(engines), 1), bool(info.get("expert_parallel")))

    @property
    def world_size(self) -> int:
        """Ranks of one replica (vLLM's ``parallel_config.world_size``)."""
        return self.tensor * self.pipeline

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.data

    @property
    def expert_size(self) -> int:
        """SGLang's ``ep_size``: the ranks that split the experts (a replica's, with expert parallelism)."""
        return self.world_size if self.expert else 1


class Query:
    """A request's query string, read strictly: each parameter once, of its kind; :meth:`done` refuses the rest."""

    def __init__(self, request: Request) -> None:
        self._items = list(request.query_params.multi_items())
        self._read: set[str] = set()

    def _one(self, name: str) -> str | None:
        self._read.add(name)
        values = [value for key, value in self._items if key == name]
        if len(values) > 1:
            raise bad_request(f"{name} is given {len(values)} times; give it once", param=name)
        return values[0] if values else None

    def text(self, name: str) -> str | None:
        """The parameter as given, once; None: absent."""
        return self._one(name)

    def flag(self, name: str, default: bool) -> bool:
        value = self._one(name)
        if value is None:
            return default
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise bad_request(f"{name} must be true or false, got {value!r}", param=name)

    def choice(self, name: str, choices: Iterable[T], default: T) -> T:
        """One of ``choices`` (compared as text: ``level=1`` is the int 1)."""
        value = self._one(name)
        if value is None:
            return default
        by_text = {str(choice): choice for choice in choices}
        if value not in by_text:
            raise bad_request(f"{name} must be one of {', '.join(by_text)}; got {value!r}", param=name)
        return by_text[value]

    def choices(self, name: str, choices: Iterable[str]) -> list[str] | None:
        """Every value of a repeated parameter (vLLM's ``?tags=a&tags=b``), each one of ``choices``; None: absent."""
        self._read.add(name)
        values = [value for key, value in self._items if key == name]
        allowed = list(choices)
        for value in values:
            if value not in allowed:
                raise bad_request(f"{name} must be one of {', '.join(allowed)}; got {value!r}", param=name)
        return values or None

    def done(self) -> None:
        """Refuse a parameter no reader asked for (it would be ignored, and the route do something else)."""
        unknown = sorted({key for key, _ in self._items} - self._read)
        if unknown:
            raise bad_request(f"unknown query parameter {unknown[0]}: this route takes "
                              f"{', '.join(sorted(self._read)) or 'none'}", param=unknown[0],
                              code="unsupported_parameter")
