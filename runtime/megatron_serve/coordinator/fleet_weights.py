"""Which weights the fleet serves: the refit transaction's record on the coordinator's side.

The model directory engines start from, the generation (``epoch``) every engine should hold and where it came from
(``source``: None while nothing was refitted, the model directory itself being current), the adapters LOAD_LORA
loaded (engines that join load them too). Refit and LOAD_LORA write it (:mod:`.verbs`), registration reads it to
bring a joining engine up to date (:mod:`.handshake`), dispatch to route only to engines that hold it.
"""

from __future__ import annotations

from typing import Iterable

from ..wire.rendezvous import RENDEZVOUS_SCHEME
from .peers import EngineRecord


class FleetWeights:
    """The fleet's weights generation and adapters (see the module docstring)."""

    def __init__(self, model: str | None = None, tokenizer_dir: str | None = None) -> None:
        """``tokenizer_dir``: only announced to clients (HELLO_ACK), which tokenize and make the text; the
        coordinator loads no tokenizer."""
        self.model = model
        self.tokenizer_dir = tokenizer_dir
        self.epoch = 0
        self.source: str | None = None
        self.refits = 0
        self.loaded_loras: dict[str, str] = {}  # LOAD_LORA's adapters (name -> path)

    def incomplete(self, engines: Iterable[EngineRecord]) -> list[str]:
        """Engines a failed refit left with a mix of two generations (epoch -1): UNPAUSE waits for a refit."""
        return sorted(e.engine_id for e in engines if e.epoch == -1)

    def served_by(self, engine: EngineRecord) -> bool:
        """Whether requests may go to ``engine``: when the fleet's weights, or the engine's, came from a
        trainer, only if it holds the fleet's epoch (one that joined later, or that a failed transfer
        left on other weights, waits unrouted for the next refit to include it)."""
        if engine.epoch == self.epoch:  # asked per dispatch: the common answer first, without a generator
            return True
        return not ((self.source or "").startswith(RENDEZVOUS_SCHEME)
                    or (engine.weights or "").startswith(RENDEZVOUS_SCHEME))
