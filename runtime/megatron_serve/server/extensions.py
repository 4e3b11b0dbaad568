"""The one list of request fields beyond the OpenAI API that this server accepts, and the ones it refuses.

Request bodies are strict: a field that is neither part of the OpenAI API nor listed in
:data:`EXTENSIONS` gets a 400 that names it. Ignoring it would answer 200 with output that does
not do what the client asked (a ``repetition_penalty`` that never applied looks like a model
that repeats itself).

To implement an extension: add its entry to :data:`EXTENSIONS` (removing it from
:data:`NOT_IMPLEMENTED`), declare the field in ``models.py`` with :func:`extension`, and honour it.
A sampling parameter's field is a row of the table instead (``wire/sampling_fields.py``: its description,
range and type there, and ``models.py`` declares it from the row). A test checks that every declared field
outside the OpenAI API is listed here and the reverse.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..wire.sampling_fields import EXTENSION_DOCS

#: Extensions this server implements: name -> what it does (shown in ``/openapi.json``).
EXTENSIONS: dict[str, str] = {
    **EXTENSION_DOCS,  # the sampling parameters the server copies (top_k, min_p, ...): their rows' descriptions
    "session_id": "the multi-turn session the request belongs to (SkyRL's; the X-Session-ID header wins): its "
                  "requests stay on the engine that holds its KV blocks while that engine is under its load bound",
    "return_epochs": "add policy_epochs and kv_epochs (the weights generation of every generated token) and "
                     "lora_epochs (its LoRA adapter version; -1: none) to each choice",
    "stop_token_ids": "generation also stops at these token ids; the one that ends it is the last token id (counted, "
                      "with its log prob), not in the text (vLLM's name)",
    "guided_json": "the output follows this JSON schema (vLLM's name)",
    "guided_regex": "the output matches this regular expression (vLLM's name)",
    "guided_choice": "the output is one of these strings (vLLM's name)",
    "guided_grammar": "the output follows this grammar: GBNF/EBNF ('root ::= ...') or Lark (vLLM's name)",
    "prompt_logprobs": "log-prob of every prompt token and this many alternatives at each position (vLLM's name "
                       "and shape; not with stream)",
    "response_format": "on /v1/completions too (as vLLM): 'json_object' or 'json_schema' constrains the output",
    # vLLM's request fields (server/vllm_fields.py), with vLLM's meaning
    "request_id": "names the request: the response id becomes cmpl-/chatcmpl-<request_id> and the request log "
                  "shows it; the X-Request-Id header wins (vLLM's name)",
    "truncate_prompt_tokens": "keep only the last N tokens of the prompt (of each prompt; of the rendered chat); "
                              "-1 = the model's context length (vLLM's name)",
    "structured_outputs": "constrain the output: exactly one of json (a schema), regex, choice, grammar, "
                          "json_object; the same as the guided_* fields (vLLM's current name); an object schema without "
                          "additionalProperties admits no other key, as vLLM's default backend reads it",
    "guided_decoding_backend": "accepted: every constraint is decoded with llguidance, whichever backend is named "
                               "(vLLM's name)",
    "chat_template_kwargs": "extra variables for the chat template, e.g. {\"enable_thinking\": false} for Qwen3 "
                            "(vLLM's name)",
    "add_generation_prompt": "end the rendered chat with the assistant's turn opening; default true (vLLM's name)",
    "continue_final_message": "render the last (assistant) message open, so the answer continues it; needs "
                              "add_generation_prompt=false (vLLM's name)",
    "add_special_tokens": "add the tokenizer's special tokens (BOS) to the prompt: on completions by default; on "
                          "chats off by default, on top of what the template writes (vLLM's name)",
    "return_token_ids": "add prompt_token_ids (the prompt as the engine ran it) and each choice's token_ids (the "
                        "generated tokens) to the answer; streamed: prompt_token_ids on a choice's first chunk, "
                        "token_ids per chunk (vLLM's name and shape)",
    "use_beam_search": "accepted as false (vLLM's default, which AReaL's client sends); true is refused: this server "
                       "samples, it has no beam search (vLLM's name)",
    "return_tokens_as_token_ids": "name every token of a log-prob listing 'token_id:N' instead of by its text, so "
                                  "that a trainer reads back exactly the ids the engine ran (vLLM's name)",
}

#: Well-known fields this server does not implement, OpenAI's and other servers' (vLLM, SGLang):
#: refused with a 400 that says so, instead of the generic unknown-parameter answer.
NOT_IMPLEMENTED: dict[str, str] = {
    "functions": "function calling (deprecated by OpenAI for tools)",
    "function_call": "function calling (deprecated by OpenAI for tools)",
    "audio": "audio output",
    "modalities": "output modalities",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort",
    "web_search_options": "web search",
    "service_tier": "service tiers",
    "store": "stored completions",
    "metadata": "stored completions",
    "spaces_between_special_tokens": "choosing how special tokens are joined",
    "length_penalty": "beam search",
    "early_stopping": "beam search",
    "bad_words": "bad words",
    "guided_whitespace_pattern": "a custom whitespace pattern for guided decoding (the guided_* fields themselves work)",
    "structural_tag": "structural tags (guided_json, guided_regex, guided_choice and guided_grammar work)",
    "chat_template": "a per-request chat template",
    "documents": "retrieval documents in the chat template",
    "mm_processor_kwargs": "multimodal inputs",
    "logits_processors": "logits processors",
    "lora_request": "an adapter in the body (a request picks a LoRA adapter by its model)",
    "regex": "SGLang's spelling (send guided_regex or structured_outputs.regex)",
    "json_schema": "SGLang's spelling (send guided_json, response_format or structured_outputs.json)",
    "ebnf": "SGLang's spelling (send guided_grammar or structured_outputs.grammar)",
    "no_stop_trim": "returning the stop string",
    "kv_transfer_params": "a KV connector's per-request parameters from an outside proxy (a fleet started with "
                          "--prefill-engines and --decode-engines disaggregates every request itself: its "
                          "coordinator sends the prompt to a prefill engine and the KV blocks on to a decode engine)",
}


def extension(name: str, default: Any = None, **constraints: Any) -> Any:
    """A pydantic ``Field`` for the extension ``name``, described by its entry in :data:`EXTENSIONS`.

    A field named here but missing from the list fails at import, so the list cannot fall behind.
    """
    return Field(default, description=f"extension: {EXTENSIONS[name]}", **constraints)


def unknown_field_message(path: str) -> tuple[str, str]:
    """(message, code) for a request field the models do not declare; ``path`` like ``messages[0].foo``."""
    name = path.rsplit(".", 1)[-1]
    if "." not in path and "[" not in path and name in NOT_IMPLEMENTED:
        return (f"{name}: {NOT_IMPLEMENTED[name]} is not supported by this server (the parameter is refused rather "
                "than ignored, since ignoring it would change the answer)", "unsupported_parameter")
    known = ", ".join(sorted(EXTENSIONS))
    return (f"unrecognized request argument supplied: {path} (not part of the OpenAI API nor one of this server's "
            f"extensions: {known})", "unknown_parameter")
