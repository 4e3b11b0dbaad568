"""The parity search against ``transformers``: seeded random cases, greedy tokens equal wherever the logits decide.

Each case draws a model (``models.py``: every supported architecture in turn, random shapes), engine
settings and several requests (``cases.py``), runs them together through the engine, and runs each
request alone through ``transformers`` (``reference.py``). Every request must produce the reference's
tokens, with their log probs, up to the end or to a near-tie (``compare.py`` states the margin).
"""

from __future__ import annotations

from .cases import context_of, draw_case
from .compare import TOLERANCES, against_reference
from .engine_runs import Setup, run_case
from .reference import run_reference


def test_engine_equals_transformers(case_seed, parity, search_case):
    with search_case("against transformers", case_seed) as scope:
        model = scope.model
        case = draw_case(case_seed, model)
        scope.parts.append(case.describe())
        placement = parity.placement.for_config(case.config)
        results = run_case(case, model, Setup(), placement)
        length = case.config.get("max_sequence_length") or context_of(model)
        problems = [against_reference(draw.name, results[draw.name],
                                      run_reference(model, draw, placement.device, placement.dtype, length),
                                      TOLERANCES[placement.dtype], scope.tally) for draw in case.requests]
        problems = [p for p in problems if p]
        assert not problems, "\n".join(problems)
