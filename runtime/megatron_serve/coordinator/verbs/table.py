"""Every verb's handler on the coordinator's side, one row each (a test checks that every verb has one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...wire.lifecycle import Verb
from .handler import VerbHandler
from .lora import LoadLoraVerb, UnloadLoraVerb
from .memory import ResetPrefixCacheVerb, StopVerb, SuspendVerb
from .pause import PauseVerb
from .refit import RefitVerb
from .scale_ep import ScaleEpVerb

#: Verb -> the handler made from its message (a verb with nothing of its own is the plain :class:`VerbHandler`).
HANDLERS: dict[Verb, Callable[[Any], VerbHandler]] = {
    Verb.PAUSE: PauseVerb,
    Verb.UNPAUSE: VerbHandler,
    Verb.SUSPEND: SuspendVerb,
    Verb.RESUME: VerbHandler,
    Verb.STOP: StopVerb,
    Verb.REFIT: RefitVerb,
    Verb.LOAD_LORA: LoadLoraVerb,
    Verb.UNLOAD_LORA: UnloadLoraVerb,
    Verb.RESET_PREFIX_CACHE: ResetPrefixCacheVerb,
    Verb.SCALE_EP: ScaleEpVerb,
    Verb.STATUS_DETAIL: VerbHandler,
}
