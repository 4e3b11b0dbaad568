"""The coordinator serves while its tokenizer loads in the background (``tokenizer_loader``).

Token ids are served at once; text prompts that arrive before the tokenizer is ready are held in
arrival order and released when it is, or refused with the load's error if it fails.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from megatron_serve import cli
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.request import FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.wire.security import make_secret

from .fakes import expected_tokens
from ..helpers import Children, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

FIVE = SamplingParams(num_tokens_to_generate=5)


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def gated_loader(release: threading.Event, error: Exception | None = None):
    """A loader that blocks until ``release`` is set, then returns a tokenizer or raises ``error``."""

    def load() -> CharTokenizer:
        assert release.wait(60), "never released"
        if error is not None:
            raise error
        return CharTokenizer()

    return load


async def test_text_prompts_wait_for_the_tokenizer_and_token_ids_do_not(fleet_factory):
    release = threading.Event()
    fleet = fleet_factory(tokenizer_loader=gated_loader(release))
    fleet.add_engine(max_requests=1)  # one request at a time: completions show the dispatch order
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await client.wait_for_engines(1, timeout=20, poll=0.02)
        texts = ["first", "second", "third"]
        held = [client.add_request(t, FIVE) for t in texts]
        aborted = client.add_request("never mind", FIVE, request_id="aborted")
        client.abort("aborted")
        ids = await asyncio.wait_for(client.add_request([1, 2, 3], FIVE), 10)  # served while the tokenizer loads
        assert ids.generated_tokens == expected_tokens([1, 2, 3], 5)
        dropped = await asyncio.wait_for(aborted, 10)
        assert dropped.status is RequestStatus.FAILED and dropped.finish_reason is FinishReason.ABORT
        assert not any(f.done() for f in held)
        assert (await client.status())["queued"] == 3  # held prompts count as queued

        release.set()
        results = await asyncio.wait_for(asyncio.gather(*held), 10)
        for text, result in zip(texts, results):
            assert result.status is RequestStatus.COMPLETED
            assert result.prompt_tokens == CharTokenizer().encode(text)
            assert result.generated_tokens == expected_tokens(result.prompt_tokens, 5)
        finished = [r.finish_time for r in results]
        assert finished == sorted(finished)  # released in arrival order
        status = await client.status()
        assert status["completed"] == 4 and status["queued"] == 0


async def test_a_failed_load_refuses_text_prompts_and_keeps_serving_token_ids(fleet_factory):
    release = threading.Event()
    fleet = fleet_factory(tokenizer_loader=gated_loader(release, FileNotFoundError("no tokenizer.json in /models/x")))
    fleet.add_engine()
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await client.wait_for_engines(1, timeout=20, poll=0.02)
        early = client.add_request("too early", FIVE)
        await asyncio.wait_for(client.add_request([4, 5, 6], FIVE), 10)
        release.set()
        problem = r"could not load its tokenizer \(FileNotFoundError: no tokenizer.json in /models/x\)"
        with pytest.raises(ValueError, match=problem):
            await asyncio.wait_for(early, 10)
        with pytest.raises(ValueError, match=problem):
            await asyncio.wait_for(client.add_request("too late", FIVE), 10)
        result = await asyncio.wait_for(client.add_request([7, 8, 9], FIVE), 10)
        assert result.generated_tokens == expected_tokens([7, 8, 9], 5)
        status = await client.status()
        assert status["completed"] == 2 and status["queued"] == 0 and status["in_flight"] == 0


async def test_coordinator_command_listens_before_its_tokenizer_is_loaded(tmp_path, tiny_model):
    children = Children(tmp_path)
    port = free_port()
    try:
        proc = children.coordinator(tiny_model, port)
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
            assert (await client.status())["state"] == "RUNNING"
        wait_until(lambda: "tokenizer ready" in children.log_of(proc), 120, "the tokenizer loaded")
        log = children.log_of(proc)
        assert log.index("listening on") < log.index("tokenizer ready")
        assert proc.poll() is None
    finally:
        children.kill_all()


def test_coordinator_command_refuses_a_model_directory_without_tokenizer_files(tmp_path, capsys):
    assert cli.main(["coordinator", "--model", str(tmp_path / "no-model"), "--port", "0"]) == 1
    assert "no tokenizer.json or tokenizer_config.json in model directory" in capsys.readouterr().err


def test_a_coordinator_process_freezes_its_heap_once_the_tokenizer_has_loaded():
    """``serve()`` runs a coordinator as a process of its own: what start-up and the tokenizer's load left
    alive (transformers, torch: a full collection of them took 184 ms) is kept out of later collections."""
    import gc

    from megatron_serve.coordinator import Coordinator

    release = threading.Event()
    coordinator = Coordinator(tokenizer_loader=gated_loader(release), port=free_port(), token=make_secret())
    coordinator.freeze_heap = True  # what serve() sets (serve() itself would also install signal handlers)
    serving = threading.Thread(target=coordinator.run, daemon=True)
    gc.unfreeze()
    try:
        serving.start()
        wait_until(lambda: coordinator._tokenizer_loading is not None, 10, "the load to start")
        assert gc.get_freeze_count() == 0  # still loading
        release.set()
        wait_until(lambda: coordinator.core.tokenizer is not None and gc.get_freeze_count() > 0, 10,
                   "the tokenizer and a frozen heap")
    finally:
        coordinator.shutdown()
        serving.join(10)
        gc.unfreeze()
