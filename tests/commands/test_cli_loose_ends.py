"""The small things a newcomer tripped on (issue 41): a refused flag's 63 lines of usage, ``control status | head``
ending in a ``BrokenPipeError`` traceback, and ``InferenceClient`` ignoring ``$MEGATRON_SERVE_TOKEN``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_serve.cli import parse_args
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.connection import Unauthorized
from megatron_serve.wire.security import TOKEN_ENV

from ..helpers import Children, free_port

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("argv,reason", [
    (["run", "--model", "/m", "--speculative-config", "[1]"], "--speculative-config: must be a JSON object, got '[1]'"),
    (["serve", "/m", "--routing", "fastest"], "argument --routing: invalid choice: 'fastest'"),
    (["control", "status", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_refused_argument_prints_one_usage_line_and_its_reason(argv, reason, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()  # the whole usage of `run` was 63 lines
    assert usage.startswith(f"usage: megatron-serve {argv[0]} ") and usage.endswith("[options] (--help lists them)")
    assert error.startswith(f"megatron-serve {argv[0]}: error: ") and reason in error


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """A real coordinator with a fleet secret (no engines: ``status`` answers all the same)."""
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("loose-ends")
    model = str(make_tiny_model(tmp / "model", seed=0))
    children = Children(tmp)
    port = free_port()
    children.coordinator(model, port)
    try:
        yield f"tcp://127.0.0.1:{port}", children.secret
    finally:
        children.kill_all()


def _with_stdout_closed(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``argv`` with its standard output a pipe whose reader left before it wrote (as ``| head`` does)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, "", err.decode())


def test_control_status_into_a_closed_pipe_exits_quietly(coordinator):
    import os  # noqa: PLC0415

    address, secret = coordinator
    env = {**os.environ, TOKEN_ENV: secret}
    control = _with_stdout_closed([sys.executable, "-m", "megatron_serve.cli", "control", "status", "--coordinator",
                                   address, "--timeout", "60"], env)
    assert control.returncode == 141 and control.stderr == "", control.stderr  # 128 + SIGPIPE, as `yes | head`
    # the control: a plain Python print into the same closed pipe does end in a BrokenPipeError
    plain = _with_stdout_closed([sys.executable, "-c", "print('status ' * 100)"], env)
    assert "BrokenPipeError" in plain.stderr


async def test_inference_client_reads_the_token_from_the_environment(coordinator, monkeypatch):
    address, secret = coordinator
    monkeypatch.setenv(TOKEN_ENV, secret)
    async with InferenceClient(address) as client:  # no token=: $MEGATRON_SERVE_TOKEN's
        assert "state" in await client.status(timeout=60)
    with pytest.raises(Unauthorized):  # token=None is still an insecure client, whatever the environment says
        async with InferenceClient(address, token=None) as client:
            await client.status(timeout=60)
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(Unauthorized):  # neither: no secret (before, the environment's was never read)
        async with InferenceClient(address) as client:
            await client.status(timeout=60)


async def test_megatron_llm_of_another_fleet_reads_the_token_from_the_environment(coordinator, monkeypatch, tmp_path):
    """Issue 65: ``MegatronAsyncLLM(use_coordinator=True, coordinator_address=...)`` connected without a secret while
    its refusal told the user to set ``$MEGATRON_SERVE_TOKEN``; it reads it now, as ``InferenceClient`` does."""
    from megatron_serve import MegatronAsyncLLM  # noqa: PLC0415
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    address, secret = coordinator
    model = str(make_tiny_model(tmp_path / "model", seed=0))
    monkeypatch.setenv(TOKEN_ENV, secret)
    llm = MegatronAsyncLLM(model, use_coordinator=True, coordinator_address=address)
    try:
        assert "state" in await llm.status()
    finally:
        await llm.close()
    monkeypatch.delenv(TOKEN_ENV)
    llm = MegatronAsyncLLM(model, use_coordinator=True, coordinator_address=address)  # the control: no secret
    try:
        with pytest.raises(Unauthorized):
            await llm.status()
    finally:
        await llm.close()


@pytest.mark.parametrize("module,reason", [
    ("llama=/adapters/x", "an adapter named 'llama' would shadow the served model's name"),
    ("a/b=/adapters/x", "LoRA adapter name 'a/b' is not allowed"),
])
def test_lora_modules_are_refused_before_anything_starts(module, reason):
    """Issue 55: an adapter named like the served model (its requests could reach neither) or outside the name
    pattern is refused at start, in one line."""
    from megatron_serve.commands.run import run  # noqa: PLC0415

    with pytest.raises(ValueError, match=reason):
        run(parse_args(["run", "--model", "/models/llama", "--enable-lora", "--lora-modules", module]))


def test_lora_modules_files_are_checked_before_an_engine_starts(tiny_model, tmp_path):
    """Issue 65: a missing adapter directory or one of too high a rank was refused by the engine once it had loaded
    the model (and `serve` reported the engine's exit); now `run` reads each adapter first and says what is wrong.
    No child is started: `run` raises before it reserves a port."""
    from megatron_serve.commands.run import run  # noqa: PLC0415

    from ..lora_adapters import make_peft_adapter  # noqa: PLC0415

    with pytest.raises(ValueError, match=f"LoRA adapter 'gone': '{tmp_path}/missing' does not exist"):
        run(parse_args(["run", "--model", tiny_model, "--enable-lora", "--lora-modules", f"gone={tmp_path}/missing"]))
    wide = make_peft_adapter(tiny_model, tmp_path / "wide", rank=32, seed=0)
    with pytest.raises(ValueError, match="LoRA adapter 'wide'.*rank 32"):
        run(parse_args(["run", "--model", tiny_model, "--enable-lora", "--max-lora-rank", "16",
                        "--lora-modules", f"wide={wide}"]))


def test_a_missing_lora_directory_is_refused_before_the_model_is_fetched_or_converted(tmp_path, monkeypatch):
    """Issue 87: the refusal came after the model's slow steps (a GGUF file's first conversion: 16.6 s); a model that
    would have to be fetched shows the order (offline here: fetching it fails with another message)."""
    from megatron_serve.commands.run import run  # noqa: PLC0415

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for path, reason in ((tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory")):
        (tmp_path / "file").write_text("")
        with pytest.raises(ValueError, match=f"^LoRA adapter 'gone': '{path}' {reason}$"):
            run(parse_args(["serve", "nobody/no-such-model", "--enable-lora", "--lora-modules", f"gone={path}"]))


@pytest.mark.parametrize("flags", [["--enable-expert-parallel"], ["--enable-expert-parallel", "--enable-eplb"]])
def test_expert_parallelism_for_a_model_without_experts_is_refused_in_one_line(tiny_model, flags):
    """Issue 87: accepted without a word on a dense model, where it places and balances nothing."""
    from megatron_serve.commands.run import run  # noqa: PLC0415

    with pytest.raises(ValueError, match=f"^{' '.join(flags)}: LlamaForCausalLM has no experts .*leave"):
        run(parse_args(["run", "--model", tiny_model, *flags]))


@pytest.mark.parametrize("layout,reason", [
    (["--tensor-parallel-size", "3"], "num_attention_heads=4 does not split over 3 tensor-parallel ranks"),
    (["--pipeline-parallel-size", "5"], "2 layers do not split into 5 pipeline stages"),
])
def test_a_layout_the_model_cannot_take_is_refused_before_a_rank_starts(tiny_model, layout, reason):
    """Issue 65: these two were refused by the ranks once they had started, and `serve` printed a rank's 14-line
    traceback tail before the reason; `run` now asks the model's config first (no child started: it raises before
    it reserves a port)."""
    from megatron_serve.commands.run import run  # noqa: PLC0415

    with pytest.raises(ValueError, match=reason):
        run(parse_args(["run", "--model", tiny_model, *layout]))
