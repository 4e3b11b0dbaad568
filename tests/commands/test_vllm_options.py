"""``vllm serve``'s options, from the one table (``client/vllm_options.py``): every row parses, accepted
options warn naming themselves, refused ones say why, and every argument ``serve`` cannot parse prints
``serve``'s usage (a combination refused once parsed is one line, as every check of the commands).

One real ``serve`` process closes the loop: with every implemented option (their effects checked over HTTP)
and every accepted option (each warns once, and nothing else warns).
Before this work ``--trust-remote-code``, ``--enable-auto-tool-choice``, ``--kv-cache-dtype`` ...
stopped ``serve`` with ``unrecognized arguments`` under the top-level usage.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from megatron_serve.cli import main, parse_args
from megatron_serve.client.vllm_options import VLLM_OPTIONS, Status, accepted_warnings
from megatron_serve.model.tiny import CHAT_TEMPLATE, make_tiny_model

from .test_hub import hub_cache
from ..lora_adapters import make_peft_adapter
from ..processes import start_cli, stop_process_group
from ..server.conftest import wait_ready
from ..server.test_openai_e2e import free_port

HUB_ID = "test-org/tiny"
SERVE_USAGE = "usage: megatron-serve serve "


def arguments(rows, **places: str) -> list[str]:
    return [arg.format(**places) for row in rows for arg in row.example]


def rows(status: Status) -> list:
    return [row for row in VLLM_OPTIONS if row.status is status]


def test_every_row_parses_under_every_spelling():
    places = {"model": "/m", "port": "8000", "tmp": "/tmp/x"}
    for row in rows(Status.IMPLEMENTED) + rows(Status.ACCEPTED):
        if not row.example:
            assert row.name == "--model"  # serve takes it as its first argument
            continue
        for flag in row.flags:
            argv = [flag, *arguments([row], **places)[1:]]
            args = parse_args(["run", "--model", "/m", *argv])
            assert args.command == "run", row.name
            warned = accepted_warnings(args)
            assert (len(warned) == 1 and row.name in warned[0]) if row.status is Status.ACCEPTED else not warned


def test_requests_are_not_logged_unless_asked():
    """Off by default, as in vLLM: the table's ``--disable-log-requests`` shares the flag's ``dest`` with a default of
    argparse's SUPPRESS, and read from the YAML as a string it was a default of its own, truthy, that turned request
    logging (every prompt, two lines a request) on in every server."""
    assert parse_args(["run", "--model", "/m"]).log_requests is False
    assert parse_args(["serve", "/m"]).log_requests is False
    assert parse_args(["run", "--model", "/m", "--enable-log-requests"]).log_requests is True
    assert parse_args(["run", "--model", "/m", "--disable-log-requests"]).log_requests is False
    suppressed = [row for row in VLLM_OPTIONS if row.spec is not None and row.spec.get("default") == argparse.SUPPRESS]
    assert suppressed and all(row.spec["default"] is argparse.SUPPRESS for row in suppressed)


def test_refused_options_and_unknown_ones_stop_serve_with_its_usage(capsys):
    for row in rows(Status.REFUSED):
        for flag in row.flags:
            with pytest.raises(SystemExit) as stopped:
                parse_args(["serve", "/m", flag, "value"])
            assert stopped.value.code == 2
            err = capsys.readouterr().err
            assert SERVE_USAGE in err and f"{flag}: {row.reason}" in err
    for argv, message in ((["--not-a-vllm-option"], "unrecognized arguments: --not-a-vllm-option"),
                          (["--quantization", "awq"], "'awq' is not supported by this build (supported: auto, none, gguf, fp8)"),
                          (["--kv-cache-dtype", "fp8_e5m2"],
                           "'fp8_e5m2' is not supported by this build (supported: auto, fp8, fp8_e4m3)"),
                          (["-pp", "0"], "0: must be a positive integer"),
                          (["--tool-call-parser", "pythonic"], "invalid choice: 'pythonic'")):
        with pytest.raises(SystemExit):
            parse_args(["serve", "/m", *argv])
        err = capsys.readouterr().err
        assert SERVE_USAGE in err and message in err and "usage: megatron-serve [-h]" not in err, argv


def test_a_bad_combination_is_one_line_naming_the_options(capsys, tmp_path):
    assert main(["serve", str(tmp_path), "--enable-auto-tool-choice"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["megatron-serve serve: error: --enable-auto-tool-choice needs --tool-call-parser "
                                "(one of hermes, llama3_json, mistral, qwen3_coder, qwen3_xml): the format the model "
                                "writes its calls in"]
    assert main(["serve", str(tmp_path), "--tool-call-parser", "mistral"]) == 1
    assert "takes effect with --enable-auto-tool-choice" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--allow-credentials"]) == 1
    assert "need --allowed-origins" in capsys.readouterr().err


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A Hugging Face cache holding the tiny model as ``test-org/tiny`` (for --download-dir and --revision)."""
    root = tmp_path_factory.mktemp("vllm-options")
    model = make_tiny_model(root / "tiny", seed=0)
    hub_cache(root / "hub", HUB_ID, str(model))
    (root / "template.jinja").write_text(CHAT_TEMPLATE)  # --chat-template {tmp}/template.jinja
    make_peft_adapter(model, root / "adapter", rank=4, seed=0)  # --lora-modules tiny-lora={tmp}/adapter
    return root


def start_serve(root: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["serve", HUB_ID, "--download-dir", str(root / "hub"), "--host", "127.0.0.1", "--port", str(port),
            "--coordinator-port", "0", "--log-dir", str(root / f"logs-{port}"), "--num-kv-blocks", "128",
            "--drain-timeout", "5", *extra]
    proc = start_cli(argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
    except BaseException:
        stop_process_group(proc)  # serve stops its fleet on SIGINT
        raise
    return proc, url


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_serve_comes_up_with_every_implemented_and_accepted_option_and_they_act_or_warn_once_each(hub, tmp_path):
    """One process for both kinds (a serve start costs more than what each kind asks of it): the accepted options
    change nothing, so the implemented ones act as alone."""
    # Expert parallelism and EPLB are refused on this dense model (it has no experts to place or balance): their
    # flags have their own tests (tests/model/test_eplb.py, tests/parallel/test_expert_parallel_eplb.py, and the
    # refusal's in tests/commands)
    implemented = [row for row in rows(Status.IMPLEMENTED)
                   if row.example and row.name not in ("--host", "--port", "--download-dir", "--enable-eplb",
                                                        "--eplb-config", "--enable-expert-parallel")]
    accepted = rows(Status.ACCEPTED)
    extra = arguments(implemented + accepted, model=HUB_ID, tmp=str(hub), port="unused")
    log = tmp_path / "serve.out"
    proc, url = start_serve(hub, extra, log)
    try:
        key = {"Authorization": "Bearer sk-vllm-test"}  # --api-key
        with httpx.Client(base_url=url, timeout=120) as http:
            assert http.get("/v1/models").status_code == 401
            models = http.get("/v1/models", headers=key).json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("tiny-lora", "tiny")]  # --lora-modules
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "request_id": "vllm-flags-1"}
            tuned = http.post("/v1/completions", json={**body, "model": "tiny-lora", "request_id": "lora-1"},
                              headers=key)
            assert tuned.status_code == 200 and tuned.json()["model"] == "tiny-lora"  # --enable-lora
            cors = http.post("/v1/completions", json=body, headers={**key, "Origin": "https://app.example"})
            assert cors.status_code == 200 and cors.json()["id"] == "cmpl-vllm-flags-1"
            assert cors.headers["access-control-allow-origin"] == "https://app.example"  # --allowed-origins
            other = http.post("/v1/completions", json=body, headers={**key, "Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in other.headers
            too_many = http.post("/v1/completions", json={**body, "logprobs": 6}, headers=key)  # --max-logprobs 5
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
            assert http.get("/docs").status_code == 404 and http.get("/openapi.json").status_code == 404
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            chat = http.post("/v1/chat/completions", headers=key, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2})
            assert chat.status_code == 200  # tool_choice auto, read by --tool-call-parser hermes
    finally:
        stop_process_group(proc)  # serve stops its fleet on SIGINT
    output = log.read_text()
    assert "request cmpl-vllm-flags-1 received" in output and "'Hello'" in output  # --enable-log-requests
    assert "POST /v1/completions" not in output  # --disable-uvicorn-access-log, despite --uvicorn-log-level info
    warnings = re.findall(r"megatron-serve serve: warning: (\S+) is accepted for vLLM compatibility and changes "
                          r"nothing: (.*)", output)
    assert sorted(warnings) == sorted((row.name, row.reason) for row in accepted)
    assert output.count("warning:") == len(accepted), output  # no other warning
