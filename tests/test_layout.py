"""The code's shape: no import cycle among the project's modules, no oversized module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"megatron_serve": ROOT / "runtime" / "megatron_serve",
            "megatron_operator": ROOT / "operator" / "megatron_operator",
            "megatron_kernels": ROOT / "kernels" / "megatron_kernels"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports, at module level or inside functions, type-checking blocks excluded."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own parents
                found.add(target)
    return found


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_module_in_runtime_or_operator_is_oversized():
    oversized = {name: n for name, path in _modules().items()
                 if not name.startswith("megatron_kernels") and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not oversized, f"modules over {MAX_LINES} lines (split them by job): {oversized}"


def test_library_modules_do_not_import_cli_code():
    """Only the command line (``cli``, ``commands``) imports the command line: the library (``LocalFleet``
    included) works without it, and the operator package only imports what it runs (its own CLI aside)."""
    modules = _modules()
    cli = ("megatron_serve.cli", "megatron_serve.commands", "megatron_operator.cli", "megatron_operator.commands",
           "megatron_operator.__main__")

    def is_cli(module: str) -> bool:
        return any(module == c or module.startswith(c + ".") for c in cli)

    offenders = {name: sorted(t for t in _imports(name, path, modules) if is_cli(t))
                 for name, path in modules.items() if not is_cli(name)}
    offenders = {name: targets for name, targets in offenders.items() if targets}
    assert not offenders, f"library modules importing CLI code: {offenders}"


def test_http_server_imports_no_torch():
    """The server process tokenizes and checks requests; it never runs a model, so it must not pay torch's
    import (about 1.1 s and 300 MB here) or drag it into a front-end image. Helpers it shares with the engine
    (grammar checks, token texts, stats names) live in torch-free modules outside ``megatron_serve.engine``."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    probe = ("import sys, megatron_serve.server.app, megatron_serve.server.runner, megatron_serve.client.coordinator_client; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] == ['megatron_serve', 'engine']))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"the HTTP server imported {out}"
