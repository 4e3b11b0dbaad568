"""A direct-mode tensor-parallel script without ``if __name__ == "__main__":`` is told so at once.

multiprocessing's fork server imports the script again in each other rank's process, so its top level builds
an engine there too. Before (issue 54) that engine tried to start ranks of its own, multiprocessing refused
in the child, and rank 0 waited for the missing rank until the rendezvous timed out (300 s), then said
"could not join the group". Now the child says what happened and exits, and rank 0 fails at once with the
same words. The control: the same script under the guard generates.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(400)

SCRIPT = '''\
import sys
from megatron_serve import LLM, SamplingParams
{guard}
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64, enforce_eager=True)
print("tokens", llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)
'''


def run_script(tmp_path, model: str, guarded: bool) -> subprocess.CompletedProcess:
    body = SCRIPT.format(guard='if __name__ == "__main__":' if guarded else "")
    if guarded:  # the two lines after the guard go under it
        head, tail = body.split('if __name__ == "__main__":\n')
        body = head + 'if __name__ == "__main__":\n' + "".join(f"    {line}\n" for line in tail.splitlines())
    script = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    script.write_text(body)
    # The rendezvous timeout stays at its default (300 s): a script that waited for it would pass this timeout.
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_SERVE_RENDEZVOUS_TIMEOUT"}
    return subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=240,
                          env=env, stdin=subprocess.DEVNULL)


def test_a_script_without_the_main_guard_is_told_at_once(tiny_llama, tmp_path):
    done = run_script(tmp_path, tiny_llama, guarded=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "RuntimeError: megatron-tp-rank-1's process exited (code 3) before it started: a script that builds a "
        "tensor-parallel engine (LLM(..., tensor_parallel_size=N) and the like) must do so under "
        "`if __name__ == \"__main__\":`: each other rank's process is started by multiprocessing's fork server, which "
        "imports the script again, so that code at its top level runs again there"), done.stderr[-3000:]
    assert "is running its parent's script again" in done.stderr  # the child said it too, in its own words
    assert "tokens" not in done.stdout


def test_the_same_script_under_the_guard_generates(tiny_llama, tmp_path):
    done = run_script(tmp_path, tiny_llama, guarded=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("tokens [")
