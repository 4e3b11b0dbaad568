"""Started by Python in every process whose ``PYTHONPATH`` holds this folder (``benchmarks/host_ceiling.py`` puts it
there for the stack it starts): with ``MEGATRON_BENCH_STAND_IN_FORWARD`` set, the engine's forward becomes
:mod:`stand_in_forward`'s. Without the variable it does nothing, so the folder on the path changes no other run."""

import os

if os.environ.get("MEGATRON_BENCH_STAND_IN_FORWARD"):
    import stand_in_forward

    stand_in_forward.install()
