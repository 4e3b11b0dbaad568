"""The base of every message body and the id types bodies share (docs/wire-protocol.md).

Apart from the bodies themselves so that each concern's module (handshake, submission, deltas, controls,
rendezvous, status) builds on it without importing the others.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

TokenId = Annotated[int, msgspec.Meta(ge=0)]
#: Ids that foreign clients chose may be ints; this project always sends strings.
ClientId = Union[str, int]


class Body(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Base of every message body."""

