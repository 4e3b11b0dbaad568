"""``python -m megatron_kernels``: build this machine's CPU kernels ahead of time (``make setup`` does, and an image
can), so that no engine's first step waits for a compiler; exits 1 if one could not be built."""

from __future__ import annotations

import sys

from megatron_kernels.cpu_build import SOURCES, built


def main() -> int:
    results = {source: built(source) for source in SOURCES}
    print(", ".join(f"{source}: {'built' if ok else 'NOT built (the PyTorch reference serves its ops)'}"
                    for source, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
