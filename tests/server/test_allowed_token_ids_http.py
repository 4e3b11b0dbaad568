"""vLLM's ``allowed_token_ids`` over HTTP: ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``'s
``sampling_params`` take it because its row of the sampling table has an HTTP field and vLLM's name (no route names
it), and the engine's mask holds: only the listed ids are generated. A real engine in this process (``surface``)."""

from __future__ import annotations

from .conftest import surface

MODEL = "tiny-llama"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 17, 300, 42, 9]


async def test_only_the_allowed_ids_are_generated_on_every_route_that_takes_the_row(tiny_model, tokenizer):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, **GREEDY}
    async with surface(tiny_model, tokenizer) as (_, http):
        free = (await http.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        allowed = sorted({free[0] + 1, free[-1] + 2, 7})  # ids the unconstrained run did not all choose
        assert not set(free) <= set(allowed)  # control: without the mask the output leaves the list
        completion = (await http.post("/v1/completions", json={**body, "allowed_token_ids": allowed})).json()
        generate = (await http.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 6, "allowed_token_ids": allowed, **GREEDY}})).json()
        chat = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Which tokens?"}], "max_tokens": 6,
            "return_token_ids": True, "allowed_token_ids": allowed, **GREEDY})).json()
        for what, tokens in (("completions", completion["choices"][0]["token_ids"]),
                             ("generate", generate["choices"][0]["token_ids"]),
                             ("chat", chat["choices"][0]["token_ids"])):
            assert len(tokens) == 6 and set(tokens) <= set(allowed), (what, tokens)
        assert generate["choices"][0]["token_ids"] == completion["choices"][0]["token_ids"]  # one row, one meaning


async def test_a_bad_list_is_refused_naming_the_field(tiny_model, tokenizer):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **GREEDY}
    async with surface(tiny_model, tokenizer) as (_, http):
        for value in (["x"], [], [-1], [7, 512]):  # 512: outside the tiny model's vocabulary, as vLLM refuses it
            answer = await http.post("/v1/completions", json={**body, "allowed_token_ids": value})
            assert answer.status_code == 400, (value, answer.text)
            assert "allowed_token_ids" in answer.text, (value, answer.text)
        answer = await http.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 2, "allowed_token_ids": "7"}})
        assert answer.status_code == 400 and "allowed_token_ids" in answer.text, answer.text
