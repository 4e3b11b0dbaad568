"""A trained model in the loop: SmolLM2-135M-Instruct from its GGUF file, through vLLM's ``LLM``, against
transformers' own load of the same file (both in float32, and both in bfloat16): the same greedy tokens, one prompt
at a time and batched; the same chat text; the same prompt log probs; stop strings that end inside a word; text of characters
whose bytes are split over several tokens; JSON that follows its schema."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from megatron_serve import SamplingParams
from megatron_serve.sampling_params import StructuredOutputsParams
from megatron_serve.client.detokenizer import IncrementalDetokenizer
from megatron_serve.model.hub import resolve_model
from megatron_serve.tokenizer import Tokenizer

# 20 prompts of varied lengths and kinds (prose, code, Q&A, SQL, HTML, a letter) batched: each one's tokens are
# transformers' own, one prompt at a time. None where the model ends the text within NEW_TOKENS: transformers'
# min_new_tokens masks the end-of-text token, where ignore_eos lets it be generated (and then goes on)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The largest planet in the solar system is",
    "import numpy as np\n",
    "Q: What is 2 + 2?\nA:",
    "SELECT name FROM users WHERE",
    "A haiku about the sea:\n",
    "The quick brown fox",
    "In 1492, Columbus",
    "To make a cup of tea,",
    "The theory of relativity states that",
    "for i in range(10):",
    "The first person to walk on the moon was",
    "Water boils at",
    "The chemical symbol for gold is",
    "Dear Sir or Madam,",
    "The best way to learn programming is",
    "<html>\n<head>",
    "Photosynthesis is the process",
]
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def transformers_greedy_steps(model, tokens: list[int], new_tokens: int = NEW_TOKENS
                              ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the raw logits of each step (float32)."""
    out = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(tokens):].tolist(), [step[0].float() for step in out.logits]


def transformers_greedy(model, tokens: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    return transformers_greedy_steps(model, tokens, new_tokens)[0]


def test_greedy_tokens_equal_transformers_one_prompt_at_a_time_and_batched(llm, reference):
    model, tokenizer = reference
    token_lists = [tokenizer.encode(prompt) for prompt in PROMPTS]
    assert [llm.get_tokenizer().encode(prompt) for prompt in PROMPTS] == token_lists

    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    alone = [llm.generate(prompt, GREEDY, use_tqdm=False)[0] for prompt in PROMPTS[:2]]

    expected = [transformers_greedy(model, tokens) for tokens in token_lists]
    assert [out.outputs[0].token_ids for out in batched] == expected
    assert [out.outputs[0].token_ids for out in alone] == expected[:2]
    assert batched[0].outputs[0].text.startswith(" Paris")


def bfloat16_steps(first: float, second: float) -> float:
    """How many bfloat16 steps apart two bfloat16 logits are (steps of 0.125 between 16 and 32)."""
    step = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(max(abs(first), abs(second))))
    return abs(first - second) / step


def test_bfloat16_greedy_tokens_equal_transformers_bfloat16(llm_bf16, reference_bf16):
    """In bfloat16 the engine computes as transformers does op for op (rotary with ``cos``/``sin`` in bfloat16, each
    product rounded; attention by torch's fused kernel in bfloat16 over each sequence's own keys; the logits in
    bfloat16, upcast to choose), so one prompt at a time its tokens are transformers' bit for bit: all 20 here (with
    the rotation and attention upcast to float32, as before, 18 of 20 on this machine's CPU).

    Batched, a step's GEMMs have more rows than transformers' one-prompt calls, and a bfloat16 GEMM's row can round
    otherwise with the rows around it (oneDNN on this CPU, at the MLP's down projection's 1,536 inputs, from 20 rows):
    transformers itself chooses token 33 for "SELECT name FROM users WHERE" at step 3 in one forward pass over the
    prompt and its first three tokens (logits 27.0 against 26.875 for token 20), where its ``generate`` (one row per
    step) finds the two tied at 27.125 and chooses 20; batched, the engine chooses 33 there. So a batched request
    equals transformers' up to the first step where transformers' top two logits are at most two bfloat16 steps
    apart, and there chooses the other of the two (19 of 20 here equal to the end; over 40 prompts and 16 tokens the
    batched requests that parted from transformers did so where its own two computations of the step, ``generate``
    and one forward pass, differ by up to two steps)."""
    model, tokenizer = reference_bf16
    token_lists = [tokenizer.encode(prompt) for prompt in PROMPTS]
    eos = model.generation_config.eos_token_id  # min_new_tokens keeps it out of transformers' choice

    alone = [llm_bf16.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for prompt in PROMPTS]
    batched = [out.outputs[0].token_ids for out in llm_bf16.generate(PROMPTS, GREEDY, use_tqdm=False)]

    expected, logits = zip(*(transformers_greedy_steps(model, tokens) for tokens in token_lists))
    assert alone == list(expected)
    for prompt, got, want, steps in zip(PROMPTS, batched, expected, logits):
        if got == want:
            continue
        index = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        choosable = steps[index].clone()
        choosable[eos] = -float("inf")
        others = choosable.clone()
        others[want[index]] = -float("inf")
        chosen, other = choosable[want[index]].item(), others[got[index]].item()
        assert other == others.max().item(), (prompt, index, got[index], "is not transformers' second choice")
        assert bfloat16_steps(chosen, other) <= 2, (prompt, index, chosen, other)


def test_the_chat_template_of_the_file_renders_as_transformers(llm, smollm2, reference):
    _, tokenizer = reference
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
    ]
    served = Tokenizer.from_pretrained(resolve_model(smollm2))  # what the HTTP server renders chats with
    rendered = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                for messages in conversations]
    assert [served.apply_chat_template(messages) for messages in conversations] == rendered
    assert [llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            for messages in conversations] == rendered
    assert rendered[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")

    reply = llm.chat(conversations[0], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in reply[0].outputs[0].text


def test_prompt_logprobs_equal_transformers(llm, reference):
    model, tokenizer = reference
    prompt = "The Eiffel Tower is located in Paris, the capital of France."
    tokens = tokenizer.encode(prompt)

    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]

    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    got = [out.prompt_logprobs[i][token].logprob for i, token in enumerate(tokens) if i]
    assert got == pytest.approx([expected[i - 1, token].item() for i, token in enumerate(tokens) if i], abs=1e-4)


def test_a_stop_string_inside_a_word_ends_the_text_before_it(llm):
    free = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    assert free.text.startswith(" Paris")

    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["ari"]),
                           use_tqdm=False)[0].outputs[0]

    assert stopped.text == " P"
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "ari"


def test_characters_split_over_tokens_stream_whole(llm, smollm2):
    """Byte-level BPE writes an emoji it has no token for as byte tokens: each alone decodes to U+FFFD. Streamed a
    token at a time, as the server streams, the text holds the character back until its last byte comes, then
    shows it whole: the pieces join to the final text and none holds a replacement character."""
    out = llm.generate("Emoji for pizza: \U0001F355. Emoji for cat:", GREEDY, use_tqdm=False)[0].outputs[0]
    tokenizer = Tokenizer.from_pretrained(resolve_model(smollm2))
    assert sum("\ufffd" in tokenizer.decode([token]) for token in out.token_ids) >= 2  # one character, split

    stream = IncrementalDetokenizer(tokenizer)
    pieces = []
    for count in range(1, len(out.token_ids) + 1):
        stream.update(out.token_ids[:count])
        pieces.append(stream.take_new_text(final=count == len(out.token_ids)))

    assert "".join(pieces) == out.text == tokenizer.decode(out.token_ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces and any(ord(c) > 0xFFFF for c in out.text)  # held back, then whole


def test_json_schema_output_on_real_text_follows_the_schema(llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema))

    out = llm.chat([{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}], params,
                   use_tqdm=False)[0].outputs[0]

    jsonschema.validate(json.loads(out.text), schema)
    assert out.finish_reason == "stop", out.text
