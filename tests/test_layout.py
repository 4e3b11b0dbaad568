"""The code's shape, held as figures: no import cycle among the project's modules, no oversized module or
function, at most 12 modules left flat in ``megatron_serve`` (the rest live in wings by process), import
chains at most MAX_IMPORT_DEPTH floors deep, and an engine side that never imports the
client."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"megatron_serve": ROOT / "runtime" / "megatron_serve",
            "megatron_operator": ROOT / "operator" / "megatron_operator",
            "megatron_kernels": ROOT / "kernels" / "megatron_kernels"}
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_FLAT_MODULES = 12
#: The issue's aim, held since model/'s layers import their configs for annotations only (the deepest
#: chain: client.local_engine -> engine -> core -> verbs.memory -> weights.sources -> model.loader -> ...), and one
#: floor more since the table of sampling parameters (wire.sampling_fields, importing nothing) sits beneath
#: SamplingParams and the server's list of extensions, both at the foot of the server's twelve floors
#: (server -> local -> app -> ... -> context -> generation -> wire.connection -> ... -> wire.sampling_params).
MAX_IMPORT_DEPTH = 13
#: What a function over MAX_FUNCTION_LINES says in its docstring to stay whole: ``Long: <the reason>``.
LONG_REASON = "Long:"


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests here (most walk every module's: ~1 s of CPU a pass).
    The tests only read the trees."""
    return ast.parse(path.read_text())


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The project modules one import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):  # a package's own parents
            found.add(target)
    return found


def _module_level_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that importing ``name`` imports at once (not inside functions, not for type checkers)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    walk(node.body)
                    walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    walk(block)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_targets(node, name, is_package, modules))

    walk(_tree(path).body)
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports, at module level or inside functions, type-checking blocks excluded."""
    tree = _tree(path)
    is_package = path.name == "__init__.py"
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) not in skipped and isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_targets(node, name, is_package, modules))
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


#: The engine's and the model's wings (issue 64): a module there over this holds a second job, which gets a module
#: (or a folder) of its own before the next layout forces a move.
MAX_WING_LINES = 500
WINGS_UNDER_500 = ("megatron_serve.engine", "megatron_serve.model")
#: Modules over MAX_WING_LINES when the rule came, each with its reason (still under MAX_LINES); an entry goes once
#: its module is split (the test fails while it names a module at or under MAX_WING_LINES).
OVER_500: dict[str, str] = {}


def test_no_module_in_the_engine_or_the_model_is_over_500_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()
             if name.startswith(WINGS_UNDER_500)}
    oversized = {name: n for name, n in sizes.items() if n > MAX_WING_LINES and name not in OVER_500}
    assert not oversized, f"engine or model modules over {MAX_WING_LINES} lines (split them by job): {oversized}"
    split = sorted(name for name in OVER_500 if sizes.get(name, 0) <= MAX_WING_LINES)
    assert not split, f"modules in OVER_500 that are {MAX_WING_LINES} lines or fewer now (drop them there): {split}"


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


#: Flat modules named after vLLM's (``vllm.inputs``, ``vllm.outputs``, ``vllm.sampling_params``), so that a script's
#: imports work with the package name replaced: names only, each re-exporting what a wing defines.
VLLM_NAMESAKES = frozenset({"inputs", "outputs", "sampling_params"})


def test_no_module_imports_the_package_root():
    """The root re-exports the Python API, which stands above every other wing: a wing that imported the root (for the
    version or the lazy-export helper, as ``model`` and ``server`` did) imported back up the tree. What the root shares
    with its wings lives in ``megatron_serve.package``, beneath them all."""
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        if not name.startswith("megatron_serve."):
            continue
        depth = len(name.split(".")) + (1 if path.name == "__init__.py" else 0)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                root_names = [alias.name for alias in node.names if alias.name == "megatron_serve"]
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".")[: depth - node.level] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                # ``from megatron_serve import cli`` loads a submodule, not a name of the root's
                root_names = [alias.name for alias in node.names
                              if module == "megatron_serve" and f"megatron_serve.{alias.name}" not in modules]
            else:
                continue
            if root_names:
                offenders.append(f"{name}:{node.lineno} ({', '.join(root_names)})")
    assert not offenders, f"modules importing the package root (use megatron_serve.package): {offenders}"


def test_at_most_twelve_modules_are_left_flat_in_the_package():
    """The rest lives in wings by process: wire, client, fleet, coordinator, engine, server, model, weights."""
    flat = sorted(path.stem for path in PACKAGES["megatron_serve"].glob("*.py")
                  if path.stem != "__init__" and path.stem not in VLLM_NAMESAKES)
    assert len(flat) <= MAX_FLAT_MODULES, f"{len(flat)} flat modules (move them into a wing): {flat}"


def test_import_chains_are_at_most_max_import_depth_floors_deep():
    """The longest chain of imports that importing one module runs at once (module level, type-checking
    blocks aside; ``megatron_kernels``, a distribution of its own, counts as one floor)."""
    modules = {name: path for name, path in _modules().items() if not name.startswith("megatron_kernels.")}
    graph = {name: {t if not t.startswith("megatron_kernels.") else "megatron_kernels"
                    for t in _module_level_imports(name, path, modules)} for name, path in modules.items()}
    chains: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:  # the graph has no cycle (test_no_import_cycle)
        if name not in chains:
            longest = max((chain(t) for t in graph.get(name, ())), key=len, default=[])
            chains[name] = [name, *longest]
        return chains[name]

    deepest = max((chain(name) for name in graph), key=len)
    assert len(deepest) <= MAX_IMPORT_DEPTH, f"{len(deepest)} floors: {' -> '.join(deepest)}"


def test_no_function_is_longer_than_eighty_lines_without_a_reason():
    """A function over 80 lines names why it stays whole in its docstring (``Long: ...``). Triton kernels
    (``megatron_kernels``) are exempt, as from the module size: one kernel is one compiled function."""
    long = []
    for name, path in _modules().items():
        if name.startswith("megatron_kernels"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(node) or ""):
                    long.append(f"{name}.{node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines without a '{LONG_REASON}' reason: {long}"


def test_the_engine_side_never_imports_the_client():
    """The engine process (engine, model, weights, wire) runs without the caller's code: importing the engine
    used to import the client (``weights/__init__`` -> ``sender`` -> ``client``)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    engine_side = ("megatron_serve.engine", "megatron_serve.model", "megatron_serve.weights", "megatron_serve.wire")
    offenders = {}
    for start in (name for name in graph if name.startswith(engine_side)):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        if client := sorted(m for m in seen if m.startswith("megatron_serve.client")):
            offenders[start] = client
    assert not offenders, f"engine-side modules that import the client: {offenders}"


def test_the_engine_class_holds_its_parts_and_nothing_in_the_engine_imports_it():
    """``DynamicInferenceEngine`` has no base classes: its verbs (device memory, adapters) and the verify step are
    objects it holds, each with its own state, not mixins that reach into its attributes (it was one class spread
    over four files that way). None of its parts imports it back, even for type checkers: only the package does."""
    engine = PACKAGES["megatron_serve"] / "engine"
    (cls,) = [node for node in _tree(engine / "core.py").body
              if isinstance(node, ast.ClassDef) and node.name == "DynamicInferenceEngine"]
    assert [ast.unparse(base) for base in cls.bases + cls.keywords] == []
    importers = []
    for path in engine.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "core" and node.level:
                importers.append(str(path.relative_to(engine)))
    assert importers == ["__init__.py"]


#: The engine class is the step loop over its scheduler, worker and verbs' objects (issue 52's bound; one method more
#: since issue 64: every verb through ``call`` and prefill/decode's ``kv_in`` and ``kv_out`` replace ``receive_kv``
#: and the process's reach into the verbs' objects and ``engine.kv_transfer``; one more since issue 62: ``idle``, the
#: loop's turn without a step, so that the disk tier's KV events leave an engine with no requests). 250 lines since
#: issue 85, where the KV tiers (engine.kv.tiers) and the engine's reports (engine.report) became objects of their own.
MAX_ENGINE_CLASS_LINES = 250
MAX_ENGINE_CLASS_METHODS = 22


def test_the_engine_class_is_a_step_loop_of_bounded_size():
    """``DynamicInferenceEngine`` stays at most MAX_ENGINE_CLASS_LINES lines and MAX_ENGINE_CLASS_METHODS methods,
    every ``def`` in its body counted (properties, class methods and private helpers alike): a new job goes to the
    scheduler, the worker or an object the engine holds, not into the loop. The runner is the worker's alone."""
    engine = PACKAGES["megatron_serve"] / "engine"
    (cls,) = [node for node in _tree(engine / "core.py").body
              if isinstance(node, ast.ClassDef) and node.name == "DynamicInferenceEngine"]
    methods = [node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= MAX_ENGINE_CLASS_LINES, f"DynamicInferenceEngine is {lines} lines"
    assert len(methods) <= MAX_ENGINE_CLASS_METHODS, f"DynamicInferenceEngine has {len(methods)} methods: {methods}"
    assigned = {target.attr for node in ast.walk(cls) if isinstance(node, ast.Assign) for target in node.targets
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}
    assert "runner" not in assigned, "the engine holds the runner beside its worker"


#: The coordinator's core routes each input to its parts (the request flow, the fleet's weights, the verb runner,
#: liveness, dispatch) and holds the fleet's membership: at 494 lines it held every request's way through it too.
MAX_COORDINATOR_CORE_LINES = 300


def test_the_coordinator_core_routes_to_its_parts():
    """``CoordinatorCore`` stays under MAX_COORDINATOR_CORE_LINES lines: a request's way (submit, mirror, finish,
    deliver, requeue) is :class:`RequestFlow`'s, the weights generation :class:`FleetWeights`'s, the membership,
    lifecycle state and routing named parts of their own, which the job modules are handed explicitly (no Protocol of
    the core's mutable attributes, ``core_view.py``, stands between them)."""
    (cls,) = [node for node in _tree(PACKAGES["megatron_serve"] / "coordinator" / "core.py").body
              if isinstance(node, ast.ClassDef) and node.name == "CoordinatorCore"]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < MAX_COORDINATOR_CORE_LINES, f"CoordinatorCore is {lines} lines"
    attributes = {t.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert {"flow", "weights", "members", "lifecycle", "dispatcher"} <= attributes
    assert not attributes & {"requests", "handoffs", "epoch", "weights_source", "engines", "peers", "state", "policy"}
    assert not (PACKAGES["megatron_serve"] / "coordinator" / "core_view.py").exists()


#: Modules directly in ``engine/`` (its ``__init__`` aside): a subsystem of several files gets a folder (sampling,
#: the lifecycle verbs, what is compiled before serving) instead of spreading over the engine's top floor (32 files).
MAX_ENGINE_TOP_FLOOR = 19


def test_the_engine_top_floor_holds_few_files():
    """The engine's subsystems live in folders: at most MAX_ENGINE_TOP_FLOOR modules sit directly in ``engine/``."""
    flat = sorted(p.name for p in (PACKAGES["megatron_serve"] / "engine").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= MAX_ENGINE_TOP_FLOOR, f"engine/ holds {len(flat)} flat modules: {flat}"


def _engine_modules() -> dict[str, Path]:
    return {name: path for name, path in _modules().items() if name.startswith("megatron_serve.engine.")}


def test_at_most_one_engine_module_names_the_public_request():
    """Inside the engine a request is its ``Sequence``, built from an ``EngineRequest``, and a step gives outputs:
    the public ``DynamicInferenceRequest`` is built where its caller reads it. One adapter (Megatron's expert API,
    ``engine.expert_api``) turns it into an ``EngineRequest`` and applies outputs to it; no other engine module
    names it, in code, annotations or docstrings (11 did before issue 52)."""
    naming = sorted(name for name, path in _engine_modules().items()
                    if re.search(r"\bDynamicInferenceRequest\b", path.read_text()))
    assert len(naming) <= 1, f"engine modules naming DynamicInferenceRequest: {naming}"


#: The public record's per-token fields: lists that grow with every generated token (or prompt position scored).
PER_TOKEN_FIELDS = ("generated_tokens", "generated_log_probs", "generated_top_n_logprobs", "generated_token_texts",
                    "policy_epochs", "kv_epochs", "lora_epochs", "prompt_log_probs", "prompt_top_n_logprobs")
#: The containers the engine's per-request object may hold, and why none grows per token for anyone else.
SEQUENCE_CONTAINERS = {
    "token_ids": "its tokens: what the model runs on (state, not a record)",
    "block_table": "one entry per KV block", "block_hashes": "one entry per KV block",
    "prompt_hashes": "one entry per KV block", "images": "one entry per image", "events": "one entry per event",
    "prompt_scores": "the prompt scores made so far, dropped once its first output carried them",
}


def _grown_attributes(tree: ast.AST) -> set[str]:
    """Attribute names a module grows: ``x.name.append/extend/insert(...)``, ``x.name += ...``,
    ``x.name[a:b] = ...``."""
    grown = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert") and isinstance(node.func.value, ast.Attribute)):
            grown.add(node.func.value.attr)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute):
            grown.add(node.target.attr)
        elif isinstance(node, ast.Assign):
            grown.update(t.value.attr for t in node.targets
                         if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute))
    return grown


def test_no_engine_module_accumulates_per_token_lists():
    """The engine emits per-step outputs (tokens, log probs, top-n, epochs, routing rows) and keeps no per-token
    list for anyone else: no engine module but the expert API's adapter (which builds the public record, as the
    client's collector does) grows one of the public record's per-token fields, and the per-request object holds
    no container but those listed in SEQUENCE_CONTAINERS (a new per-token list there needs a reason here)."""
    growers = {}
    for name, path in _engine_modules().items():
        grown = _grown_attributes(_tree(path)) & set(PER_TOKEN_FIELDS)
        if grown and name != "megatron_serve.engine.expert_api":
            growers[name] = sorted(grown)
    assert not growers, f"engine modules growing per-token lists: {growers}"
    (cls,) = [node for node in _tree(PACKAGES["megatron_serve"] / "engine" / "sequence.py").body
              if isinstance(node, ast.ClassDef) and node.name == "Sequence"]
    containers = {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign)
                  and re.search(r"\b(list|dict|set|deque|tuple|ndarray|PromptScores)\b", ast.unparse(node.annotation))}
    assert containers <= set(SEQUENCE_CONTAINERS), f"Sequence holds {sorted(containers - set(SEQUENCE_CONTAINERS))}"


#: The modules that may name several sampling parameters side by side, and why: the table itself, the typed struct it
#: describes (held equal to it by tests/wire/test_sampling_fields.py), the sampler's filters (one op per input, named
#: by their arguments), TRL's defaults (TRL's own protocol: the names and TRL's values, the types the table's; a new
#: parameter reaches it through its ``generation_kwargs``, which the table reads) and the ``generate`` command's flags
#: (three of vLLM's, not a listing).
SAMPLING_LISTINGS = {
    "megatron_serve.wire.sampling_fields": "the table",
    "megatron_serve.engine.sampling.sampler": "the filters' arguments",
    "megatron_serve.server.rl.trl_generate": "TRL's GenerateRequest field names with TRL's defaults",
    "megatron_serve.commands.generate": "the command's --temperature, --top-p and --top-k",
}
#: The modules that read the table rather than name the parameters.
SAMPLING_TABLE_READERS = ("server.models", "server.translate", "server.rl.vllm_sampling", "server.rl.sampling_bodies",
                          "generation_config", "engine.sampling.sampling_state", "engine.sampling.logprob_parity", "wire.sampling_params")


def _listed_names(node: ast.AST) -> set[str]:
    """Names one node lists side by side: a literal's strings, a call's keywords, a class body's fields, a function's
    arguments."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, ast.Call):
        return {k.arg for k in node.keywords if k.arg}
    if isinstance(node, ast.ClassDef):
        return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {a.arg for a in node.args.args + node.args.kwonlyargs}
    return set()


def test_the_sampling_table_is_the_one_place_that_lists_sampling_parameters():
    """Every parameter that changes the logits (a row of ``wire/sampling_fields.py`` with a stage) is named side by
    side with others only where SAMPLING_LISTINGS says why: the server's request models, the translation, the vLLM
    and SGLang bodies, the generation_config keys, the sampling state and the parity checker read the table (a new
    parameter touched 8 files, each restating the list). Three names in one literal, call, class body or signature
    is a listing."""
    from megatron_serve.wire.sampling_fields import FIELDS  # noqa: PLC0415

    knobs = {name for row in FIELDS if row.stage is not None
             for name in (row.name, row.http, row.vllm, row.sglang, row.sampler) if name is not None}
    listings = {}
    for name, path in _modules().items():
        if name.startswith("megatron_serve.") and name not in SAMPLING_LISTINGS:
            for node in ast.walk(_tree(path)):
                if len(found := _listed_names(node) & knobs) >= 3:
                    listings[f"{name}:{node.lineno}"] = sorted(found)
    assert not listings, f"sampling parameters listed outside the table: {listings}"
    modules = _modules()
    table = "megatron_serve.wire.sampling_fields"
    for reader in SAMPLING_TABLE_READERS:
        name = f"megatron_serve.{reader}"
        assert table in _imports(name, modules[name], modules), f"{name} does not read the table"


def test_the_model_never_imports_the_weights_wing():
    """``model/`` is the floor beneath ``weights/`` (sources, transfers, the refit's targets): what both need (the
    NaN/infinity check every load runs, ``model.finite``) lives in ``model/``, and no model module imports a
    ``weights`` one, even inside a function (it imported ``weights/finite.py`` upward)."""
    modules = _modules()
    upward = {name: sorted(t for t in _imports(name, path, modules) if t.startswith("megatron_serve.weights"))
              for name, path in modules.items() if name.startswith("megatron_serve.model")}
    offenders = {name: targets for name, targets in upward.items() if targets}
    assert not offenders, f"model modules importing weights/: {offenders}"


REFIT_TRANSACTION = ("engine.verbs.memory", "engine.verbs.refit_targets", "weights.sources", "weights.sharded",
                     "weights.peer_pull", "weights.drafter", "weights.adapters")


def test_the_refit_transaction_probes_nothing():
    """The refit's targets and sources say what they hold through typed protocols (``WeightTarget``: claims, check,
    load, commit; ``WeightSource``: check, shapes, adapters, tensors), so the transaction and its sources never ask
    an object what it is: no ``getattr``/``hasattr``, and no function-level import (one fed an ``isinstance`` on the
    sharded source). The transaction used four probes over five weight sources."""
    modules = _modules()
    offenders = []
    for short in REFIT_TRANSACTION:
        name = f"megatron_serve.{short}"
        for node in ast.walk(_tree(modules[name])):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                offenders += [f"{name}:{inner.lineno} import in {node.name}" for inner in ast.walk(node)
                              if isinstance(inner, (ast.Import, ast.ImportFrom))]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr")):
                offenders.append(f"{name}:{node.lineno} {node.func.id}")
    assert not offenders, f"probes in the refit transaction: {offenders}"


#: The plain engine's modules: they know drafts only as data (:mod:`megatron_serve.engine.drafts`, ``Emitted``'s
#: accepted count), never the speculative wing, which the engine class composes and the worker calls through its hooks.
PLAIN_ENGINE = ("scheduler", "steps", "worker", "token_append", "sequence", "output", "sampling.sampler", "sampling.sampling_state",
                "step_plan", "runner", "drafts", "kv.blocks")


def test_the_plain_engine_never_imports_the_speculative_wing():
    """Speculation inverted the engine's layers: the plain step's row type lived in ``engine/speculative`` and the
    scheduler called the speculator to roll drafts back. Type-checking imports (the worker's hook's type) are
    allowed."""
    modules = _modules()
    offenders = {}
    for short in PLAIN_ENGINE:
        name = f"megatron_serve.engine.{short}"
        upward = sorted(t for t in _imports(name, modules[name], modules)
                        if t.startswith("megatron_serve.engine.speculative"))
        if upward:
            offenders[name] = upward
    assert not offenders, f"plain engine modules importing engine/speculative: {offenders}"


def test_the_engine_class_builds_the_speculator_and_knows_no_more_of_the_wing():
    """The step loop is one loop in ``engine/core.py`` (a strategy object that the engine called, and that called the
    engine back through a protocol, split one step over two files): the engine constructs its speculator, the one
    import it makes from ``engine/speculative``, and calls its methods on plain data (sequences, counts, launched
    steps)."""
    modules = _modules()
    name = "megatron_serve.engine.core"
    upward = sorted(t for t in _imports(name, modules[name], modules)
                    if t.startswith("megatron_serve.engine.speculative"))
    assert upward == ["megatron_serve.engine.speculative.factory"], f"engine/core.py imports {upward}"


def test_no_module_imports_what_it_never_uses_or_uses_what_it_never_defines():
    """pyflakes over every module of the three packages: an unused import is a leftover of code that moved, an
    undefined name in an annotation fails only when something evaluates it. A package's ``__init__`` re-exports,
    and an import marked ``noqa: F401`` says whose it is."""
    from pyflakes import checker, messages  # noqa: PLC0415 - a test dependency, for this test only

    found = []
    for path in _modules().values():
        source = path.read_text()  # parsed again: pyflakes marks the nodes it walks, and _tree's are shared
        lines = source.splitlines()
        for message in checker.Checker(ast.parse(source), filename=str(path)).messages:
            unused = isinstance(message, messages.UnusedImport)
            if unused and (path.name == "__init__.py" or "noqa: F401" in lines[message.lineno - 1]):
                continue
            found.append(f"{path.relative_to(ROOT)}:{message.lineno}: {message.message % message.message_args}")
    assert not found, "\n".join(found)
