"""One version everywhere: the distribution, the code, the CLI, the image, the chart and the manifests.

``megatron_serve.__version__`` is the single source (pyproject.toml reads it); everything that
names a version or an image tag must equal it, so a release cannot ship an image, chart or
manifest that points at another build.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import yaml

import megatron_operator
from megatron_operator.config import DEFAULT_IMAGE
from megatron_serve import __version__
from megatron_serve.cli import main

ROOT = Path(__file__).resolve().parents[2]
IMAGE_REPOSITORY = "ghcr.io/megatron-serve/megatron-serve"


def test_the_distribution_and_the_packages_report_one_version(capsys) -> None:
    assert importlib.metadata.version("megatron-serve") == __version__
    assert megatron_operator.__version__ == __version__
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"megatron-serve {__version__}"
    assert DEFAULT_IMAGE == f"{IMAGE_REPOSITORY}:{__version__}"


def test_the_trainer_distribution_has_this_version() -> None:
    """``megatron-serve-invariant`` (packaging/) is built from this tree: its version is this one."""
    assert (ROOT / "packaging" / "megatron-serve-invariant" / "VERSION").read_text().strip() == __version__


def test_the_openapi_document_carries_the_version() -> None:
    from megatron_serve.server import create_app
    from tests.server.fakes import FakeBackend

    app = create_app(FakeBackend(tokenizer=None), None, "m", vocab_size=8, max_model_len=16)
    assert app.openapi()["info"]["version"] == __version__


def test_the_image_label_equals_the_version() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG VERSION=(\S+)$", dockerfile, re.M).group(1) == __version__
    assert 'org.opencontainers.image.version="${VERSION}"' in dockerfile


def test_the_chart_and_manifests_name_this_version() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "megatron-operator" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert chart["version"] == __version__
    kustomization = yaml.safe_load((ROOT / "manifests" / "kustomization.yaml").read_text())
    assert [image["newTag"] for image in kustomization["images"]] == [__version__]
    images = re.findall(rf"{re.escape(IMAGE_REPOSITORY)}:(\S+)", "\n".join(
        p.read_text() for p in sorted((ROOT / "manifests").rglob("*.yaml"))))
    assert images and set(images) == {__version__}


def test_helm_template_with_default_values_runs_this_version() -> None:
    import helm_python

    with helm_python.Chart.load(str(ROOT / "charts" / "megatron-operator")) as chart:
        manifests = chart.render({}, name="megatron", namespace="megatron-system")
    pods = [doc["spec"]["template"]["spec"] for path, text in manifests.items()
            if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "Deployment"]
    images = {c["image"] for pod in pods for c in pod["containers"]}
    assert images == {f"{IMAGE_REPOSITORY}:{__version__}"}
