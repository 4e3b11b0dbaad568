"""LoRA adapters over HTTP with the official ``openai`` client: listed in ``/v1/models`` with the base model as
``parent``, picked by the request's ``model``, the same tokens as the engine gives the adapter directly."""

from __future__ import annotations

import pytest

from megatron_serve import LLM, LoRARequest, SamplingParams

from ..lora_adapters import make_peft_adapter
from .conftest import surface

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return str(make_peft_adapter(tiny_model, tmp_path_factory.mktemp("served-adapter") / "sql", rank=8, seed=3))


async def test_adapter_is_listed_and_picked_by_model(tiny_model, tokenizer, adapter):
    modules = {"sql-lora": adapter}
    with LLM(tiny_model, enable_lora=True) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        expected = llm.generate("Hello there", greedy, use_tqdm=False,
                                lora_request=LoRARequest("x", 1, adapter))[0].outputs[0].text
        base_text = llm.generate("Hello there", greedy, use_tqdm=False)[0].outputs[0].text
    assert expected != base_text, "control: the adapter changes the answer"
    async with surface(tiny_model, tokenizer, {"lora_modules": modules}, enable_lora=True,
                       lora_modules=modules) as (client, http):
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {"tiny-llama", "sql-lora"}
        assert (models["sql-lora"].parent, models["sql-lora"].root) == ("tiny-llama", adapter)
        assert models["tiny-llama"].parent is None
        assert (await http.get("/v1/models/sql-lora")).json()["parent"] == "tiny-llama"
        body = dict(prompt="Hello there", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        tuned = await client.completions.create(model="sql-lora", **body)
        base = await client.completions.create(model="tiny-llama", **body)
        assert tuned.model == "sql-lora"
        assert (tuned.choices[0].text, base.choices[0].text) == (expected, base_text)
        chat = await client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, temperature=0.0)
        assert chat.model == "sql-lora"
        missing = await http.post("/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 2})
        assert missing.status_code == 404 and "'sql-lora'" in missing.json()["error"]["message"]
