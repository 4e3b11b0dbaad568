"""How fast one tenant is told no: a tenant's shed refusals beyond a rate are answered later, not at once.

A 503 costs the server's event loop a request's parsing and answer, and a flood that sends every refused request
straight back (ignoring ``Retry-After``) turns that into all of the loop: 200 connections of a ``sheddable`` tenant
against a saturated fleet were refused 400 times a second, and the ``critical`` tenant's requests, whose tokens pass
through the same loop, waited behind them (docs/tenants.md has the figures). Held
refusals cost a sleeping coroutine each: a flood then gets its answers at :data:`REFUSALS_PER_SECOND`, however many
connections it holds, while clients that honour ``Retry-After`` meet the hold only past that rate.

The schedule is the generic cell rate algorithm (a token bucket kept as one time per tenant, the "theoretical
arrival time"): a burst of :data:`REFUSAL_BURST` is answered at once, then one refusal each ``1 / rate`` seconds;
a refusal is never held longer than :data:`MOST_HELD` (a flood of more connections than the rate and that time
allow is answered as fast as its holds end, ``connections / MOST_HELD`` a second).
"""

from __future__ import annotations

import time
from typing import Callable

#: A tenant's shed refusals answered at once per second, after its burst.
REFUSALS_PER_SECOND = 50.0
#: Refusals a tenant may meet at once before its refusals are paced.
REFUSAL_BURST = 50
#: The longest a refusal is held, in seconds: under any client's time-out.
MOST_HELD = 10.0
#: Tenants' schedules kept at most (the oldest are dropped past it: a dropped tenant starts with a full burst).
MAX_TENANTS = 10_000


class RefusalPace:
    """When each tenant's next refusal may be answered (module docstring)."""

    def __init__(self, rate: float = REFUSALS_PER_SECOND, burst: int = REFUSAL_BURST, most: float = MOST_HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or burst < 1 or most < 0:
            raise ValueError(f"a refusal pace needs rate > 0, burst >= 1 and most >= 0, got {rate}, {burst}, {most}")
        self.interval = 1.0 / rate
        self.window = burst * self.interval  # how far ahead of now a tenant's schedule may run with no hold
        self.most = most
        self.clock = clock
        self.due: dict[str, float] = {}  # by tenant: when its schedule has room again (the cell rate's arrival time)

    def hold(self, tenant: str) -> float:
        """Seconds to hold ``tenant``'s refusal now before answering it (0: answer at once); counts it."""
        now = self.clock()
        # held at most `most`: the schedule runs no further ahead than that, or a flood would push it out forever
        due = min(max(self.due.pop(tenant, now), now) + self.interval, now + self.window + self.most)
        if len(self.due) >= MAX_TENANTS:
            del self.due[next(iter(self.due))]
        self.due[tenant] = due  # most recent last: the first key is the tenant refused longest ago
        hold = due - now - self.window
        return hold if hold > 1e-9 else 0.0  # the burst's last one lands on the window, give or take a rounding
