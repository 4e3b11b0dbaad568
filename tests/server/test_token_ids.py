"""Token-exact I/O through the official ``openai`` client: vLLM's ``return_token_ids`` on both endpoints, whole
and streamed, token-id prompts in every shape the completions endpoint takes, and ``kv_transfer_params``
refused by name.

A ``MegatronAsyncLLM`` in direct mode on the tiny random model behind the app (``conftest.surface``): an RL
trainer reads the ids it trains on from the answer instead of tokenizing text again, so the ids must be exactly
those the engine ran (the prompt) and produced (the answer), chunk by chunk when streamed.
"""

from __future__ import annotations

import openai
import pytest

from .conftest import surface

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
PROMPT = "Token ids are what a trainer reads"
ASK = [{"role": "user", "content": "Which tokens did you write?"}]
IDS = {"return_token_ids": True}


async def test_completions_return_the_ids_of_prompt_and_answer(tiny_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    async with surface(tiny_model, tokenizer) as (client, _):
        plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert "token_ids" not in plain.choices[0].model_dump(exclude_unset=True)  # control: only when asked
        answer = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, n=2,
                                                 extra_body={"ignore_eos": True, **IDS})
        for choice in answer.choices:
            assert choice.prompt_token_ids == prompt_ids
            assert len(choice.token_ids) == 9 and tokenizer.decode(choice.token_ids) == choice.text
        assert answer.choices[0].token_ids == answer.choices[1].token_ids  # greedy: both choices the same
        assert answer.choices[0].text == plain.choices[0].text

        # streamed: the prompt's ids on each choice's first chunk, then every chunk's own ids, adding up to the answer
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, n=2,
                                                 stream=True, logprobs=0, extra_body={"ignore_eos": True, **IDS})
        streamed: dict[int, list[int]] = {0: [], 1: []}
        openings: dict[int, list[list[int]]] = {0: [], 1: []}
        async for chunk in stream:
            for choice in chunk.choices:
                extra = choice.model_extra
                if "prompt_token_ids" in extra:
                    openings[choice.index].append(extra["prompt_token_ids"])
                    assert not streamed[choice.index]  # the first chunk of its choice
                streamed[choice.index] += extra["token_ids"]
                listed = choice.logprobs.tokens if choice.logprobs is not None else []
                assert len(extra["token_ids"]) == len(listed)  # a chunk's ids are the tokens its log probs list
        assert openings == {0: [prompt_ids], 1: [prompt_ids]}
        assert streamed == {0: answer.choices[0].token_ids, 1: answer.choices[1].token_ids}


async def test_completions_take_token_id_prompts_in_both_shapes(tiny_model, tokenizer):
    first, second = tokenizer.encode(PROMPT), tokenizer.encode("A second prompt, as ids")
    async with surface(tiny_model, tokenizer) as (client, _):
        as_text = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                  extra_body=IDS)
        as_ids = await client.completions.create(model=MODEL, prompt=first, max_tokens=6, temperature=0,
                                                 extra_body=IDS)
        assert as_ids.choices[0].prompt_token_ids == first and as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.choices[0].token_ids == as_text.choices[0].token_ids
        both = await client.completions.create(model=MODEL, prompt=[first, second], max_tokens=6, temperature=0,
                                               echo=True, extra_body=IDS)
        assert [c.prompt_token_ids for c in both.choices] == [first, second]
        assert both.choices[0].text == tokenizer.decode(first) + as_text.choices[0].text  # echo decodes the ids
        assert both.usage.prompt_tokens == len(first) + len(second)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt=[first, [600]], max_tokens=2)
        assert refused.value.body["param"] == "prompt[1]" and refused.value.body["code"] == "invalid_token_id"


async def test_chat_returns_the_ids_of_the_rendered_prompt_and_the_answer(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer) as (client, http):
        rendered = (await http.post("/tokenize", json={"model": MODEL, "messages": ASK})).json()["tokens"]
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=7, temperature=0,
                                                      extra_body={"ignore_eos": True, **IDS})
        assert answer.prompt_token_ids == rendered
        assert len(answer.choices[0].token_ids) == 7 == answer.usage.completion_tokens
        assert tokenizer.decode(answer.choices[0].token_ids) == answer.choices[0].message.content
        plain = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
        assert "prompt_token_ids" not in plain.model_dump(exclude_unset=True)

        stream = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=7, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True, **IDS})
        prompts, streamed, text = [], [], ""
        async for chunk in stream:
            if "prompt_token_ids" in chunk.model_extra:
                prompts.append(chunk.model_extra["prompt_token_ids"])
            for choice in chunk.choices:
                streamed += choice.model_extra.get("token_ids") or []
                text += choice.delta.content or ""
        assert prompts == [rendered]
        assert streamed == answer.choices[0].token_ids and text == answer.choices[0].message.content


async def test_kv_transfer_params_is_refused_by_name(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer) as (client, _):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            extra_body={"kv_transfer_params": {"do_remote_decode": True}})
        body = refused.value.body
        assert body["code"] == "unsupported_parameter" and "--prefill-engines" in body["message"]
        with pytest.raises(openai.BadRequestError) as unknown:  # control: a field nobody names is the generic 400
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            extra_body={"kv_transfer_paramz": {}})
        assert unknown.value.body["code"] == "unknown_parameter"


async def test_the_stop_token_ends_the_ids_counted_and_scored_and_stays_out_of_the_text(tiny_model, tokenizer):
    """vLLM's answer to a choice that a stop token ended: its id last in ``token_ids``, counted in ``usage``, with a
    log prob; its text not in the text (whole or streamed), unless ``include_stop_str_in_output``. The stop token
    here is an ordinary token of the greedy answer, so its text would show (the engine dropped it before: the ids
    ended before it)."""
    async with surface(tiny_model, tokenizer) as (client, _):
        free = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0,
                                               extra_body={"ignore_eos": True, **IDS})
        ids = free.choices[0].token_ids
        stop = ids[4]
        upto = ids[:ids.index(stop) + 1]
        body = {"ignore_eos": True, "stop_token_ids": [stop], **IDS}
        answer = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, logprobs=0,
                                                 extra_body=body)
        (choice,) = answer.choices
        assert choice.finish_reason == "stop" and choice.token_ids == upto
        assert answer.usage.completion_tokens == len(upto) and len(choice.logprobs.token_logprobs) == len(upto)
        assert choice.text == tokenizer.decode(upto[:-1]) != tokenizer.decode(upto)
        included = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0,
                                                   extra_body={**body, "include_stop_str_in_output": True})
        assert included.choices[0].text == tokenizer.decode(upto)
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0,
                                                 stream=True, extra_body=body)
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == upto
        chat = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=9, temperature=0,
                                                    extra_body={"ignore_eos": True, **IDS})
        said = chat.choices[0].token_ids
        stopped = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=9, temperature=0,
                                                       extra_body={"ignore_eos": True, "stop_token_ids": [said[3]],
                                                                   **IDS})
        assert stopped.choices[0].token_ids == said[:said.index(said[3]) + 1]
        assert stopped.usage.completion_tokens == len(stopped.choices[0].token_ids)
        assert stopped.choices[0].message.content == tokenizer.decode(stopped.choices[0].token_ids[:-1])
