"""Run short scripts many times each, as ``python script.py`` in a loop would, for a few seconds of CPU.

``python short_script_runs.py MODEL RUNS OUT SCRIPT...``: imports once what every script imports (torch, the LLM
classes and the engine's modules, the tokenizer's ``transformers`` backend: ~4 s of CPU, most of a short script's),
then, for each SCRIPT, forks RUNS children one after another. Each child runs the script's text as ``__main__``
(``MODEL`` set) with its output in ``OUT/<script>-<run>.out``/``.err`` and ends as a script ends: the interpreter
finalizes, with whatever the engine started still running. Prints the children's exit codes as JSON:
``[[code, ...], ...]`` by script.

Forked after the imports, a run still crashes at exit as a fresh interpreter did: with the grammar warm-up thread a
daemon again, 3 of 10 runs of ``LLM(model=MODEL)`` crashed (SIGSEGV, SIGABRT), as 5 of 16 fresh ones had; 15 of 20
with the imports' objects frozen (``gc.freeze``, below).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch  # noqa: F401 - imported once, before the forks
import transformers.tokenization_utils_tokenizers  # noqa: F401 - the tokenizer's backend, likewise

from megatron_serve import LLM, MegatronLLM  # noqa: F401 - likewise
import megatron_serve.client.local_engine  # noqa: F401 - the engine's modules, which LLM() imports: likewise


def run_all(out: str, scripts: list[str], runs: int) -> str | None:
    """In the parent: every run's exit code, by script, once all ended (None). In a child: its script's text."""
    codes: list[list[int]] = []
    for index, path in enumerate(scripts):
        codes.append([])
        for run in range(runs):
            pid = os.fork()
            if pid == 0:
                for fd, suffix in ((1, "out"), (2, "err")):
                    os.dup2(os.open(f"{out}/{index}-{run}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                with open(path) as fh:
                    return fh.read()
            codes[-1].append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(codes))
    return None


# The imports' objects out of the collector's reach: a child's collections at exit no longer write into every one of
# them, copying the pages it shares with this process (~0.7 s of CPU a run). A child still finalizes as a script does;
# with the warm-up thread a daemon again, 15 of 20 forked runs crashed.
gc.freeze()
MODEL = sys.argv[1]
_script = run_all(sys.argv[3], sys.argv[4:], int(sys.argv[2]))
if _script is not None:  # a child: the script's names are this module's globals, as a script's are
    exec(compile(_script, "script.py", "exec"))  # noqa: S102
