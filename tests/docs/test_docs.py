"""The documentation: generated pages match the code, the site builds with ``mkdocs build --strict``,
and the hand-written pages name every operator Event and condition and every wire header.

A generated page that falls behind its source (a CLI option, a CRD field, an HTTP route or a
metric added without ``make docs``) fails ``test_generated_files_are_current``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def generator():
    return load_script("generate_docs", ROOT / "tools" / "generate_docs.py")


def test_generated_files_are_current():
    stale = generator().stale()
    assert stale == [], f"run `make docs`: {', '.join(map(str, stale))} no longer match the code"


def test_a_cli_option_added_without_regenerating_is_caught(monkeypatch, tmp_path):
    """The staleness check sees a new option (the check above would then fail on the real tree)."""
    gen = generator()
    pages = gen.generated()
    from megatron_serve.commands import control

    add_arguments = control.add_arguments

    def with_extra(parser):
        add_arguments(parser)
        parser.add_argument("--brand-new-option", help="added without running make docs")

    monkeypatch.setattr(control, "add_arguments", with_extra)
    for path, text in pages.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    assert gen.stale(tmp_path) == [Path("docs/reference/cli.md")]
    assert "--brand-new-option" in gen.cli_page()


def test_mkdocs_build_is_strict_clean(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    api = (tmp_path / "site" / "python-api" / "index.html").read_text()
    for name in ("megatron_serve.api.llm.MegatronLLM.generate", "megatron_serve.api.async_llm.MegatronAsyncLLM.serve",
                 "megatron_serve.wire.sampling_params.SamplingParams", "megatron_serve.client.coordinator_client.InferenceClient"):
        assert f'id="{name}"' in api, name  # mkdocstrings rendered the docstrings


def _string(node: ast.AST) -> list[str]:
    """String constants of an expression (a literal, or both arms of ``a if c else b``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _string(node.body) + _string(node.orelse)
    return []


def operator_event_reasons() -> set[str]:
    """Every Event reason the operator can post, read from its source."""
    reasons: set[str] = set()
    for path in (ROOT / "operator" / "megatron_operator").glob("*.py"):
        tree = ast.parse(path.read_text())
        assigned: dict[str, list[str]] = {}  # name -> strings assigned to it (reason = "A" if c else "B")
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).extend(_string(node.value))

        def strings(expr: ast.AST) -> list[str]:
            return assigned.get(expr.id, []) if isinstance(expr, ast.Name) else _string(expr)

        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_event" and len(node.args) >= 3:
                reasons.update(strings(node.args[2]))
            elif isinstance(node, ast.Tuple) and len(node.elts) == 3 and {"Normal", "Warning"} >= set(strings(node.elts[0])) > set():
                reasons.update(strings(node.elts[1]))
    return reasons


def operator_condition_reasons() -> set[str]:
    from megatron_operator.crd import CONDITION_TYPES

    reasons: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / "operator" / "megatron_operator" / "status.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_condition" and len(node.args) >= 5:
            reasons.update(_string(node.args[3]))
    # Ready's reason when not ready is "<first unmet condition>False"
    return reasons | {f"{t}False" for t in CONDITION_TYPES if t not in ("Ready", "SpecValid")}


def test_troubleshooting_names_every_event_condition_and_phase():
    from megatron_operator.crd import CONDITION_TYPES, PHASES

    page = (DOCS / "kubernetes" / "troubleshooting.md").read_text()
    events = operator_event_reasons()
    assert {"Lifecycle", "Refitted", "Created", "Adopted", "StopFailed", "Phase"} <= events  # the scan finds them
    conditions = operator_condition_reasons()
    assert {"Reachable", "Synced", "InvalidSpec"} <= conditions
    missing = [name for name in sorted(events | conditions | set(CONDITION_TYPES) | set(PHASES))
               if f"`{name}`" not in page]
    assert missing == [], f"docs/kubernetes/troubleshooting.md does not explain {missing}"


def test_troubleshooting_names_every_http_error_code():
    codes = set()
    for path in (ROOT / "runtime" / "megatron_serve" / "server").glob("*.py"):
        codes.update(re.findall(r'code="([a-z_]+)"', path.read_text()))
    page = (DOCS / "kubernetes" / "troubleshooting.md").read_text()
    assert {"queue_full", "context_length_exceeded"} <= codes
    assert sorted(c for c in codes if f"`{c}`" not in page) == []


def test_wire_protocol_page_names_every_header_and_error_code():
    from megatron_serve.wire.protocol import ErrorCode, Header

    page = (DOCS / "wire-protocol.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| (\d+) \|", page, flags=re.M))
    assert rows == {h.name: str(h.value) for h in Header}
    assert [c.value for c in ErrorCode if f"`{c.value}`" not in page] == []


def test_readme_is_short_and_points_into_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 90
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert links and all(link.startswith("docs/") and (ROOT / link).exists() for link in links), links
    assert "../" not in readme and "DESIGN" not in readme and "shared/" not in readme


def test_every_page_is_linked_from_the_overview():
    """A page nobody links to is a page nobody finds (parallelism and KV tiers were such pages): every top-level page
    is a row of docs/index.md's "Where to start"."""
    overview = (ROOT / "docs" / "index.md").read_text()
    unlinked = [page.name for page in sorted((ROOT / "docs").glob("*.md"))
                if page.name != "index.md" and f"]({page.name})" not in overview]
    assert not unlinked, unlinked


def test_readme_quick_start_is_two_commands_and_the_image():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n+```bash\n(.*?)```", readme, re.S)
    assert block, "README has no quick start block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make run", "make test", "make image"], commands


def test_code_cites_docs_pages_never_the_contract_outside_the_repository():
    """Docstrings and comments point contributors at ``docs/`` pages (the architecture page holds what they
    need of the engineering contract), not at a design file that is not in the repository."""
    cited = re.compile(r"\bDESIGN(?:\.md|'s|\s+(?:section|sections)?\s*\d)")
    found = []
    for folder in ("runtime", "kernels", "operator", "tests", "docs", "tools", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yaml", ".sh") and path != Path(__file__):
                found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in cited.finditer(path.read_text())]
    assert found == []
    for page in re.findall(r"`(docs/[\w./-]+\.md)`|\((docs/[\w./-]+\.md)", (ROOT / "docs" / "architecture.md").read_text()):
        assert (ROOT / "".join(page)).exists()


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_pages_name_nothing_outside_the_repository(page):
    text = (DOCS / page).read_text()
    assert "../shared" not in text and "DESIGN.md" not in text
    for path in re.findall(r"`((?:manifests|charts|tools|runtime|operator)/[\w./-]+)`", text):
        assert (ROOT / path).exists(), f"{page} names {path}, which does not exist"


def test_the_vllm_page_never_lists_an_exported_series_as_missing():
    """``docs/vllm-mapping.md`` listed ``vllm:lora_requests_info`` among the exported series and among those "not
    exported yet" (issue 54): the generator now refuses a missing-series row that names an exported one."""
    from megatron_serve.server.metric_catalog import VLLM_SERIES

    gen = generator()
    exported = {entry.name for entry in VLLM_SERIES}
    assert "vllm:lora_requests_info" in exported
    assert gen.missing_vllm_series(gen.VLLM_ONLY_SERIES, VLLM_SERIES) == gen.VLLM_ONLY_SERIES
    with pytest.raises(ValueError, match="lists vllm:lora_requests_info, which /metrics exports"):
        gen.missing_vllm_series([("vllm:lora_requests_info", "not exported yet")], VLLM_SERIES)
    page = (DOCS / "vllm-mapping.md").read_text()
    missing = page.split("vLLM series without a twin:", 1)[1]
    assert not [name for name in exported if f"| {name} |" in missing or f"| {name}," in missing]
