"""docs/rl-fleets.md's sharded refit runs as written: its two snippets, in one file, on two trainer ranks over gloo.

The page's script (pause, every rank sends its pieces, unpause) and its ``my_pieces()`` are taken from the page
as they are; the test adds only what the page leaves to the reader: ``local_state_dict()``, this rank's
tensor-parallel shards of a new checkpoint (Hugging Face names). Afterwards the fleet serves, at the page's epoch
7, exactly what a direct engine of the new checkpoint generates."""

from __future__ import annotations

import asyncio
import re
import textwrap
from pathlib import Path

import pytest

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.tiny import make_tiny_model

from ..helpers import Children, free_port, hosted_rendezvous
from ..forked import run_scripts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "rl-fleets.md"
PROMPTS = ["The trainer sends", "Every rank holds a piece of"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)

#: What the page leaves to the reader: this rank's shards of the new checkpoint, cut as the page's rules expect.
LOCAL_STATE_DICT = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
            "embed_tokens.weight", "lm_head.weight")

    def local_state_dict():
        rank, size = dist.get_rank(), dist.get_world_size()
        full = load_file(os.path.join(os.environ["NEW_CHECKPOINT"], "model.safetensors"))
        dim = lambda name: 0 if name.endswith(ROWS) else 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else None
        return {name: tensor if dim(name) is None else tensor.chunk(size, dim(name))[rank].contiguous()
                for name, tensor in full.items()}
''')


def page_script() -> str:
    """The page's ``my_pieces()`` snippet, then its script (which calls it at run time)."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    script = next(b for b in blocks if "async def refit" in b)
    pieces = next(b for b in blocks if "def my_pieces" in b)
    return LOCAL_STATE_DICT + pieces + script


async def test_the_pages_sharded_refit_runs_as_written(tiny_model, tmp_path):
    from megatron_serve import MegatronLLM  # noqa: PLC0415

    old, new = tiny_model, str(make_tiny_model(tmp_path / "new", seed=1))  # the suite's seed-0 model, then seed 1
    direct = MegatronLLM(new, InferenceConfig(num_kv_blocks=64))
    try:
        expected = [r.generated_tokens for r in direct.generate(PROMPTS, GREEDY)]
    finally:
        direct.close()
    script = tmp_path / "refit.py"
    script.write_text(page_script())
    children = Children(tmp_path)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    try:
        children.coordinator(old, port)
        children.engine(old, port)
        async with InferenceClient(address, token=children.secret) as client:
            await client.wait_for_engines(1, timeout=300)
            before = [r.generated_tokens for r in await asyncio.gather(*(client.add_request(p, GREEDY)
                                                                          for p in PROMPTS))]
            assert before != expected  # the control: the fleet serves the old checkpoint
            with hosted_rendezvous(2) as meeting:
                # each rank a process of its own, forked from the worker's fork server (torch imported there once)
                env = {**meeting, "WORLD_SIZE": "2", "MEGATRON_SERVE_COORDINATOR": address,
                       "MEGATRON_SERVE_TOKEN": children.secret, "NEW_CHECKPOINT": new}
                done = await asyncio.to_thread(run_scripts, script, [[], []], env, 300, via="forkserver",
                                               own_envs=[{"RANK": str(rank)} for rank in range(2)])
            assert [rank.returncode for rank in done] == [0, 0], [rank.stderr[-2000:] for rank in done]
            sent = dict(line.split() for rank in done for line in rank.stdout.splitlines())
            assert set(sent) == {"0", "1"} and all(int(b) > 0 for b in sent.values())  # each rank sent its own
            status = await client.status()
            assert status["state"] == "RUNNING" and status["epoch"] == 7
            after = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
            assert [r.generated_tokens for r in after] == expected
            assert all(set(r.policy_epochs) == {7} for r in after)
    finally:
        children.kill_all()
