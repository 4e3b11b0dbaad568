"""``--chat-template``: a file or the template inline (as in vLLM), checked at start-up, used by the chat endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time

import httpx
import pytest
import torch

from megatron_serve import MegatronAsyncLLM
from megatron_serve.commands.server import ServingFiles
from megatron_serve.model.loader import load_model
from megatron_serve.server import create_app, serve_async_llm
from megatron_serve.tokenizer import Tokenizer, load_chat_template

from .conftest import serving
from .fakes import FakeBackend
from .test_openai_e2e import free_port

pytestmark = pytest.mark.timeout(120)

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}=>{% endif %}")


def test_inline_text_or_a_file(tmp_path):
    assert load_chat_template(TEMPLATE) == TEMPLATE
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    with pytest.raises(FileNotFoundError, match="--chat-template .*missing.jinja: cannot read it"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}unclosed")


def test_a_broken_template_fails_before_anything_starts(tiny_model):
    args = argparse.Namespace(chat_template="{{ broken", generation_config="auto", model=tiny_model, tokenizer=None)
    with pytest.raises(ValueError, match="--chat-template"):
        ServingFiles.from_args(args)


async def test_the_chat_endpoint_renders_with_the_given_template(tiny_model):
    files = ServingFiles.from_args(argparse.Namespace(chat_template=TEMPLATE, generation_config="none",
                                                      model=tiny_model, tokenizer=None))
    tokenizer = files.load_tokenizer()
    backend = FakeBackend(tokenizer, max_sequence_length=1024)
    app = create_app(backend, tokenizer, "tiny-llama", vocab_size=None, max_model_len=1024, status_interval=0.05)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
    (prompt, _), = backend.submitted
    assert tokenizer.decode(prompt, skip_special_tokens=False) == "<<user:Hi there>>=>"


async def test_python_api_serve_uses_the_template_and_the_models_generation_defaults(tiny_model, tmp_path):
    """``MegatronAsyncLLM.serve(chat_template=...)`` renders chats with it; requests that leave ``max_tokens``
    out take ``max_new_tokens`` from the model's ``generation_config.json``."""
    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    stop = asyncio.Event()
    port = free_port()
    async with MegatronAsyncLLM(str(model)) as llm:
        server = asyncio.ensure_future(llm.serve("127.0.0.1", port, chat_template=TEMPLATE, stop=stop))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                deadline = time.monotonic() + 120
                while True:  # serve() loads the server's tokenizer, then listens
                    assert not server.done() and time.monotonic() < deadline, server
                    try:
                        if (await http.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi there"}]}
                rendered = (await http.post("/tokenize", json=chat)).json()["tokens"]
                assert rendered == llm.tokenizer.encode("<<user:Hi there>>=>")
                body = {"model": "tiny-llama", "prompt": "Hello", "ignore_eos": True}
                answer = (await http.post("/v1/completions", json=body)).json()
                assert answer["usage"]["completion_tokens"] == 3  # the model's default, not OpenAI's 16
        finally:
            stop.set()
            await server


async def test_python_api_serve_refuses_a_template_for_a_model_object(tiny_model):
    """A model object's tokenizer is the caller's: a template is set there, never changed behind its back."""
    tokenizer = Tokenizer.from_pretrained(tiny_model)
    async with MegatronAsyncLLM(load_model(tiny_model, torch.float32, "cpu"), tokenizer=tokenizer) as llm:
        with pytest.raises(ValueError, match="chat_template applies to a model given as a directory"):
            await serve_async_llm(llm, "127.0.0.1", free_port(), chat_template=TEMPLATE)
