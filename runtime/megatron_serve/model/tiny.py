"""A small random Llama-family model plus a real byte-level BPE tokenizer, made offline.

Demos and tests need a model directory exactly like one from the Hub; nothing can be downloaded
here, so the tokenizer is trained on a built-in text and the weights come from ``transformers``'
own initialisation. The same seed always writes the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

# Experts of the mixture-of-experts architectures: 8 experts, 2 per token; overridable like any config key.
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}

#: vision-language architectures, written by :mod:`megatron_serve.model.vision.tiny`
VISION_ARCHITECTURES = ("llava", "qwen2_vl", "qwen2_5_vl")
ARCHITECTURE_NAMES = (*ARCHITECTURES, *VISION_ARCHITECTURES)

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]

# ChatML; with tools, a Hermes-style tool list and <tool_call> blocks (Qwen 2.5's format), so that tool
# calling runs through the same template path as real models. Without tools it renders as it always did.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nYou may call functions. Signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\nCall one as <tool_call>\n"
    "{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """
Large language models are served by engines that batch many requests together. Each request
brings a prompt, and the engine computes keys and values for every token of it, stores them in a
cache, and then generates new tokens one at a time. Continuous batching lets new requests join a
running batch between steps, so the accelerator never waits for the slowest request to finish.
A paged cache splits memory into blocks of a fixed number of tokens, the way an operating system
splits memory into pages. Requests own lists of blocks, and blocks can be shared between
requests that start with the same prefix. When memory runs out, the newest request is preempted:
its blocks are freed and it is computed again later from its prompt and the tokens it made.
The coordinator routes requests to engine groups, keeps every request until its answer reaches
the client, and pauses, suspends and resumes the fleet when a training loop asks it to.
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that
wanted to learn everything about the world, one token at a time. Numbers: 0 1 2 3 4 5 6 7 8 9 10
100 1000 2024 3.14159. Code: def add(a, b): return a + b. print("hello, world"). for i in range(10):
Kubernetes runs containers in pods; an operator watches resources and reconciles the cluster
toward the state that the user declared. Users patch the resource, and the operator acts.
"""


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (``tokenizers``) trained on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line for line in CORPUS.splitlines() if line.strip()] * 4, trainer=trainer)
    return tokenizer


def with_placeholders(tokenizer: Any, vocab_size: int) -> Any:
    """``tokenizer`` with placeholder words (``<|filler_N|>``) up to ``vocab_size`` entries, in its BPE vocabulary:
    no merge makes them, so no text tokenizes to them, and each decodes as itself. Not added tokens: whatever
    matches added tokens in text scans every one of them (llguidance's view of a vocabulary padded to 32,768 with
    added tokens took 5.5 CPU-s to build, 0.16 s with the same words in the vocabulary)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    data = json.loads(tokenizer.to_str())
    words = data["model"]["vocab"]
    taken = max([*words.values(), *(token["id"] for token in data["added_tokens"])]) + 1
    for index in range(vocab_size - taken):
        words[f"<|filler_{index}|>"] = taken + index
    return Tokenizer.from_str(json.dumps(data))


def tiny_tokenizer(vocab_size: int | None = None, tokenizer_vocab_size: int = 512) -> Any:
    """The tiny models' tokenizer (``PreTrainedTokenizerFast``, ChatML template): ``tokenizer_vocab_size`` words
    trained on the built-in corpus, padded with placeholders up to ``vocab_size`` (see :func:`make_tiny_model`).
    Its ``<|begin_of_text|>`` and ``<|end_of_text|>`` are ids 0 and 1."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    trained = train_tokenizer(tokenizer_vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=with_placeholders(trained, vocab_size) if vocab_size is not None else trained,
        bos_token=BOS, eos_token=EOS, pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path: str | Path,
    seed: int = 0,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    tokenizer_vocab_size: int = 512,
    vocab_size: int | None = None,
    **config_overrides,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files for a random model to ``path``.

    ``vocab_size``: pad the trained tokenizer with placeholder tokens up to this size, for a benchmark model of a
    real model's shape (Llama 3's 128,256 words: its LM head and sampler cost what they cost there).
    """
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    if arch not in ARCHITECTURE_NAMES:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHITECTURE_NAMES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    fast = tiny_tokenizer(vocab_size, tokenizer_vocab_size)
    if arch in VISION_ARCHITECTURES:
        from .vision.tiny import make_tiny_vision_model  # noqa: PLC0415

        return make_tiny_vision_model(path, arch, seed, hidden_size, num_layers, num_heads, num_kv_heads,
                                      intermediate_size, fast)
    vocab_size = len(fast)  # the full size, special tokens included

    config_class_name, model_class_name = ARCHITECTURES[arch]
    config = getattr(transformers, config_class_name)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **{**MOE_DEFAULTS.get(arch, {}), **config_overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class_name)(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    fast.save_pretrained(str(path))
    return path
