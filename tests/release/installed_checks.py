"""Checks that run INSIDE the release check's fresh virtual environment, against the installed wheel.

The release test copies this file out of the checkout and runs it with the fresh environment's
interpreter from a directory outside the repository, so only what the wheel installed can be
imported. Each subcommand prints one JSON document on stdout.

    python installed_checks.py imports            # import every module of the three packages
    python installed_checks.py commands           # the CLI's subcommand names and the version
    python installed_checks.py cpu-kernels        # build the CPU kernels from the wheel's sources and run them
    python installed_checks.py parse FILE.json    # parse rendered container command lines

The checks without an argument run in turn in one process when named together (``cpu-kernels imports commands``),
which prints them as one document by name: each process of this environment imports torch, and compiles what it
imports first.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("megatron_serve", "megatron_kernels", "megatron_operator")

TRAINER_LIBRARIES = {"megatron_kernels.invariant_megatron_core": "megatron",
                     "megatron_kernels.invariant_torchtitan": "torchtitan",
                     "megatron_serve.integrations.verl": "verl"}
"""The batch-invariant recipes for a trainer's own library (Megatron-core, TorchTitan) and the verl backend (a
package: its modules go with it): importable where the trainer has that library, which neither distribution
installs; only its absence is let pass."""


def imports() -> dict[str, object]:
    """Walk the installed packages (so a new subpackage is covered without editing the test) and
    import every module; each must come from this environment's site-packages."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    modules: dict[str, str] = {}
    failures: dict[str, str] = {}
    without: dict[str, str] = {}  # a trainer recipe whose library is not installed here
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules[name] = package.__file__
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{name}."):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                continue  # an entry point: importing it runs the program (the CLI checks cover it)
            try:
                modules[info.name] = importlib.import_module(info.name).__file__
            except ModuleNotFoundError as exc:
                if TRAINER_LIBRARIES.get(info.name) == (exc.name or "").split(".")[0]:
                    without[info.name] = exc.name
                else:
                    failures[info.name] = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - every failure is reported by name
                failures[info.name] = f"{type(exc).__name__}: {exc}"
    outside = {name: path for name, path in modules.items() if not Path(path).resolve().is_relative_to(site)}
    return {"modules": sorted(modules), "failures": failures, "outside_site_packages": outside,
            "without_trainer_library": without}


def commands() -> dict[str, object]:
    import megatron_serve
    from megatron_serve.cli import COMMANDS

    return {"commands": sorted(COMMANDS), "version": megatron_serve.__version__}


def parse(path: str) -> dict[str, object]:
    """Parse each ``[program, argv]`` pair with the installed program's own parser.

    ``megatron-serve`` lines go through :func:`megatron_serve.cli.parse_args`; the operator's
    pass-through options through ``kopf run``'s own click parser; probe lines through the probe's.
    """
    from megatron_operator.cli import kopf_argv
    from megatron_operator.probe import parse_mode
    from megatron_serve.cli import parse_args

    import kopf.cli

    results: list[str] = []
    for program, argv in json.loads(Path(path).read_text()):
        try:
            if program == "megatron-serve":
                args = parse_args(argv)
                if args.command == "operator":
                    kopf_run = kopf_argv(args.extra_args)
                    kopf.cli.run.make_context("run", kopf_run[1:])
            elif program == "probe":
                parse_mode(argv)
            else:
                raise ValueError(f"unknown program {program!r}")
            results.append("ok")
        except SystemExit as exc:
            results.append(f"exit {exc.code}")
        except Exception as exc:  # noqa: BLE001 - reported per line
            results.append(f"{type(exc).__name__}: {exc}")
    return {"results": results}


def cpu_kernels() -> dict[str, object]:
    """Build (or load) the CPU kernels from the sources the wheel installed, and run each once against the reference."""
    import torch
    from megatron_kernels import cpu_attention, cpu_build, cpu_rows, reference
    from megatron_kernels.paged_kv import PagedKV

    q, cache = torch.randn(2, 4, 64), PagedKV(torch.randn(3, 16, 2, 64), torch.randn(3, 16, 2, 64))
    tables, lengths = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), torch.tensor([20, 7], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)  # as prefill: one query row each, the last of its context
    rows, weight = torch.randn(5, 256), torch.randn(128)
    results = {
        "paged_attention_decode": (cpu_attention.paged_attention_decode(q, cache, tables, lengths, 0.125),
                                   reference.paged_attention_decode(q, cache, tables, lengths, 0.125)),
        "paged_attention_prefill": (cpu_attention.paged_attention_prefill(q, cache, tables, starts, lengths, 0.125),
                                    reference.paged_attention_prefill(q, cache, tables, starts, lengths, 0.125)),
        "rms_norm": (cpu_rows.rms_norm(rows[:, :128].contiguous(), weight, 1e-6),
                     reference.rms_norm(rows[:, :128].contiguous(), weight, 1e-6)),
        "silu_and_mul": (cpu_rows.silu_and_mul(rows), reference.silu_and_mul(rows)),
    }
    return {"built": {"attention": cpu_attention.built(), "rows": cpu_rows.built(), "swiglu": cpu_rows.swiglu_built()},
            "sources": sorted(str(path.resolve()) for path in cpu_build.CSRC.glob("*.cpp")),
            "match_reference": {name: bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))
                                for name, (got, want) in results.items()}}


#: The checks that take no argument, by name.
CHECKS = {"imports": imports, "commands": commands, "cpu-kernels": cpu_kernels}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "parse":
        print(json.dumps(parse(argv[1])))
        return 0
    unknown = [name for name in argv if name not in CHECKS]
    if not argv or unknown:
        said = f"unknown checks {unknown}" if unknown else "no check named"
        print(f"installed_checks.py: {said} (known: {', '.join(CHECKS)}, or parse FILE.json alone)", file=sys.stderr)
        return 2
    print(json.dumps({name: CHECKS[name]() for name in argv}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
