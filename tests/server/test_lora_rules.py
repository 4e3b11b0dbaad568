"""Adapters under rules, and adapters beyond ``--max-loras`` loaded as vLLM loads them (issues 55 and 54), on a
real ``megatron-serve run`` with vLLM's defaults: ``--max-loras 1`` and one ``--lora-modules``.

Held: a second and a third adapter load at runtime (each host copy beyond ``--max-cpu-loras`` evicts the least
recently used one), and a request naming an evicted adapter is served from its directory with the text a fresh
engine gives it (==); an adapter holding NaN, one named like the base model, bad names, paths and sizes are
refused with 400 naming the problem, a path outside ``--lora-allowed-dirs`` (default: the directory holding the
``--lora-modules`` adapter) gets the same answer whether or not it exists, and nothing changes; the engine's log
shows names and paths escaped and cut short.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from safetensors.torch import load_file, save_file

from megatron_serve.api.llm import MegatronLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.model.lora.checkpoint import MAX_CONFIG_BYTES, WEIGHTS_FILE
from megatron_serve.wire.sampling_params import SamplingParams

from ..lora_adapters import make_peft_adapter
from .conftest import runtime_lora_run

pytestmark = [pytest.mark.timeout(600), pytest.mark.asyncio]

ADMIN_KEY = "lora-rules-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "The adapters of this fleet"
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rules-adapters")
    made = {name: str(make_peft_adapter(tiny_model, root / name, rank=4, seed=seed))
            for name, seed in (("first", 1), ("second", 2), ("third", 3))}
    nan = root / "nan"
    shutil.copytree(made["second"], nan)
    tensors = load_file(nan / WEIGHTS_FILE)
    next(t for k, t in sorted(tensors.items()) if "lora_A" in k).view(-1)[5] = float("nan")
    save_file(tensors, nan / WEIGHTS_FILE, metadata={"format": "pt"})
    big_config = root / "big-config"
    shutil.copytree(made["second"], big_config)
    with open(big_config / "adapter_config.json", "r+b") as config:  # valid JSON, padded past the limit
        raw = json.loads(config.read())
        config.seek(0)
        config.write(json.dumps(raw).encode() + b" " * MAX_CONFIG_BYTES)
    big_weights = root / "big-weights"
    shutil.copytree(made["second"], big_weights)
    with open(big_weights / WEIGHTS_FILE, "ab") as weights:
        weights.truncate(1 << 30)  # 1 GiB, sparse: its size alone refuses it
    outside = tmp_path_factory.mktemp("outside-adapters")
    shutil.copytree(made["second"], outside / "real")
    return SimpleNamespace(root=root, outside=outside, nan=str(nan), big_config=str(big_config),
                           big_weights=str(big_weights), **made)


@pytest.fixture(scope="module")
def fresh_text(tiny_model, adapters):
    """Each adapter's greedy tokens in a fresh direct-mode engine that loaded it alone."""

    def alone(name: str) -> list[int]:
        config = InferenceConfig(num_kv_blocks=64, enable_lora=True, max_lora_rank=16,
                                 lora_modules={name: getattr(adapters, name)})
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True, lora_name=name)
        with MegatronLLM(tiny_model, config) as llm:
            return llm.generate([PROMPT], params)[0].generated_tokens

    return {name: alone(name) for name in ("first", "second", "third")}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, adapters):
    with runtime_lora_run(tiny_model, tmp_path_factory.mktemp("rules"), ADMIN_KEY, "--max-loras", "1",
                          "--lora-modules", f"first={adapters.first}", engines=1) as run:
        yield run


@pytest.fixture
async def http(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        yield client


async def tokens(http: httpx.AsyncClient, model: str) -> list[int]:
    answer = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                                                      "temperature": 0.0, "ignore_eos": True,
                                                      "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


async def load(http: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
    return await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=ADMIN)


def logs(stack) -> str:
    """Every log of the run: its own, the coordinator's and the engine's (in the fleet's directory)."""
    return "".join(path.read_text(errors="replace") for path in sorted(Path(stack.tmp).rglob("*.log")))


async def listed(http: httpx.AsyncClient) -> set[str]:
    return {m["id"] for m in (await http.get("/v1/models")).json()["data"]}


async def test_a_second_and_third_adapter_load_with_one_slot_and_an_evicted_one_is_served_from_its_path(
        stack, http, adapters, fresh_text):
    assert fresh_text["first"] != fresh_text["second"] != fresh_text["third"], "control: the adapters differ"
    assert await tokens(http, "first") == fresh_text["first"]
    for name in ("second", "third"):
        loaded = await load(http, name, getattr(adapters, name))
        assert (loaded.status_code, loaded.text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
    assert await listed(http) == {stack.model, "first", "second", "third"}
    # --max-cpu-loras defaults to 1: "first" and "second" left host memory; each is read again from its path
    for name in ("first", "second", "third", "first"):
        assert await tokens(http, name) == fresh_text[name], name
    assert "left host memory" in logs(stack)


@pytest.mark.parametrize("body,why", [
    ({"lora_name": "nan", "lora_path": "{nan}"}, "lora_A.weight holds NaN or infinite values"),
    ({"lora_name": "big-config", "lora_path": "{big_config}"}, "adapter_config.json is"),
    ({"lora_name": "big-weights", "lora_path": "{big_weights}"}, "adapter_model.safetensors is 1073741824 bytes"),
    ({"lora_name": "gone", "lora_path": "{root}/gone"}, "gone' does not exist"),
])
async def test_bad_adapters_are_refused_with_their_reason(stack, http, adapters, body, why):
    before = await listed(http)
    body = {key: value.format(**vars(adapters)) for key, value in body.items()}
    refused = await load(http, body["lora_name"], body["lora_path"])
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "lora_refused" and why in error["message"], error
    assert await listed(http) == before


@pytest.mark.parametrize("name", ["../../etc", "a/b", "a\\b", "new\nline", "nul\x00", "x" * 129, "..", "."])
async def test_bad_names_are_refused_at_the_route(stack, http, adapters, name):
    refused = await load(http, name, adapters.second)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "lora_name" and "is not allowed" in refused.json()["error"]["message"]


async def test_an_adapter_named_like_the_base_model_is_refused(stack, http, adapters):
    refused = await load(http, stack.model, adapters.second)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_name"
    assert "the served model's name" in refused.json()["error"]["message"]
    assert sorted(m["id"] for m in (await http.get("/v1/models")).json()["data"]).count(stack.model) == 1


async def test_paths_outside_the_allowed_dirs_are_refused_alike_whether_or_not_they_exist(stack, http, adapters):
    answers = []
    for path in (str(adapters.outside / "real"), str(adapters.outside / "nothing-here"), "/etc",
                 str(adapters.root / ".." / adapters.outside.name / "real")):
        refused = await load(http, "outsider", path)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "is not allowed: runtime loads read only under --lora-allowed-dirs" in message
        answers.append(message.replace(path, "PATH").replace(repr(path), "PATH"))
    assert len(set(answers)) == 1, answers  # nothing tells the one that exists from the others
    long_path = str(adapters.root / ("d" * 5000))
    refused = await load(http, "long", long_path)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_path"
    assert len(refused.text) < 2000
    assert "outsider" not in await listed(http)


async def test_logs_carry_names_and_paths_escaped_and_cut_short(stack, http, adapters):
    name, path = "rtl\u202eeman", str(adapters.outside / ("p" * 3000))  # a path the route lets through
    refused = await load(http, name, path)
    assert refused.status_code == 400 and "is not allowed" in refused.json()["error"]["message"]
    logged = logs(stack)
    assert "rtl\\u202eeman" in logged, "control: the refusal is logged, with the name"
    assert "\u202e" not in logged and "p" * 400 not in logged
