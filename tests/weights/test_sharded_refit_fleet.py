"""A sharded trainer refits a fleet (issue 50's acceptance), gloo on CPU, every rank its own process.

A coordinator and three engine groups (tensor-parallel 1, tensor-parallel 2, two pipeline stages) serve model A;
two trainer processes (``sharded_trainer.py``, world size 2) hold B as Megatron would (column-parallel weights cut
by rows, row-parallel by columns, vocabulary by rows, norms on rank 0) and each sends its own pieces. Afterwards
greedy outputs equal a server of B, token for token, on every group; each rank's acknowledgement counts its own
bytes; every engine rank received exactly its slices (a tensor-parallel rank never held a full tensor it does not
serve, a stage only its layers). The models' vocabulary (tied embedding) is most of their bytes, so that the
processes' peak memory (measured by the kernel) tells whether one held the full embedding: a trainer rank and a
tensor-parallel rank stay well below it, an engine rank that serves it and a trainer that gathers it (the control)
do not. Deltas send what changed. Overlapping pieces, a gap, a wrong full shape (from one rank, or from all), and a
rank that dies mid-transfer (rank 1, or rank 0, which serves the transfer's store) are refused with the fleet on
its old epoch, still serving, and the living rank raises well within its timeout of the other's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer
from megatron_serve.wire.sampling_params import SamplingParams

from ..devices import tensor_parallel_device
from ..helpers import Children, free_port, greedy_tokens, until
from ..forked import run_scripts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
TRAINER = Path(__file__).with_name("sharded_trainer.py")
BUCKET = 64 << 10
#: The trainer ranks' ``WeightSender`` timeout where a test holds them to it.
TRAINER_TIMEOUT = 60.0
EMBEDDING = "model.embed_tokens.weight"


def outputs(model_dir: str, **config) -> list[list[int]]:
    """Greedy outputs of an in-process engine."""
    return greedy_tokens(model_dir, PROMPTS, GREEDY, **config)


def rewritten(model_dir: str, out: Path, change) -> str:
    """A copy of ``model_dir`` (its other files linked) whose tensors are ``change(name, tensor)``."""
    out.mkdir()
    for item in Path(model_dir).iterdir():
        if item.name != "model.safetensors":
            (out / item.name).symlink_to(item)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    save_file({n: change(n, t).contiguous() for n, t in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return str(out)


def changed_layer(model_dir: str, out: Path, layer: int) -> str:
    """A copy of ``model_dir`` whose layer ``layer`` has every weight + 1 (what ``--change-layer`` sends)."""
    marker = f"model.layers.{layer}."
    return rewritten(model_dir, out, lambda n, t: t + 1 if n.startswith(marker) else t)


def reseeded(model_dir: str, out: Path, seed: int) -> str:
    """Another model of ``model_dir``'s shapes and tokenizer: fresh weights as transformers initialises them."""
    generator = torch.Generator().manual_seed(seed)
    return rewritten(model_dir, out, lambda n, t: t if "norm" in n else
                     torch.randn(t.shape, generator=generator, dtype=t.dtype) * 0.02)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-refit")
    # a vocabulary of 32768 x 256 (32 MiB, tied): most of the model's bytes, so that holding it shows in a peak
    a = str(make_tiny_model(root / "a", seed=0, hidden_size=256, vocab_size=32768, tie_word_embeddings=True))
    b = reseeded(a, root / "b", 1)
    b1 = changed_layer(b, root / "b1", 1)
    state = load_file(str(Path(b) / "model.safetensors"))
    expected = SimpleNamespace(a=outputs(a), b=outputs(b), b1=outputs(b1))
    assert len({str(expected.a), str(expected.b), str(expected.b1)}) == 3
    embedding = state[EMBEDDING].numel() * state[EMBEDDING].element_size()
    assert embedding > 0.9 * sum(t.numel() * t.element_size() for t in state.values())
    # the clients' tokenizer, loaded once (its 32768 tokens cost each client seconds to load)
    return SimpleNamespace(a=a, b=b, expected=expected, state=state, embedding=embedding,
                           tokenizer=Tokenizer.from_pretrained(a))


@contextlib.contextmanager
def three_groups(model: str, log_dir: Path, *third: str) -> Iterator[SimpleNamespace]:
    """A coordinator and three engine groups serving ``model`` (every rank a process of its own): tensor-parallel 1,
    tensor-parallel 2, and a two-rank group split as ``third`` says; every child killed after."""
    children = Children(log_dir)
    port = free_port()
    try:
        # round robin: every group gets some of every batch; a heartbeat timeout for a loaded machine (an engine
        # busy with its first steps for more than the default 10 s is removed, and registers again)
        children.coordinator(model, port, "--routing", "round_robin", "--heartbeat-timeout", "120")
        children.engine(model, port, "--group", "0")
        pair = ("--device", tensor_parallel_device(2))  # a machine with one GPU runs the two-rank groups on CPU
        children.engine(model, port, "--group", "1", "--tensor-parallel", "2", *pair)
        children.engine(model, port, "--group", "2", *third, *pair)
        yield SimpleNamespace(address=f"tcp://127.0.0.1:{port}", children=children, groups=3)
    finally:
        children.kill_all()


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    with three_groups(models.a, tmp_path_factory.mktemp("sharded-refit-logs"), "--pipeline-parallel-size",
                      "2") as groups:
        yield groups


def run_trainers(fleet, model: str, epoch: int, world_size: int, *extra: str,
                 rank_extra: dict[int, list[str]] | None = None) -> list[tuple[int, list[dict]]]:
    """Every trainer rank as its own process (forked from one that imported torch), side by side; each one's exit
    code and JSON lines."""
    trainer_port = free_port()
    argvs = [[fleet.address, model, str(epoch), str(rank), str(world_size), str(trainer_port),
              "--bucket-bytes", str(BUCKET), *extra, *(rank_extra or {}).get(rank, [])] for rank in range(world_size)]
    results = []
    for ended in run_scripts(TRAINER, argvs, {"MEGATRON_SERVE_TOKEN": fleet.children.secret}, timeout=600,
                             via="forkserver"):
        lines = [json.loads(line) for line in ended.stdout.splitlines() if line.startswith("{")]
        assert lines or ended.returncode < 0, ended.stderr[-3000:]
        results.append((ended.returncode, lines))
    return results


def expected_at(models, epoch: int) -> list[list[int]]:
    """What the fleet serves at ``epoch`` in this module: A at first, B from the first refit on, B1 from epoch 6."""
    return models.expected.a if epoch == 0 else models.expected.b1 if epoch == 6 else models.expected.b


async def ready(client: InferenceClient, groups: int) -> None:
    """Every engine group registered and past its first steps (heartbeats count its step loop's iterations)."""
    async def all_there():
        engines = (await client.status())["engines"]
        return len(engines) == groups and all(e["progress"] is not None for e in engines)

    # a quarter second apart: the fleet's start takes a minute or more of a loaded machine, and each STATUS costs the
    # client and coordinator CPU that the engines' start needs
    await until(all_there, 300, f"{groups} engine groups to serve", interval=0.25)


async def group_tokens(client: InferenceClient) -> dict[int, int]:
    """Tokens each engine group generated so far, as its last heartbeat counted them."""
    return {e["group"]: ((e["metrics"] or {}).get("counters") or {}).get("generation_tokens", 0)
            for e in (await client.status())["engines"]}


async def assert_serves(client: InferenceClient, expected: list[list[int]], epoch: int, groups: int = 3) -> None:
    """Greedy outputs are ``expected``, every token of ``epoch``, and every engine group served some of them: the
    coordinator routes round robin and heartbeats count each group's tokens; a group that registered again in
    between (a loaded machine: an engine that missed the coordinator for a while reconnects, and its requests go
    elsewhere) gets the next batch, up to four."""
    await ready(client, groups)
    first = await group_tokens(client)
    for _ in range(4):
        before = await group_tokens(client)
        results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
        assert [r.generated_tokens for r in results] == expected
        assert all(set(r.policy_epochs) == {epoch} for r in results)

        async def counted():
            now = await group_tokens(client)
            return now if sum(now.values()) - sum(before.values()) >= len(PROMPTS) * 8 else None

        # heartbeats come once a second: polling faster only costs STATUS requests
        now = await until(counted, 60, "the engines' heartbeats to count the tokens", interval=0.1)
        if all(now[group] > first[group] for group in range(groups)):
            return
    raise AssertionError(f"not every engine group served: tokens per group {first} before, {now} after")


def figures_add_up(facts: dict, bytes_key: str, seconds_key: str) -> bool:
    """An acknowledgement's rate is its bytes over its seconds (both there, positive; seconds rounded to 1 us)."""
    rate = facts[bytes_key] / facts[seconds_key] if facts[seconds_key] > 0 else 0
    return rate > 0 and abs(facts["bytes_per_s"] - rate) <= 1e-3 * rate


async def test_two_trainer_ranks_refit_a_fleet_each_with_its_own_pieces(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret, tokenizer=models.tokenizer) as client:
        await ready(client, fleet.groups)
        await assert_serves(client, models.expected.a, 0)
        await client.pause()
        # the engines' first refit: their peak memory counts what it costs them (a later one may reuse memory the
        # first freed, which is no rise: weights.peak)
        results = await asyncio.to_thread(run_trainers, fleet, models.b, 2, 2)
        assert [code for code, _ in results] == [0, 0], results
        acks = [lines[-1] for _, lines in results]
        assert all(ack["state"] == "PAUSED" and ack["detail"]["epoch"] == 2 for ack in acks)
        senders = [ack["detail"]["sender"] for ack in acks]
        assert [s["rank"] for s in senders] == [0, 1] and all(s["world_size"] == 7 for s in senders)
        # engine ranks: 2 (group 0, serves everything), 3 and 4 (group 1's tensor-parallel ranks), 5 and 6 (group
        # 2's stages: each its layers, and the embedding and final norm that every stage holds)
        receivers = {int(r): facts for r, facts in acks[0]["detail"]["receivers"].items()}
        assert sorted(receivers) == [2, 3, 4, 5, 6]
        held = [lines[0]["holds"] for _, lines in results]
        for rank, sender in enumerate(senders):
            # each rank's acknowledgement counts its own bytes: to the engine rank that serves everything,
            # exactly the pieces this rank holds; to the tensor-parallel ranks, less
            assert sender["links"]["2"] == held[rank], (rank, sender)
            assert sender["links"].get("3", 0) + sender["links"].get("4", 0) < 1.2 * held[rank]
            assert sender["bytes"] == sum(sender["links"].values()) and sender["skipped_bytes"] == 0
            assert figures_add_up(sender, "bytes", "transfer_s"), sender
        assert sum(s["bytes"] for s in senders) == sum(f["bytes"] for f in receivers.values())
        assert all(figures_add_up(facts, "bytes", "seconds") and facts["load_s"] > 0 for facts in receivers.values())
        total = sum(t.numel() * t.element_size() for t in models.state.values())
        layers = {s: sum(t.numel() * t.element_size() for n, t in models.state.items()
                         if n.startswith(f"model.layers.{s}.")) for s in (0, 1)}
        assert receivers[2]["bytes"] == receivers[2]["serves_bytes"] == total
        for rank in (3, 4):  # every byte of its slices and nothing else: about half the model, no full tensor
            assert receivers[rank]["bytes"] == receivers[rank]["serves_bytes"] < 0.55 * total
            assert receivers[rank]["largest_tensor_bytes"] == models.embedding // 2
        for stage, rank in enumerate((5, 6)):  # its stage's layer, never the other's
            assert receivers[rank]["bytes"] == total - layers[1 - stage], (stage, receivers[rank])
        # peak memory, as the kernel counts it: nobody held the full embedding who does not serve it, while the
        # ranks that serve it held it (staged before the commit)
        assert all(lines[0]["largest"] <= models.embedding // 2 for _, lines in results)
        assert all(lines[-1]["peak_rss_bytes"] < 0.75 * models.embedding for _, lines in results), acks
        peaks = {rank: facts["peak_rss_bytes"] for rank, facts in receivers.items()}
        assert all(peaks[rank] < 0.75 * models.embedding for rank in (3, 4)), (peaks, models.embedding)
        # (host memory: an engine on a GPU stages in pinned memory, which CUDA's host allocator keeps for the next)
        assert all(peaks[rank] > models.embedding for rank in (2, 5, 6)
                   if rank != 2 or not torch.cuda.is_available()), (peaks, models.embedding)

        # the control of the memory figures: trainer ranks that gather the embedding whole hold it, and show it
        control = await asyncio.to_thread(run_trainers, fleet, models.b, 3, 2, "--gather", EMBEDDING)
        assert [code for code, _ in control] == [0, 0], control
        assert all(lines[-1]["peak_rss_bytes"] > models.embedding for _, lines in control), control
        await client.unpause()
        await assert_serves(client, models.expected.b, 3)


async def test_a_delta_sends_only_what_changed(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret, tokenizer=models.tokenizer) as client:
        await ready(client, fleet.groups)
        await client.pause()
        status = await client.status()
        if status["epoch"] != 3:
            results = await asyncio.to_thread(run_trainers, fleet, models.b, 3, 2)
            assert [code for code, _ in results] == [0, 0], results

        def sent(results) -> tuple[int, int]:
            assert [code for code, _ in results] == [0, 0], results
            senders = [lines[-1]["detail"]["sender"] for _, lines in results]
            return sum(s["bytes"] for s in senders), sum(s["skipped_bytes"] for s in senders)

        # after a full refit the engines hold no digests: the first delta sends everything, with its digests
        first = sent(await asyncio.to_thread(run_trainers, fleet, models.b, 4, 2, "--delta"))
        assert first[0] > 0 and first[1] == 0
        again = sent(await asyncio.to_thread(run_trainers, fleet, models.b, 5, 2, "--delta"))
        assert sum(again) == first[0] and again[0] <= 0.02 * first[0]  # unchanged: (almost) nothing travels
        await client.unpause()
        await assert_serves(client, models.expected.b, 5)

        await client.pause()
        layer_1 = sent(await asyncio.to_thread(run_trainers, fleet, models.b, 6, 2, "--delta", "--change-layer", "1"))
        layer = {n: t.numel() * t.element_size() for n, t in models.state.items() if n.startswith("model.layers.1.")}
        norms = sum(size for name, size in layer.items() if "norm" in name)
        # layer 1 once to group 0, once in slices to group 1, whose ranks both hold the (replicated) norms, and
        # once to group 2's second stage
        assert layer_1[0] == 3 * sum(layer.values()) + norms and sum(layer_1) == first[0]
        await client.unpause()
        await assert_serves(client, models.expected.b1, 6)


@pytest.mark.parametrize("flags, error, message", [
    ({1: ["--overlap"]}, "ValueError", "overlap at"), ({1: ["--gap"]}, "ValueError", "leave a gap"),
    ({1: ["--wrong-shape"]}, "ValueError", "trainer ranks disagree on"),
    # every rank agrees on a full shape the model does not have: the engines' verify step refuses it
    ({0: ["--grow", "model.layers.0.self_attn.q_proj.weight"], 1: ["--grow", "model.layers.0.self_attn.q_proj.weight"]},
     "ControlError", "model.layers.0.self_attn.q_proj.weight")])
async def test_bad_pieces_are_refused_before_any_engine_changes(fleet, models, flags, error, message):
    async with InferenceClient(fleet.address, token=fleet.children.secret, tokenizer=models.tokenizer) as client:
        await ready(client, fleet.groups)
        await client.pause()
        before = (await client.status())["epoch"]
        results = await asyncio.to_thread(run_trainers, fleet, models.a, 9, 2, rank_extra=flags)
        assert [code for code, _ in results] == [1, 1]
        for _, lines in results:  # every rank says why, the same way
            assert lines[-1]["type"] == error and message in lines[-1]["error"], lines[-1]
        status = await client.status()
        assert status["epoch"] == before and all(e["epoch"] == before for e in status["engines"])
        await client.unpause()
        await assert_serves(client, expected_at(models, before), before)


@pytest.mark.parametrize("dying", [1, 0])
async def test_a_rank_that_dies_mid_transfer_leaves_every_engine_on_its_old_epoch(fleet, models, dying):
    """Rank 1, or rank 0 (which serves the transfer's store and sent the REFIT): the other trainer rank and every
    engine rank notice, no engine changes, and the fleet serves on. The living rank raises well within its timeout
    of the death: rank 0 does not wait for a dead rank to read the outcome (it did, the whole timeout, before)."""
    async with InferenceClient(fleet.address, token=fleet.children.secret, tokenizer=models.tokenizer) as client:
        await ready(client, fleet.groups)
        await client.pause()
        before = (await client.status())["epoch"]
        # a long timeout: the dying rank's peers notice its closed connections at once, while a short one (20 s:
        # engines joining, each message) can fail rank 1 before its second bucket under load
        results = await asyncio.to_thread(run_trainers, fleet, models.a, 11, 2, "--timeout", str(TRAINER_TIMEOUT),
                                          rank_extra={dying: ["--die-after-bucket", "2"]})
        (code, lines), (dead_code, dead_lines) = results[1 - dying], results[dying]
        assert dead_code == -9 and dead_lines[-1]["bucket"] == 2, results
        assert code == 1 and lines[-1]["type"] in ("ControlError", "WeightTransferError"), lines[-1]
        if dying == 1:  # rank 0 hears the coordinator's answer
            assert "no weights were changed" in lines[-1]["error"], lines[-1]
        # ... and raises it without waiting out its timeout for the dead rank to read it
        assert lines[-1]["at"] - dead_lines[-1]["at"] < TRAINER_TIMEOUT / 2, (lines[-1], dead_lines[-1])

        async def settled():
            status = await client.status()
            return status if not status["pending_controls"] else None

        status = await until(settled, 120, "the broken REFIT to be answered")
        assert status["epoch"] == before and not status["incomplete_weights"]
        assert all(e["epoch"] == before for e in status["engines"])
        await client.unpause()  # nothing changed: the fleet serves on
        await assert_serves(client, expected_at(models, before), before)
