"""CEL rules that several field groups of the CRD share (each group's module adds its own; :mod:`.crd` collects them).

Part of the CRD of :mod:`megatron_operator.crd`; it imports nothing of the operator, so that every ``crd_*``
module may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: A CEL rule's python twin: what the API server's rule says of a spec, for the tests and the operator's own checks.
CelCheck = Callable[[dict[str, Any]], bool]


def one_rank_groups_rule(field: str, message: str) -> tuple[str, str, str, CelCheck]:
    """The rule (schema path, CEL rule, message, python twin) that ``spec.engine.<field>`` needs engine groups of
    one rank, in both spellings of the layout: features that the engine does not serve in a group of several ranks yet
    (a disaggregation role, a disk KV tier), so the CRD refuses them before any pod starts."""

    def check(spec: dict[str, Any]) -> bool:
        engine = spec.get("engine", {})
        if field not in engine:
            return True
        old, new = spec.get("parallelism", {}), engine.get("parallelism", {"tensor": 1, "pipeline": 1})
        return all(int(par.get("tensor", 1)) * int(par.get("pipeline", 1)) == 1 for par in (old, new))

    rule = (f"!has(self.engine.{field}) || (self.parallelism.tensor * self.parallelism.pipeline == 1 "
            "&& (!has(self.engine.parallelism) || self.engine.parallelism.tensor * self.engine.parallelism.pipeline "
            "== 1))")
    return "spec", rule, message, check
