"""A script with ``LLM(..., enable_sleep_mode=True)`` that ends without ``shutdown()`` leaves no fleet behind.

Before (issue 54) its ``$TMPDIR/megatron-fleet-*`` directory stayed until the next fleet of the user started
(the children died with the script, by their lifeline, but nothing removed the directory). Now the fleet,
still up at interpreter exit, is killed and its directory removed then. The same script also checks that
coordinator mode refuses a prompt past ``max_model_len`` with vLLM's ``ValueError`` (issue 54, item 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import alive

pytestmark = pytest.mark.timeout(400)

SCRIPT = '''\
import json, sys
from megatron_serve import LLM, SamplingParams

llm = LLM(sys.argv[1], enable_sleep_mode=True, max_model_len=64)
fleet = llm._llm.client.fleet
out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
try:
    llm.generate([[5] * 100], use_tqdm=False)
    refused = None
except ValueError as exc:
    refused = str(exc)
print(json.dumps({"tokens": out.outputs[0].token_ids, "refused": refused, "dir": str(fleet.log_dir),
                  "pids": [p.pid for p in [fleet.coordinator, *fleet.engines]]}))
# no llm.shutdown(): the interpreter exits with the fleet up
'''


def test_the_fleet_directory_is_removed_at_interpreter_exit(tiny_llama, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    done = subprocess.run([sys.executable, str(script), tiny_llama], capture_output=True, text=True, timeout=300,
                          env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 2
    assert result["refused"].startswith("The decoder prompt (length 100) is longer than the maximum model length "
                                        "of 64"), result
    assert Path(result["dir"]).parent == tmp  # control: the fleet's directory was made where we look
    assert list(tmp.glob("megatron-fleet-*")) == []
    assert not [pid for pid in result["pids"] if alive(pid)]
