"""The parity search of the engine against itself: each case under two setups that must not change a token.

The rows (``settings.py``) come in turn; each case draws its model, settings and requests as the
search against ``transformers`` does, plus seeded sampled requests (temperature, top-p, top-k,
min-p, penalties, logit bias): a seeded request must draw the same tokens whatever the batch
around it and whatever the setting. The busy-batch row adds other traffic, unseeded sampling included.
"""

from __future__ import annotations

from .cases import Sampling, draw_case
from .compare import TOLERANCES, between_runs
from .engine_runs import run_case
from .settings import SETTINGS, setting_for


def test_engine_equals_itself(case_seed, parity, search_case):
    with search_case("engine against itself", case_seed) as scope:
        model = scope.model
        name = setting_for(case_seed, model.spec)
        scope.tally.settings[name] = scope.tally.settings.get(name, 0) + 1
        setting = SETTINGS[name]
        scope.parts.insert(0, f"setting {name!r}")
        case = draw_case(case_seed, model, Sampling.SEEDED, tensor_parallel=False)
        scope.parts.append(case.describe())
        placement = parity.placement.for_config(setting.a.config_for(case)).for_config(setting.b.config_for(case))
        results_a = run_case(case, model, setting.a, placement)
        counters: dict[str, int] = {}
        results_b = run_case(case, model, setting.b, placement, counters)
        scope.tally.accepted_drafts += counters.get("spec_decode_num_accepted_tokens", 0)
        tolerance = TOLERANCES[placement.dtype]
        problems = [between_runs(draw.name, results_a[draw.name], results_b[draw.name], tolerance, scope.tally)
                    for draw in case.requests]
        problems = [p for p in problems if p]
        assert not problems, "\n".join(problems)
