"""The trainer-only distribution, ``megatron-serve-invariant`` (``packaging/megatron-serve-invariant``): built
from this tree (sdist, then the wheel from it), installed into a fresh venv with torch 2.13.0 CPU, its
dependencies torch and transformers only; there the recipe, run from outside the checkout on packed and
left-padded batches, gives the log probs the engine (this checkout's) reported, ``==``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_serve import __version__
from megatron_serve.model.tiny import make_tiny_model

from ..invariance.runs import run_prompts
from .test_release import ROOT, build_distributions, fresh_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PACKAGE = ROOT / "packaging" / "megatron-serve-invariant"


@pytest.fixture(scope="module")
def trainer_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the wheel, the venv's python, a working directory outside the checkout)."""
    work = tmp_path_factory.mktemp("trainer-release")
    dist = work / "dist"
    build_distributions(PACKAGE, dist, "--sdist", "--wheel", cwd=work)
    (wheel,) = dist.glob("*.whl")
    venv = fresh_venv(work, wheel)
    outside = work / "outside"
    outside.mkdir()
    shutil.copy(Path(__file__).with_name("trainer_recipe.py"), outside)
    return wheel, venv / "bin" / "python", outside


def test_the_wheel_holds_the_op_set_and_asks_for_torch_and_transformers_only(trainer_venv):
    wheel, _, _ = trainer_venv
    assert wheel.name.startswith(f"megatron_serve_invariant-{__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip() for line in archive.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    assert {"megatron_kernels/invariant_trainer.py", "megatron_kernels/invariant_attention.py",
            "megatron_kernels/py.typed"} <= names
    assert not any(name.startswith(("megatron_serve/", "megatron_operator/")) for name in names)
    assert sorted(r.split(">")[0].split("<")[0].split("=")[0] for r in requires) == ["torch", "transformers"]


def test_the_recipe_in_a_venv_with_only_the_trainer_install_gives_the_engines_log_probs(trainer_venv, tmp_path):
    _, python, outside = trainer_venv
    model = make_tiny_model(tmp_path / "llama", seed=0, arch="llama")
    runs = run_prompts(str(model), "float32", [[7, 8, 9] * 10, [11, 12] * 7, [13] * 40], tokens=8)
    runs_path = tmp_path / "runs.json"
    runs_path.write_text(json.dumps([{"prompt": r.prompt, "tokens": r.tokens} for r in runs]))
    done = subprocess.run([str(python), "trainer_recipe.py", str(model), str(runs_path)], cwd=outside,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env={"PATH": str(python.parent), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": str(torch.get_num_threads())})  # the engine's, here
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["server_importable"] == []
    engine = [r.log_probs for r in runs]
    assert report["packed"] == engine
    assert report["left_padded"] == engine
