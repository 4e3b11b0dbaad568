"""The release check: the product as users install it, tested from outside the checkout.

Builds the sdist and, from it, the wheel (``uv build``: ``python -m build``'s artifacts, its isolated build
environments filled from uv's cache rather than by a pip install each); installs the wheel into a fresh
virtual environment with what the Dockerfile installs (torch 2.13.0 CPU and the wheel with
:data:`IMAGE_EXTRAS`, in one install where the image takes two for its layer cache); then, from a
directory outside the repository and with nothing of the checkout on the path, imports every module,
asks every subcommand for ``--help``, makes a tiny model, generates, serves it with ``run`` and answers
one completion through the official ``openai`` client, stops it with Ctrl-C, and parses every container
command line the operator renders for the examples with the installed CLI's own parser.

It takes a few minutes (most of it installing into the new environment), so it is marked slow;
``make test`` and CI run it on every change.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import uv
import yaml

from tests.helpers import wait_until
from tests.server.test_openai_e2e import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = {"megatron_serve": ROOT / "runtime", "megatron_kernels": ROOT / "kernels",
                "megatron_operator": ROOT / "operator"}
# The extras the image installs the wheel with; the Dockerfile test below keeps them equal.
IMAGE_EXTRAS = "triton"
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Release:
    wheel: Path
    sdist: Path
    venv: Path
    outside: Path  # the working directory of every installed command: not the checkout

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["HF_HUB_OFFLINE"] = "1"
        env["TORCH_EXTENSIONS_DIR"] = str(self.outside.parent / "torch_extensions")  # the CPU kernels, built afresh
        # torch compiles through ccache where it is on PATH (`make setup` installs it). This venv's paths change every
        # run but not relative to the work directory, the base ccache writes them relative to; the library's name
        # (-DTORCH_EXTENSION_NAME) carries a digest of those absolute paths, which ccache leaves out of its key (the
        # sources never read the macro: test_the_installed_wheel_builds_the_cpu_kernels_from_its_own_sources). With a
        # warm cache each source is then a direct hit, neither preprocessed nor compiled. Direct mode keys on the
        # source and every header it read, so the library is still the installed sources' (one changed compiles
        # anew) and the cpu-kernels check still tests the wheel's own sources.
        env["CCACHE_BASEDIR"] = str(self.outside.parent)
        env["CCACHE_IGNOREOPTIONS"] = "-DTORCH_EXTENSION_NAME=*"
        return env

    def run(self, *argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in argv], cwd=self.outside, env=self.env(), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def check(self, *argv: str | Path, timeout: float = 300) -> str:
        done = self.run(*argv, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def installed_check(self, *args: str) -> dict[str, Any]:
        script = self.outside / "installed_checks.py"
        return json.loads(self.check(self.bin / "python", script, *args))


#: installed_checks.py's checks that take no argument, run in one process of the release's venv (installed_reports).
INSTALLED_CHECKS = ("cpu-kernels", "imports", "commands")


def _step(argv: list[str | Path], cwd: Path, timeout: float = 900) -> None:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def build_distributions(project: Path, dist: Path, *flags: str, cwd: Path) -> None:
    """The sdist and wheel of ``project`` into ``dist``, each in an isolated build environment, as
    ``python -m build`` builds them (without ``flags`` the wheel is built from the unpacked sdist)."""
    _step([uv.find_uv_bin(), "build", "--quiet", "--python", sys.executable, *flags, "--out-dir", dist, project],
          cwd=cwd)


def fresh_venv(work: Path, requirement: str | Path) -> Path:
    """A new venv under ``work`` with torch (pinned: an unpinned one drags in CUDA wheels), then ``requirement``,
    in one resolution.

    uv installs (the package manager, not the ASGI server): pip unzipped and copied torch's 2 GiB through Python for
    each venv, 27 s of CPU an install; uv unpacks a wheel once into its cache and links its files into every later
    venv (1.3 s, 13 s from a cold cache). It reads no pip configuration, so pip's find-links (where this
    machine's local torch build lies) are passed on. No bytecode is compiled (uv's default): Python compiles what
    it imports anyway. The venv gets no pip of its own: the product never imports pip."""
    venv = work / "venv"
    _step([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
    links = [arg for link in pip_find_links() for arg in ("--find-links", link)]
    _step([uv.find_uv_bin(), "pip", "install", "--quiet", "--python", venv / "bin" / "python", *links, TORCH,
           requirement], cwd=work)
    return venv


@functools.cache
def pip_find_links() -> list[str]:
    """pip's ``find-links``, from its configuration files and environment (``pip config list``)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True, stdin=subprocess.DEVNULL).stdout
    values = [line.split("=", 1)[1].strip("'\"") for line in listed.splitlines()
              if line.split("=", 1)[0].endswith(".find-links")]
    return list(dict.fromkeys(link for value in values for link in value.split()))


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    work = tmp_path_factory.mktemp("release")
    dist = work / "dist"
    # sdist first, then the wheel built from the unpacked sdist: both artifacts are checked at once.
    build_distributions(ROOT, dist, cwd=work)  # no flags: the wheel from the sdist
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    venv = fresh_venv(work, f"{wheel}[{IMAGE_EXTRAS}]")
    outside = work / "outside"
    outside.mkdir()
    shutil.copy(Path(__file__).with_name("installed_checks.py"), outside)
    return Release(wheel=wheel, sdist=sdist, venv=venv, outside=outside)


@pytest.fixture(scope="module")
def installed_reports(release: Release) -> dict[str, dict[str, Any]]:
    """Each check of :data:`INSTALLED_CHECKS` by name, from one process: the kernels' build first, in a process that
    has imported nothing else yet, as an engine's first step builds them."""
    reports = release.installed_check(*INSTALLED_CHECKS)
    assert set(reports) == set(INSTALLED_CHECKS), reports
    return reports


def source_packages() -> set[str]:
    """Every package folder (one with an ``__init__.py``) under the three source roots."""
    found = set()
    for name, root in SOURCE_ROOTS.items():
        for init in (root / name).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(root).parts))
    return found


def wheel_packages(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    return {".".join(Path(n).parent.parts) for n in names if n.endswith("/__init__.py") and ".dist-info" not in n}


def test_the_wheel_ships_every_package_and_its_data(release: Release) -> None:
    assert source_packages() - wheel_packages(release.wheel) == set()
    with zipfile.ZipFile(release.wheel) as archive:
        names = set(archive.namelist())
    assert {f"{name}/py.typed" for name in SOURCE_ROOTS} <= names
    sources = {f"megatron_kernels/csrc/{path.name}" for path in (SOURCE_ROOTS["megatron_kernels"] / "megatron_kernels"
                                                                  / "csrc").glob("*.cpp")}
    assert sources and sources <= names  # the CPU kernels' sources: built on the user's machine
    from megatron_serve import __version__

    assert release.wheel.name.startswith(f"megatron_serve-{__version__}-")
    assert release.sdist.name == f"megatron_serve-{__version__}.tar.gz"


def test_the_installed_wheel_builds_the_cpu_kernels_from_its_own_sources(release: Release,
                                                                        installed_reports: dict[str, Any]) -> None:
    report = installed_reports["cpu-kernels"]
    assert all(report["built"].values()) and all(report["match_reference"].values()), report
    site = (release.venv / "lib").resolve()
    # built from these sources even on a ccache hit: ccache keys on the source and its headers (Release.env)
    assert len(report["sources"]) == 3 and all(Path(source).is_relative_to(site) for source in report["sources"])
    # the one option ccache leaves out of its key changes nothing these sources compile to
    assert not [source for source in report["sources"] if "TORCH_EXTENSION_NAME" in Path(source).read_text()]


def test_every_module_imports_from_the_installed_wheel(installed_reports: dict[str, Any]) -> None:
    report = installed_reports["imports"]
    assert report["failures"] == {}
    assert report["outside_site_packages"] == {}
    source_modules = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for name, root in SOURCE_ROOTS.items() for path in (root / name).rglob("*.py") if path.stem != "__main__"
    }
    # the Megatron-core and TorchTitan recipes and the verl backend's package import their library, which the release
    # does not install
    without = tuple(report["without_trainer_library"])
    assert {name for name in source_modules - set(report["modules"])
            if name not in without and not name.startswith(tuple(w + "." for w in without))} == set()


def test_version_and_every_subcommand_help(release: Release, installed_reports: dict[str, Any]) -> None:
    from megatron_serve import __version__

    facts = installed_reports["commands"]
    assert facts["version"] == __version__
    assert release.check(release.bin / "megatron-serve", "--version").strip() == f"megatron-serve {__version__}"
    assert "make-tiny-model" in facts["commands"] and "render" in facts["commands"]
    for command in facts["commands"]:
        out = release.check(release.bin / "megatron-serve", command, "--help", timeout=120)
        assert "usage" in out.lower(), f"{command} --help printed no usage:\n{out}"


def test_tiny_model_generate_and_serve_through_the_openai_client(release: Release) -> None:
    model = release.outside / "tiny"
    release.check(release.bin / "megatron-serve", "make-tiny-model", model)
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    generated = release.check(release.bin / "megatron-serve", "generate", "--model", model, "--max-tokens", "8", "Hello")
    assert generated.strip(), "generate printed nothing"

    http_port = free_port()
    log = release.outside / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(release.bin / "megatron-serve"), "run", "--model", str(model), "--port", str(http_port),
             "--coordinator-port", "0", "--log-dir", str(release.outside / "logs")],
            cwd=release.outside, env=release.env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def serving() -> bool:
            assert proc.poll() is None, log.read_text()
            return "/v1" in log.read_text() and "curl" in log.read_text()

        wait_until(serving, 300, "`megatron-serve run` to print its endpoint", interval=0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        completion = client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                               max_tokens=8, temperature=0)
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert completion.usage.completion_tokens >= 1
        # Ctrl-C in a terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log.read_text()  # the shell's code for an interrupt
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text, text


def rendered_command_lines(objects: list[dict[str, Any]]) -> Iterator[tuple[str, list[str]]]:
    """``(program, argv)`` for every container of ours in the pod templates, probes included.

    A container without ``command`` runs the image's entrypoint (``megatron-serve``); the engine's
    rank wrapper (``/bin/sh -c '... exec megatron-serve "$@"' megatron-serve``) passes its args on.
    Commands of other programs (``sleep``, the preStop shell loop) are not ours to parse.
    """
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            command, args = container.get("command"), [str(a) for a in container.get("args", [])]
            if command is None:
                yield "megatron-serve", args
            elif command[0] == "megatron-serve":
                yield "megatron-serve", [*command[1:], *args]
            elif command[:2] == ["/bin/sh", "-c"] and command[-1] == "megatron-serve" and 'megatron-serve "$@"' in command[2]:
                yield "megatron-serve", args
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                exec_command = container.get(probe, {}).get("exec", {}).get("command", [])
                if exec_command[:3] == ["python", "-m", "megatron_operator.probe"]:
                    yield "probe", exec_command[3:]


def test_rendered_containers_are_accepted_by_the_installed_cli(release: Release) -> None:
    lines: list[tuple[str, list[str]]] = []
    examples = {yaml.safe_load(path.read_text())["metadata"]["name"]: path.name
                for path in sorted((ROOT / "manifests" / "examples").glob("*.yaml"))}
    assert len(examples) == len(list((ROOT / "manifests" / "examples").glob("*.yaml"))) > 1  # one name each
    # every example in one `render -f -` (one process, several documents on stdin), told apart by instance label
    stdin = "---\n".join((ROOT / "manifests" / "examples" / name).read_text() for name in examples.values())
    done = subprocess.run([str(release.bin / "megatron-serve"), "render", "-f", "-"], input=stdin,
                          cwd=release.outside, env=release.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"render -f - exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    by_instance: dict[str, list[dict[str, Any]]] = {}
    for obj in (d for d in yaml.safe_load_all(done.stdout) if d):
        by_instance.setdefault(obj["metadata"]["labels"]["app.kubernetes.io/instance"], []).append(obj)
    assert set(by_instance) == set(examples)
    for instance, objects in by_instance.items():
        found = list(rendered_command_lines(objects))
        programs = {program for program, _ in found}
        assert programs == {"megatron-serve", "probe"}, f"{examples[instance]}: rendered {found}"
        lines += found
    # The operator's own Deployment, as the kustomize base installs it.
    base = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator" / "deployment.yaml").read_text()) if d]
    operator_lines = list(rendered_command_lines(base))
    assert operator_lines and operator_lines[0][1][0] == "operator"
    lines += operator_lines
    # A flag the CLI does not know must fail the check (the check itself can fail).
    lines.append(("megatron-serve", ["engine", "--model", "/m", "--coordinator", "tcp://c:5555", "--no-such-flag"]))
    path = release.outside / "command-lines.json"
    path.write_text(json.dumps(lines))
    results = release.installed_check("parse", str(path))["results"]
    assert results[-1] != "ok"
    failed = [(line, result) for line, result in zip(lines[:-1], results[:-1]) if result != "ok"]
    assert failed == []


def test_the_image_installs_the_wheel_as_the_release_check_does() -> None:
    """Same wheel, same extras: the Dockerfile builds the wheel and installs it with IMAGE_EXTRAS."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip wheel [^\n]*--no-deps[^\n]* \.", dockerfile)
    installs = re.findall(r"pip install [^\n]*?(\S*\.whl\S*)", dockerfile)
    assert installs and all(f"[{IMAGE_EXTRAS}]" in spec for spec in installs), installs
