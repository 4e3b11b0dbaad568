"""Images in chat requests over HTTP: the official ``openai`` client, ``data:`` and ``http(s)`` URLs, 400s, caching.

``megatron-serve run`` serves a tiny random LLaVA (real coordinator, engine process and server); a
small HTTP server on 127.0.0.1, started here, plays the web the server fetches images from. Greedy
answers are compared with ``MegatronLLM`` direct mode on the same weights. The prefix-cache and
remote-switch tests serve the same model in-process (direct mode) for speed.
"""

from __future__ import annotations

import base64
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import openai
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.limits import RequestLimits
from megatron_serve.multimodal import ImageOptions
from megatron_serve.server import create_app
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from ..helpers import http_get
from ..images import png
from ..processes import stop_process_group
from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(300)

MAX_IMAGE_BYTES = 200_000
FETCH_TIMEOUT = 5  # seconds; generous on a loaded machine, and what the never-answered fetch costs
MAX_TOKENS = 8
QUESTION = "What do you see in this picture? Describe the colours, the shapes and where things are."


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(url: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


PICTURE = png(48, 64, 1)
OTHER = png(48, 64, 2)
BIG = png(400, 400, 3)  # ~480 kB of noise: over MAX_IMAGE_BYTES


class _Web(BaseHTTPRequestHandler):
    """The web as the tests need it: an image, a page, a large image, and an image that never comes."""

    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        if self.path == "/slow.png":
            self.release.wait(60)  # until the test is over: the server's fetch must time out first
        body, media_type = {"/picture.png": (PICTURE, "image/png"), "/page.html": (b"<html>hi</html>", "text/html"),
                            "/big.png": (BIG, "image/png"), "/slow.png": (PICTURE, "image/png")}.get(
                                self.path, (b"missing", "text/plain"))
        self.send_response(404 if body == b"missing" else 200)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def web():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Web)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Web.release.set()
    server.shutdown()


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("http-llava") / "tiny-llava", seed=4, arch="llava"))


@pytest.fixture(scope="module")
def direct(tiny_llava):
    """Greedy answer of direct mode to one chat: the server's rendering, tokenized the server's way (no prefix
    cache: the uncached reference of the prefix-cache test too)."""
    llm = MegatronLLM(tiny_llava, InferenceConfig(num_kv_blocks=64, enable_prefix_caching=False))
    tokenizer = llm.tokenizer

    def answer(picture: bytes, text: str = QUESTION) -> str:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                               {"type": "text", "text": text}]}])
        prompt = {"prompt": tokenizer.encode(rendered, add_special_tokens=False), "images": [picture]}
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=MAX_TOKENS, ignore_eos=True)
        return llm.generate([prompt], params)[0].generated_text

    return answer


@pytest.fixture(scope="module")
def stack(tiny_llava, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("run-llava")
    with socket_port() as port, open(log_dir / "run.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", tiny_llava, "--port", str(port),
             "--coordinator-port", "0", "--num-kv-blocks", "64", "--log-dir", str(log_dir), "--drain-timeout", "2",
             "--max-image-bytes", str(MAX_IMAGE_BYTES), "--image-fetch-timeout", str(FETCH_TIMEOUT)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"megatron-serve run did not become ready:\n{(log_dir / 'run.out').read_text()}")
            time.sleep(0.2)
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                                           timeout=120), model="tiny-llava")
    finally:
        stop_process_group(proc, signal.SIGTERM)


class socket_port:
    """A free port of 127.0.0.1 (released when the block ends, before the server binds it)."""

    def __enter__(self) -> int:
        import socket  # noqa: PLC0415

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    def __exit__(self, *exc_info) -> None:
        pass


def _ready(url: str) -> bool:
    try:
        return http_get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def ask(stack, url: str, **extra):
    return stack.client.chat.completions.create(model=stack.model, messages=chat(url), max_tokens=MAX_TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True}, **extra)


def refused(stack, url: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(stack, url)
    return caught.value


@pytest.mark.slow
def test_models_say_the_model_takes_images(stack):
    card = httpx.get(f"{stack.url}/v1/models").json()["data"][0]
    assert card["id"] == stack.model and card["input_modalities"] == ["text", "image"]


@pytest.mark.slow
def test_data_url_and_fetched_url_answer_as_direct_mode(stack, web, direct):
    expected = direct(PICTURE)
    answer = ask(stack, data_url(PICTURE))
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens > 16  # the image's 16 placeholder tokens are counted
    counted = httpx.post(f"{stack.url}/tokenize", json={"model": stack.model, "messages": chat(data_url(PICTURE))})
    assert counted.json()["count"] == answer.usage.prompt_tokens  # /tokenize counts the image's tokens too
    assert ask(stack, f"{web}/picture.png").choices[0].message.content == expected
    streamed = ask(stack, data_url(PICTURE), stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected
    two = stack.client.chat.completions.create(
        model=stack.model, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                               {"type": "text", "text": "and"},
                                               {"type": "image_url", "image_url": {"url": f"{web}/picture.png"}}]},
                  {"role": "assistant", "content": "Two pictures."},
                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(OTHER)}}]}])
    assert two.usage.prompt_tokens > 3 * 16


@pytest.mark.slow
def test_bad_images_are_400s_naming_the_problem(stack, web):
    broken = refused(stack, data_url(b"\x89PNG\r\n\x1a\n but then nothing of a picture"))
    assert "messages[0].content[0]" in broken.message and "not usable" in broken.message
    page = refused(stack, f"{web}/page.html")
    assert "returned text/html, not an image" in page.message
    assert "at most 200000 bytes" in refused(stack, data_url(BIG)).message
    assert "at most 200000 bytes" in refused(stack, f"{web}/big.png").message
    assert f"took longer than {FETCH_TIMEOUT}s" in refused(stack, f"{web}/slow.png").message
    assert "HTTP 404" in refused(stack, f"{web}/nothing.png").message
    assert "holds text/plain, not an image" in refused(stack, data_url(PICTURE, "text/plain")).message
    assert "data: URL or an http(s) URL" in refused(stack, "ftp://example.invalid/a.png").message
    # the server still answers
    assert ask(stack, data_url(PICTURE)).choices[0].finish_reason == "length"


async def test_prefix_cache_is_keyed_by_image_content(tiny_llava, direct):
    """Same image twice: cached; same text with another image: nothing cached; answers equal the uncached run."""
    tokenizer = Tokenizer.from_pretrained(tiny_llava)
    config = InferenceConfig(block_size_tokens=16, num_kv_blocks=64, enable_prefix_caching=True)
    async with MegatronAsyncLLM(tiny_llava, config) as llm:
        app = create_app(llm.client, tokenizer, "tiny-llava", status_interval=0.05)
        async with serving(app) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

            async def answer(picture: bytes):
                return await client.chat.completions.create(
                    model="tiny-llava", messages=chat(data_url(picture)), max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})

            first, again, other = await answer(PICTURE), await answer(PICTURE), await answer(OTHER)
            await client.close()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16 > 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "another image must not hit the cache"
    uncached = {picture: direct(picture) for picture in (PICTURE, OTHER)}
    assert first.choices[0].message.content == again.choices[0].message.content == uncached[PICTURE]
    assert other.choices[0].message.content == uncached[OTHER] != uncached[PICTURE]


async def test_remote_images_switched_off_and_text_models(tiny_llava, tokenizer, web):
    async with MegatronAsyncLLM(tiny_llava, InferenceConfig(num_kv_blocks=32)) as llm:
        app = create_app(llm.client, Tokenizer.from_pretrained(tiny_llava), "tiny-llava",
                         limits=RequestLimits(max_images=2), image_options=ImageOptions(allow_remote=False),
                         status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"model": "tiny-llava", "messages": chat(f"{web}/picture.png"), "max_tokens": 2}
            answer = await http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 400 and "--no-remote-images" in answer.json()["error"]["message"]
            three = [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}}] * 3
            answer = await http.post("/v1/chat/completions", json={
                **body, "messages": [{"role": "user", "content": three}]})
            assert answer.status_code == 400 and "at most 2" in answer.json()["error"]["message"]
            assert answer.json()["error"]["param"] == "messages[0].content[2]"
            body["messages"] = chat(data_url(PICTURE))
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    # a text model: the server tells it by its tokenizer (no image processor) and refuses images before any engine
    # sees them, so a fake backend serves it (an engine of its own cost a model load for no assertion)
    app = create_app(FakeBackend(tokenizer), tokenizer, "tiny-llama", status_interval=0.05)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
        assert card["input_modalities"] == ["text"]
        answer = await http.post("/v1/chat/completions", json={"model": "tiny-llama",
                                                               "messages": chat(data_url(PICTURE))})
        assert answer.status_code == 400 and "takes no images" in answer.json()["error"]["message"]
