"""A trainer's ``WeightSender.send(policy, drafter=...)`` refits an engine process's draft model in the policy's
REFIT (issue 39, item 5), through a real coordinator and engine (gloo rendezvous).

The engine serves policy A with drafter D (``--speculative-config`` draft_model; A and D differ, so D's drafts
are rejected: the control). The push brings policy B and, in the same transaction, B as the drafter: the
tokens are B's (== a direct-mode engine on B) with the new epoch, and every draft is accepted. A later push of
the policy alone (back to A) leaves the drafter stale: the draft-token counter stops growing.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from megatron_serve import WeightSender
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.loader import iterate_checkpoint
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import greedy_tokens, process_fleet, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter-refit")
    a, b, d = (str(make_tiny_model(root / name, seed=seed)) for name, seed in (("a", 0), ("b", 1), ("d", 2)))
    expected = SimpleNamespace(a=greedy_tokens(a, PROMPTS, GREEDY), b=greedy_tokens(b, PROMPTS, GREEDY))
    assert expected.a != expected.b
    return SimpleNamespace(a=a, b=b, d=d, expected=expected)


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    spec = json.dumps({"method": "draft_model", "model": models.d, "num_speculative_tokens": 3,
                       "adaptive": False})  # K pinned: the test counts drafts under each epoch
    logs = tmp_path_factory.mktemp("drafter-refit-logs")
    with process_fleet(logs, models.a, [("--speculative-config", spec)]) as fleet:
        yield fleet


def tensors(model_dir: str) -> list:
    return [(name, tensor[:]) for name, tensor in iterate_checkpoint(model_dir)]


async def serve(client: InferenceClient, expected: list[list[int]], epoch: int) -> tuple[int, int]:
    """Greedy outputs are ``expected`` with ``epoch`` on every token; returns the engine's (draft tokens,
    accepted tokens) counters once its heartbeat counted every token generated so far."""
    generated = (await counters(client))["generation_tokens"]
    results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    assert [r.generated_tokens for r in results] == expected
    assert all(set(r.policy_epochs) == {epoch} for r in results)
    total = generated + sum(len(r.generated_tokens) for r in results)

    async def settled():
        now = await counters(client)
        return now if now["generation_tokens"] >= total else None

    now = await until(settled, 60, "the engine's heartbeat to count the tokens")
    return now["spec_decode_num_draft_tokens"], now["spec_decode_num_accepted_tokens"]


async def counters(client: InferenceClient) -> dict[str, int]:
    (engine,) = (await client.status())["engines"]
    return (engine["metrics"] or {}).get("counters") or {"generation_tokens": 0, "spec_decode_num_draft_tokens": 0,
                                                         "spec_decode_num_accepted_tokens": 0}


async def test_a_push_carrying_the_drafter_switches_policy_and_drafter_at_one_epoch(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(1, timeout=300)
        drafts, accepted = await serve(client, models.expected.a, 0)
        assert drafts > 0 and accepted < drafts  # control: drafter D is not policy A

        sender = WeightSender(client, backend="gloo", bucket_bytes=64 << 10, timeout=60)
        await client.pause()
        ack = await asyncio.wait_for(sender.send(tensors(models.b), epoch=3, drafter=tensors(models.b)), 300)
        assert ack["detail"]["epoch"] == 3
        await client.unpause()
        new_drafts, new_accepted = await serve(client, models.expected.b, 3)
        assert new_drafts > drafts and new_accepted - accepted == new_drafts - drafts  # the new drafter, always right

        await client.pause()
        await asyncio.wait_for(sender.send(tensors(models.a), epoch=4), 300)
        await client.unpause()
        assert await serve(client, models.expected.a, 4) == (new_drafts, new_accepted)  # stale drafter: no draft
