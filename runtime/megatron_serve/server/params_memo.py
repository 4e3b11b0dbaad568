"""The sampling parameters of a request, validated once per distinct set rather than once per request.

The request's pydantic model has already checked each value against its row of the table; building
``SamplingParams`` from them checks every row again, and the checks that relate fields (min_tokens against
max_tokens, ignore_eos against termination_id, ...): 12-14 us of a plain streamed request's ~600 in this
process, for values that clients send over and over (the same temperature, top_p and max_tokens, request after
request). :class:`ParamsMemo` keeps the ``SamplingParams`` each distinct set of arguments built and hands out a
copy of it, so a repeated set costs its key (one msgpack encoding) and a copy; a new set, or one that is refused,
takes the whole construction, so every refusal is the one ``SamplingParams`` words (nothing refused is kept).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..generation_config import GenerationDefaults
from ..wire.sampling_params import SamplingParams

_KEY = msgspec.msgpack.Encoder()


class ParamsMemo:
    """``GenerationDefaults.sampling_params`` remembering what it built, by its arguments' msgpack (which tells
    ``1`` from ``1.0`` and ``True``, and a list from a map; arguments it cannot encode are built every time).

    Each answer is a copy, its lists and maps copied too, so no request sees another's changes. The memo is for
    one ``GenerationDefaults`` at a time: given others, it starts again. At ``size`` sets it is emptied."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._defaults: GenerationDefaults | None = None
        #: key -> (the validated parameters, the names of their list and map fields)
        self._known: dict[bytes, tuple[SamplingParams, tuple[str, ...]]] = {}

    def sampling_params(self, defaults: GenerationDefaults, fields: dict[str, Any]) -> SamplingParams:
        """``defaults.sampling_params(**fields)``, or a copy of what the same ``fields`` built before."""
        if defaults is not self._defaults:
            self._defaults = defaults
            self._known.clear()
        try:
            key = _KEY.encode(fields)
        except TypeError:  # a value msgpack does not take: nothing to key it by
            return defaults.sampling_params(**fields)
        known = self._known.get(key)
        if known is None:
            params = defaults.sampling_params(**fields)
            if len(self._known) >= self.size:
                self._known.clear()
            known = self._known[key] = (params, tuple(
                name for name in params.__struct_fields__ if type(getattr(params, name)) in (list, dict)))
        params, containers = known
        copy = params.__copy__()
        for name in containers:
            setattr(copy, name, getattr(params, name).copy())
        return copy
