"""megatron-serve as verl's rollout backend (``megatron_serve.integrations.verl``), driven by verl's own classes.

verl needs a venv of its own (transformers<5.11 and Ray; ``make verl-env`` builds ``.venv-verl``), so its side runs
as ``verl_rollout.py`` under that venv's Python: the ``megatron_serve`` replica from verl's registry starts a
``megatron-serve run`` of model A, generates through the server handle verl's agent loop calls, takes model B's
weights through verl's ``CheckpointEngineManager`` and the ``megatron_serve`` checkpoint engine, generates again
(and so does a second replica attached to that server by URL), sleeps, wakes up and generates once more. The references come first: each checkpoint served plainly by this
process (an in-process server, ``/inference/v1/generate``, the body the replica's actor sends).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from ..server.conftest import surface

#: Seconds verl's run may take (its references come before it, in this module's own budget below).
VERL_BUDGET_S = 600
#: The module's budget: the references, verl's run, and room to end what it left (the suite's default is 360 s).
pytestmark = pytest.mark.timeout(VERL_BUDGET_S + 300)

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
SCRIPT = Path(__file__).with_name("verl_rollout.py")
TEXTS = ["Hello there", "The quick brown fox", "1 2 3 4"]
#: What the replica's actor sends for verl's greedy sampling (verl_rollout.GREEDY): vLLM's names, logprobs 0.
SAMPLING = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": 0, "max_tokens": 8,
            "ignore_eos": True}


async def _served(model_dir: str, prompts: list[list[int]]) -> list[dict]:
    """Each prompt's greedy choice from a plain server of ``model_dir``, one request at a time."""
    async with surface(model_dir, Tokenizer.from_pretrained(model_dir)) as (_, http):
        choices = []
        for prompt in prompts:
            answer = await http.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": SAMPLING})
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            choices.append({"token_ids": choice["token_ids"],
                            "log_probs": [entry["logprob"] for entry in choice["logprobs"]["content"]]})
        return choices


@pytest.fixture(scope="module")
def rollout(tmp_path_factory) -> SimpleNamespace:
    assert VENV_PYTHON.exists(), (f"{VENV_PYTHON} is missing: run `make verl-env` (verl runs in a venv of its own: "
                                  "it needs transformers<5.11 and Ray)")
    root = tmp_path_factory.mktemp("verl")
    a, b = str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1))
    tokenizer = Tokenizer.from_pretrained(a)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    reference = SimpleNamespace(a=asyncio.run(_served(a, prompts)), b=asyncio.run(_served(b, prompts)))
    assert reference.a != reference.b
    # Ray puts its sockets under the work directory, and an AF_UNIX path is at most 107 bytes: pytest's own
    # temporary folders (under make test's TMPDIR) are too deep for the session path Ray adds, so a short one.
    work = Path(tempfile.mkdtemp(prefix="verl-", dir="/tmp"))
    verl = subprocess.Popen([str(VENV_PYTHON), str(SCRIPT), a, b, json.dumps(prompts), str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = verl.communicate(timeout=VERL_BUDGET_S)
    except subprocess.TimeoutExpired:
        verl.kill()
        stdout, stderr = verl.communicate()
        pytest.fail(f"verl_rollout.py ran past its {VERL_BUDGET_S} s:\n{stderr[-6000:]}")
    finally:
        left = end_ray(verl, work)
        shutil.rmtree(work, ignore_errors=True)
    assert verl.returncode == 0, f"verl_rollout.py exited {verl.returncode}:\n{stderr[-6000:]}"
    assert left == [], f"Ray processes left running after verl_rollout.py (ended now): {left}"
    return SimpleNamespace(**json.loads(stdout.splitlines()[-1]), reference=reference)


def end_ray(driver: subprocess.Popen, work: Path) -> list[str]:
    """End what the verl run left: its process group, then any process whose command line names its work directory
    (Ray's own start sessions of their own); the command lines of those that were still running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(driver.pid, signal.SIGKILL)
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if str(work) in command:
            left.append(command[:200])
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
    return left


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [output["token_ids"] for output in outputs]


def test_the_replica_generates_what_a_plain_server_generates(rollout):
    assert _ids(rollout.before) == _ids(rollout.reference.a)
    assert [o["log_probs"] for o in rollout.before] == [o["log_probs"] for o in rollout.reference.a]
    assert {(o["stop_reason"], o["weight_version"]) for o in rollout.before} == {("completed", "0")}
    assert rollout.address.startswith("127.0.0.1:")


def test_a_weight_update_through_the_checkpoint_engine_serves_what_the_new_checkpoint_serves(rollout):
    assert _ids(rollout.after) == _ids(rollout.reference.b)
    assert [o["log_probs"] for o in rollout.after] == [o["log_probs"] for o in rollout.reference.b]
    assert {o["weight_version"] for o in rollout.after} == {"1"}  # one REFIT: the next epoch
    assert rollout.updates_left == []  # the trainer's rank 0 removed the update's file once verl finalized it


def test_a_replica_attached_to_a_running_server_generates_through_it(rollout):
    assert rollout.attached["address"] == rollout.address
    assert rollout.attached["outputs"] == rollout.after


def test_sleep_and_wake_up_keep_the_updated_weights(rollout):
    assert rollout.woken == rollout.after
