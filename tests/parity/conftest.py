"""The parity search's fixtures: its options, the models it shares between cases, the summary it prints."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the Triton-kernel setting runs the kernels under the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_serve.config import resolve_dtype  # noqa: E402

from ..helpers import shared_directory  # noqa: E402
from .compare import TALLIES, Tally  # noqa: E402
from .engine_runs import Placement  # noqa: E402
from .models import CASES_PER_MODEL, LoadedModel, ModelPool  # noqa: E402
from .options import INVARIANT_DEFAULT_CASES, ParityOptions  # noqa: E402


@dataclass(frozen=True)
class Parity:
    options: ParityOptions
    placement: Placement  # a case may run elsewhere (Placement.for_config): compare with TOLERANCES[its dtype]


@dataclass
class CaseScope:
    """One case of a search: its model, its search's tally, and what it drew so far (for the reproduction line)."""

    model: LoadedModel
    tally: Tally
    parts: list[str]


SearchCase = Callable[[str, int], contextlib.AbstractContextManager[CaseScope]]


@pytest.fixture
def search_case(request: pytest.FixtureRequest, parity: Parity, model_pool: ModelPool) -> SearchCase:
    """``with search_case(search, seed) as scope:`` counts the case in ``search``'s tally, loads its model,
    and reports any failure inside after one line that says what the case drew and how to rerun it."""
    path = Path(request.node.path).relative_to(Path(request.config.rootpath))

    @contextlib.contextmanager
    def scope(search: str, seed: int) -> Iterator[CaseScope]:
        tally = TALLIES.setdefault(search, Tally())
        tally.cases += 1
        parts = [f"model seed {seed // CASES_PER_MODEL}"]
        try:
            model = model_pool.get(seed // CASES_PER_MODEL)
            parts[0] = f"model {model.spec.describe()}"
            yield CaseScope(model, tally, parts)
        except Exception as exc:
            line = (f"parity case {seed}: {'; '.join(parts)} | reproduce: TRITON_INTERPRET=1 .venv/bin/python -m "
                    f"pytest -q {path} {parity.options.reproduce(seed)}")
            raise AssertionError(f"{line}\n{type(exc).__name__}: {exc}") from exc

    return scope


INVARIANT_SHARE = 4  # the batch-invariant search runs every 4th case: each case costs two engine runs


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    options = ParityOptions.of(metafunc.config)
    if "case_seed" in metafunc.fixturenames:
        seeds = options.seeds
        metafunc.parametrize("case_seed", seeds, ids=[f"case{seed}" for seed in seeds])
    if "invariant_case_seed" in metafunc.fixturenames:
        seeds = options.seeds if options.only is not None else options.seeds_of(INVARIANT_DEFAULT_CASES)[::INVARIANT_SHARE]
        metafunc.parametrize("invariant_case_seed", seeds, ids=[f"case{seed}" for seed in seeds])


@pytest.fixture(scope="package", autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """One intra-op thread while the search runs: its matmuls are tiny, and a second OpenMP thread costs
    more than it saves (a 40x64 by 64x192 linear on the shared 2-core machine: 184 us with two threads,
    53 us with one; this search ran 3 times faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def parity(pytestconfig: pytest.Config) -> Parity:
    options = ParityOptions.of(pytestconfig)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Parity(options, Placement(device, resolve_dtype(options.dtype)))


@pytest.fixture(scope="session")
def model_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelPool]:
    root = shared_directory(tmp_path_factory) / "parity-models"  # the searches' workers write each model once
    root.mkdir(exist_ok=True)
    yield ModelPool(root)
