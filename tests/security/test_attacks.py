"""The attacks of a process on the same machine against ``megatron-serve run --engines 2`` with its defaults.

One real ``run`` (coordinator, two engine processes, the HTTP server) in a private runtime directory.
The attacker knows the coordinator's address (it scans ports) and, in the worst case, its public key
(as if it leaked), but not the fleet secret: every rogue engine, rogue client and replayed connection
is refused, receives nothing (no heartbeat, no request, no status, no result), and the fleet's answers
stay those it gave before the attacks. An insider holding the secret still cannot take over another
peer's identity.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
import torch

from megatron_serve.client.coordinator_client import InferenceClient, Unauthorized
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.wire.security import FleetSecret, make_secret
from megatron_serve import WeightSender

from ..helpers import RawPeer, free_port, until
from ..processes import stop_process_group
from ..server.conftest import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = "sk-" + "7" * 40
CHAT = [{"role": "user", "content": "my secret password is hunter23; what is it?"}]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
VERBS = [
    (Header.PAUSE, {"control_id": "p", "mode": "abort"}), (Header.SUSPEND, {"control_id": "s", "level": 2}),
    (Header.STOP, {"control_id": "x"}), (Header.REFIT, {"control_id": "r", "source": "/tmp/evil", "epoch": 666}),
    (Header.UNPAUSE, {"control_id": "u"}), (Header.RESUME, {"control_id": "m"}), (Header.STATUS, {"status_id": 1}),
    (Header.SUBMIT, {"client_request_id": "q", "prompt": [1, 2, 3]}), (Header.ABORT, {"client_request_id": "q"}),
    (Header.RESULT_ACK, {"client_request_ids": ["q"]}), (Header.HEARTBEAT, {}),
]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    home = tmp_path_factory.mktemp("attacked-run")
    runtime = home / "runtime"
    runtime.mkdir(mode=0o700)
    port = free_port()
    output = home / "run.out"
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_SERVE_TOKEN", "MEGATRON_SERVE_API_KEY")}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    with open(output, "wb") as out:  # the defaults, an API key on the command line (the banner's case)
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", tiny_model, "--engines", "2", "--port",
             str(port), "--coordinator-port", "0", "--num-kv-blocks", "128", "--api-key", API_KEY, "--log-dir",
             str(home / "logs"), "--drain-timeout", "5"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env,
            cwd=home)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, output)
        run_dir = runtime / "megatron-serve" / str(proc.pid)
        facts = json.loads((run_dir / "run.json").read_text())
        secret = (run_dir / "secret").read_text().strip()
        state = SimpleNamespace(proc=proc, url=url, output=output, run_dir=run_dir, address=facts["coordinator"],
                                secret=secret, env=env, home=home)
        state.baseline = asyncio.run(answers(state))
        yield state
    finally:
        stop_process_group(proc)  # the run stops its fleet on SIGINT


async def answers(stack) -> SimpleNamespace:
    """What the fleet answers now: greedy tokens of PROMPTS, the chat's text, its state and epoch."""
    async with InferenceClient(stack.address, token=stack.secret, role="client") as client:
        tokens = [r.generated_tokens for r in await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))]
        status = await client.status()
    async with httpx.AsyncClient(base_url=stack.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as h:
        chat = (await h.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": CHAT, "max_tokens": 8,
                                                            "temperature": 0})).json()["choices"][0]["message"]
    return SimpleNamespace(tokens=tokens, chat=chat["content"], state=status["state"], epoch=status["epoch"],
                           engines=sorted(e["id"] for e in status["engines"]))


def rogues(stack) -> dict[str, RawPeer]:
    """Attackers without the fleet secret: plain TCP, a guessed secret, the coordinator's leaked public key."""
    return {"plain": RawPeer(stack.address, None), "guessed secret": RawPeer(stack.address, make_secret()),
            "leaked public key": RawPeer(stack.address, None, server_key=FleetSecret(stack.secret).server_public)}


def assert_told_nothing(peers: dict[str, RawPeer]) -> None:
    for name, peer in peers.items():
        assert peer.received() == [], f"the {name} rogue received messages"
        peer.close()


def test_the_run_keeps_its_secret_to_its_user_and_its_coordinator_on_loopback(stack):
    assert stack.run_dir.stat().st_mode & 0o777 == 0o700
    for name in ("run.json", "secret"):
        assert (stack.run_dir / name).stat().st_mode & 0o777 == 0o600
    assert len(stack.secret) >= 32 and stack.secret not in stack.output.read_text()
    port = int(stack.address.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):  # another address of this machine: not bound there
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    text = stack.output.read_text()
    assert "encrypted, fleet secret required" in text
    assert API_KEY not in text  # the banner goes to logs: it names a variable to set instead (it printed the key)
    note, curl = re.search(r"try \((.*)\): (curl .*)$", text, re.MULTILINE).groups()
    assert note == "with MEGATRON_SERVE_API_KEY set to the key given by --api-key"
    done = subprocess.run(["bash", "-c", curl + " --fail-with-body -s"], capture_output=True, text=True, timeout=120,
                          env={**stack.env, "MEGATRON_SERVE_API_KEY": API_KEY})  # the banner's command, as printed
    assert done.returncode == 0 and json.loads(done.stdout)["object"] == "text_completion", done.stdout


async def test_rogue_engines_receive_no_request_and_no_heartbeat(stack):
    peers = rogues(stack)
    for peer in peers.values():
        peer.send(Header.HELLO, {"role": "engine", "capacity": 100_000, "info": {"kv_blocks_total": 1 << 20},
                                    "protocol": PROTOCOL_VERSION})
        peer.send(Header.HEARTBEAT, {"running": 0, "waiting": 0, "kv_blocks_free": 1 << 20})
    async with httpx.AsyncClient(base_url=stack.url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"},
                                 limits=httpx.Limits(max_connections=40)) as http:
        replies = await asyncio.gather(*(http.post("/v1/chat/completions", json={
            "model": "tiny-llama", "messages": CHAT, "max_tokens": 8, "temperature": 0}) for _ in range(40)))
    assert [r.status_code for r in replies] == [200] * 40
    assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {stack.baseline.chat}
    assert_told_nothing(peers)
    assert (await answers(stack)).engines == stack.baseline.engines


async def test_rogue_clients_issuing_every_verb_change_nothing(stack):
    peers = rogues(stack)
    for peer in peers.values():
        peer.send(Header.HELLO, {"role": "client", "client_id": "rogue"})
        for header, body in VERBS:
            peer.send(header, body)
    now = await answers(stack)  # after the verbs had time to arrive: the legitimate client's own round trips
    assert_told_nothing(peers)
    assert (now.state, now.epoch, now.tokens, now.chat) == ("RUNNING", 0, stack.baseline.tokens, stack.baseline.chat)


async def test_a_rogue_weight_sender_is_refused_before_any_transfer(stack, tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(0.5)
    for token in (None, make_secret()):
        client = InferenceClient(stack.address, token=token)
        with pytest.raises(Unauthorized, match="refused"):
            await client.start(timeout=60)
        with pytest.raises(RuntimeError, match="not started"):
            await WeightSender(client, backend="gloo").send(model.named_parameters(), epoch=666)
    now = await answers(stack)
    assert (now.epoch, now.tokens) == (0, stack.baseline.tokens)


class RecordingProxy:
    """A TCP proxy between one client and the coordinator that keeps every byte the client sent."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("tcp://").rpartition(":")
        self.upstream = (host, int(port))
        self.sent = bytearray()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, record: bool) -> None:
            while data := await source.read(65536):
                if record:
                    self.sent += data
                sink.write(data)
                await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False), return_exceptions=True)

    def close(self) -> None:
        self.server.close()


async def test_replayed_traffic_of_a_legitimate_client_is_refused(stack):
    proxy = RecordingProxy(stack.address)
    through = await proxy.start()
    async with InferenceClient(through, token=stack.secret, role="control") as client:
        assert (await client.pause(timeout=60))["state"] == "PAUSED"  # recorded: HELLO, then PAUSE
    proxy.close()
    async with InferenceClient(stack.address, token=stack.secret, role="control") as control:
        assert (await control.unpause(timeout=60))["state"] == "RUNNING"
    host, _, port = stack.address.removeprefix("tcp://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(bytes(proxy.sent))  # the same bytes, on a new connection
    await writer.drain()
    received = await asyncio.wait_for(reader.read(), 60)  # until the coordinator hangs up
    writer.close()
    assert b"\x05READY" not in received and b"MESSAGE" not in received  # the handshake never completed
    now = await answers(stack)
    assert (now.state, now.tokens) == ("RUNNING", stack.baseline.tokens)


async def queued(client: InferenceClient) -> bool:
    return (await client.status())["queued"] >= 1


async def test_an_insider_cannot_take_over_another_peers_identity(stack):
    """Holding the secret is not being anybody: a client id and an engine group stay with their holders."""
    async with InferenceClient(stack.address, token=stack.secret, role="control") as control, \
            InferenceClient(stack.address, token=stack.secret, client_id="victim") as victim:
        await control.pause(timeout=60)
        waiting = victim.add_request(PROMPTS[0], GREEDY, request_id="mine")  # held while the fleet is paused
        await until(lambda: queued(control), 30, "the request to reach the coordinator")
        thief = RawPeer(stack.address, stack.secret)
        thief.send(Header.HELLO, {"role": "client", "client_id": "victim", "acks": True})
        refusal = thief.recv(30_000)
        assert refusal.header is Header.ERROR and refusal.body.code == "unauthorized"
        engine_id = (await control.status())["engines"][0]["id"]
        impostor = RawPeer(stack.address, stack.secret)
        impostor.send(Header.HELLO, {"role": "engine", "engine_group": 0, "capacity": 1000,
                                  "protocol": PROTOCOL_VERSION})
        refusal = impostor.recv(30_000)
        assert refusal.header is Header.ERROR and refusal.body.code == "group_in_use"
        impostor.send(Header.ENGINE_STEP, {"engine_id": engine_id, "outputs": [{
            "request_id": "victim/mine", "new_tokens": [1], "finished": True}], "records": {
            "victim/mine": {"status": "COMPLETED", "generated_tokens": [1], "generated_text": "forged"}}})
        await control.unpause(timeout=60)
        result = await asyncio.wait_for(waiting, 120)
        assert result.generated_tokens == stack.baseline.tokens[0] and result.generated_text != "forged"
        assert thief.received() == []  # no result of the victim's
        assert {m.header for m in impostor.received()} <= {Header.ERROR}  # no request; "hello_required" at most
        thief.close()
        impostor.close()
