"""One transaction through the fleet (issue 50, build item 4): a sharded trainer of world size 2 sends the policy,
its EAGLE-3 head and a LoRA adapter version in ONE send, real processes, gloo on CPU.

Two engine groups serve policy A with a random EAGLE-3 head (its drafts are rejected: the control) and adapter
``a`` (version 0). The send brings policy B, head H and adapter version 1, every tensor cut over the two trainer
ranks (the adapter from rank 1): afterwards every engine serves epoch 1, tokens equal a server of B, requests of
``a`` carry adapter version 1, and the head keeps proposing, every draft accepted (B's and H's final norms are zero,
so both say token 0). A send with one bad part, a head tensor of another shape (refused by the engines' verify
step) or an adapter holding NaN (refused by the trainer ranks before the REFIT), refuses all of it: the fleet keeps
epoch 1, adapter version 1 and its head, and serves them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..engine.test_eagle3_proposer import write_eagle3
from ..helpers import Children, free_port, until
from ..lora_adapters import make_peft_adapter
from .test_sharded_refit_fleet import GREEDY, PROMPTS, outputs, rewritten, run_trainers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RANK = 8
ADAPTED = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, lora_name="a")


def edited(directory: str, out: Path, edit) -> str:
    """A copy of a head or adapter directory whose tensors ``edit(tensors)`` changed in place."""
    shutil.copytree(directory, out)
    weights = next(out.glob("*.safetensors"))
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit-transaction")
    a = str(make_tiny_model(root / "a", seed=5, num_layers=4))
    b = rewritten(a, root / "b", lambda n, t: torch.zeros_like(t) if n == "model.norm.weight" else t)
    head = write_eagle3(root / "head", a)
    agreeing = edited(head, root / "head-b", lambda t: t.update({"norm.weight": torch.zeros_like(t["norm.weight"])}))
    misshapen = edited(agreeing, root / "head-bad", lambda t: t.update({"fc.weight": torch.zeros(3, 3)}))
    old, new = (str(make_peft_adapter(a, root / name, rank=RANK, seed=seed)) for name, seed in (("old", 20), ("new", 21)))
    poisoned = edited(new, root / "nan", lambda t: next(v for k, v in t.items() if "lora_B" in k).fill_(float("nan")))
    expected = SimpleNamespace(a=outputs(a), b=outputs(b))
    assert expected.a != expected.b and all(set(tokens) == {0} for tokens in expected.b)
    return SimpleNamespace(a=a, b=b, head=head, agreeing=agreeing, misshapen=misshapen, old=old, new=new,
                           poisoned=poisoned, expected=expected)


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    children = Children(tmp_path_factory.mktemp("refit-transaction-logs"))
    port = free_port()
    spec = json.dumps({"method": "eagle3", "model": models.head, "num_speculative_tokens": 3, "adaptive": False})
    flags = ("--speculative-config", spec, "--enable-lora", "--max-lora-rank", str(RANK),
             "--lora-modules", f"a={models.old}")
    children.coordinator(models.a, port, "--routing", "round_robin", "--heartbeat-timeout", "120")
    for group in (0, 1):
        children.engine(models.a, port, "--group", str(group), *flags)
    try:
        yield SimpleNamespace(address=f"tcp://127.0.0.1:{port}", children=children)
    finally:
        children.kill_all()


async def counters(client: InferenceClient) -> dict:
    """The fleet's generated, drafted and accepted tokens so far (every engine's last heartbeat), and each group's
    generated tokens."""
    engines = (await client.status())["engines"]
    keys = ("generation_tokens", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    count = lambda e, k: ((e["metrics"] or {}).get("counters") or {}).get(k, 0)  # noqa: E731
    return {**{k: sum(count(e, k) for e in engines) for k in keys},
            "groups": {e["group"]: count(e, "generation_tokens") for e in engines}}


async def ready_engines(client: InferenceClient) -> bool:
    engines = (await client.status())["engines"]
    return len(engines) == 2 and all(e["progress"] is not None for e in engines)


async def serve(client: InferenceClient, expected: list[list[int]], epoch: int, version: int) -> tuple[int, int]:
    """Greedy outputs with and without adapter ``a`` are ``expected`` (its final norm zero: the adapter cannot
    change them), every token of ``epoch`` and adapter ``version``, from both engines (round robin; one that
    registered again in between, on a loaded machine, gets the next batch, up to three); returns the drafts and
    accepted drafts of those requests, once the heartbeats counted them."""
    first = await counters(client)
    for _ in range(3):
        before = await counters(client)
        base = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
        adapted = await asyncio.gather(*(client.add_request(p, ADAPTED) for p in PROMPTS))
        assert [r.generated_tokens for r in base] == expected
        assert all(set(r.policy_epochs) == {epoch} for r in [*base, *adapted])
        assert all(set(r.lora_epochs) == {version} for r in adapted)
        total = before["generation_tokens"] + sum(len(r.generated_tokens) for r in [*base, *adapted])

        async def counted():
            now = await counters(client)
            return now if now["generation_tokens"] >= total else None

        now = await until(counted, 60, "the engines' heartbeats to count the tokens")
        if all(now["groups"].get(g, 0) > first["groups"].get(g, 0) for g in (0, 1)):
            return (now["spec_decode_num_draft_tokens"] - first["spec_decode_num_draft_tokens"],
                    now["spec_decode_num_accepted_tokens"] - first["spec_decode_num_accepted_tokens"])
    raise AssertionError(f"not both engines served: tokens per group {first['groups']} before, {now['groups']} after")


async def test_policy_head_and_adapter_travel_in_one_send_or_not_at_all(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await until(lambda: ready_engines(client), 300, "both engines to serve")
        drafts, accepted = await serve(client, models.expected.a, 0, 0)
        assert drafts > 0 and accepted < drafts  # control: the random head is mostly wrong

        await client.pause()
        results = await asyncio.to_thread(run_trainers, fleet, models.b, 1, 2, "--drafter", models.agreeing,
                                          "--adapter", f"a={models.new}")
        assert [code for code, _ in results] == [0, 0], results
        for _, lines in results:
            assert lines[-1]["detail"]["epoch"] == 1 and lines[-1]["detail"]["adapters"] == {"a": 1}
        status = await client.status()
        assert status["epoch"] == 1 and [e["epoch"] for e in status["engines"]] == [1, 1]
        await client.unpause()
        drafts, accepted = await serve(client, models.expected.b, 1, 1)
        assert drafts > 0 and accepted == drafts  # the new head keeps proposing, and agrees with the new policy

        bad = {"head": (["--drafter", models.misshapen, "--adapter", f"a={models.new}"], "ControlError",
                        "EAGLE-3 tensor fc.weight has shape (3, 3)"),
               "adapter": (["--drafter", models.head, "--adapter", f"a={models.poisoned}"], "NonFiniteWeights",
                           "holds NaN or infinite values")}
        for what, (flags, error, message) in bad.items():
            await client.pause()
            results = await asyncio.to_thread(run_trainers, fleet, models.a, 2, 2, *flags)
            assert [code for code, _ in results] == [1, 1], (what, results)
            for _, lines in results:  # every rank refuses, the same way
                assert lines[-1]["type"] == error and message in lines[-1]["error"], (what, lines[-1])
            status = await client.status()
            assert status["epoch"] == 1 and [e["epoch"] for e in status["engines"]] == [1, 1], what
            await client.unpause()
            drafts, accepted = await serve(client, models.expected.b, 1, 1)  # policy, head and adapter as they were
            assert drafts > 0 and accepted == drafts, what
