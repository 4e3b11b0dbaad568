"""Tokenization and chat templates from the model directory, through ``transformers`` (local files only); and
the little of a tokenizer an engine process reads, without ``transformers``."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .multimodal import ImageProcessor


#: Text whose decoding ``clean_up_tokenization_spaces`` changes (see ``Tokenizer._rust``).
_CLEAN_UP_PROBE = "a . b , c ! d ? e 's f n't g"


class PromptTooLong(ValueError):
    """A text holds more tokens than the caller can use; ``tokens`` says how many."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"the text has {tokens} tokens, more than {limit}")
        self.tokens = tokens
        self.limit = limit


class Vocabulary(Protocol):
    """What the engine itself reads of a tokenizer: it takes and returns token ids and makes no text."""

    eos_token_ids: list[int]
    images: ImageProcessor | None  # the image processor of a vision-language model (None: text only)

    def grammar_json(self) -> str:
        """The fast tokenizer's JSON, as a grammar engine (llguidance) reads the vocabulary from it."""
        ...


class Tokenizer:
    """A thin adapter that fixes the few calls the engine, coordinator and server make."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int], images: ImageProcessor | None = None):
        self._tok = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.images = images  # the image processor of a vision-language model (None: text only)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """The tokenizer files of ``model_dir``; ``chat_template`` (Jinja text) replaces the model's own."""
        from .multimodal import load_image_processor  # noqa: PLC0415

        model_dir = check_tokenizer_files(model_dir)
        hf_tokenizer = _load_hf_tokenizer(model_dir)
        if chat_template is not None:
            hf_tokenizer.chat_template = chat_template
        return cls(hf_tokenizer, _eos_ids(model_dir, hf_tokenizer), load_image_processor(model_dir))

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The ``transformers`` tokenizer itself, for libraries that read a vocabulary from it (grammar engines)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def grammar_json(self) -> str:
        """The Rust tokenizer's JSON with the tokens ``transformers`` added from ``tokenizer_config.json``, as
        ``llguidance.hf.from_tokenizer`` takes it (padding and truncation off)."""
        if not self._tok.is_fast:
            raise ValueError("structured outputs need a fast tokenizer (a tokenizer.json): this model has none")
        return _grammar_json(self._tok.backend_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; with ``max_tokens``, :class:`PromptTooLong` when there are more.

        Fast tokenizers encode through the Rust tokenizer's batch call, which releases the GIL while
        it works (other threads, the server's event loop among them, keep running), and the count is
        checked before the ids become a Python list: that conversion holds the GIL (for a long text, long
        enough to stall the event loop), so a text too long for the context never pays it. The call is the
        one that skips character offsets (the same ids; nothing here reads offsets): freeing a long text's
        encoding holds the GIL too, and without offsets it frees in a fraction of the time.
        """
        if not self._tok.is_fast:
            ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens))
            if max_tokens is not None and len(ids) > max_tokens:
                raise PromptTooLong(len(ids), max_tokens)
            return ids
        encoding = self._tok.backend_tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise PromptTooLong(len(encoding), max_tokens)
        return encoding.ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``, as ``transformers`` decodes it.

        Straight from the Rust tokenizer where that gives the same text (see :attr:`_rust`): the
        ``transformers`` wrapper costs several times the Rust call, and the client side decodes two
        short windows per generated token (:mod:`megatron_serve.client.detokenizer`).
        """
        rust = self._rust
        if rust is not None:
            return rust.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id], skip_special_tokens)``, kept per id: the client side decodes each generated token
        on its own once more as the next one's context (:mod:`megatron_serve.client.detokenizer`)."""
        texts = self._single_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.decode([token_id], skip_special_tokens)
        return text

    @functools.cached_property
    def _single_texts(self) -> tuple[dict[int, str], dict[int, str]]:
        """:meth:`decode_one`'s texts by id: without, then with ``skip_special_tokens``."""
        return {}, {}

    def single_texts(self, skip_special_tokens: bool = True) -> dict[int, str]:
        """The texts :meth:`decode_one` kept so far, by id (the client side reads them without a call per token)."""
        return self._single_texts[skip_special_tokens]

    @functools.cached_property
    def concatenative(self) -> bool:
        """Whether the text of tokens is the texts of their runs that end on whole characters, joined: then a token
        that follows such a run adds its own text (:meth:`decode_one`) exactly.

        So it is for byte-level BPE (GPT-2, Llama 3, Qwen, the tiny model): the decoder maps each token to its bytes,
        and the text is those bytes, joined, read as UTF-8 (invalid bytes become U+FFFD), whatever the tokens.
        Where a decoder looks at a token's neighbours (SentencePiece's word-start marker, WordPiece's ``##``), or
        ``transformers`` changes the text afterwards (see :attr:`_rust`), it is not.
        """
        rust = self._rust
        if rust is None:
            return False
        from tokenizers import decoders  # noqa: PLC0415

        return type(rust.decoder) is decoders.ByteLevel

    @functools.cached_property
    def _rust(self) -> Any:
        """The fast tokenizer's Rust object when calling it decodes exactly as ``transformers`` does, else None.

        ``transformers`` adds one step of its own, ``clean_up_tokenization_spaces`` (" ." becomes ".",
        ...), which its versions apply or skip differently (recent ones skip it for BPE models even
        where the config asks for it): so where the config asks for it, a probe that the clean-up would
        change decides whether this version applies it.
        """
        if not self._tok.is_fast:
            return None
        rust = self._tok.backend_tokenizer
        if getattr(self._tok, "clean_up_tokenization_spaces", False):
            ids = self._tok.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
            raw = rust.decode(ids, skip_special_tokens=True)
            if " ." not in raw or self._tok.decode(ids, skip_special_tokens=True) != raw:
                return None
        return rust

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``decode`` drops by default: the named special tokens and every added token marked special."""
        added = self._tok.added_tokens_decoder
        return frozenset(self._tok.all_special_ids) | {i for i, token in added.items() if token.special}

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for log-prob listings): :meth:`decode_one`'s, kept per id (a prompt's
        log probs name up to 21 tokens per position, the same ones again and again)."""
        return self.decode_one(token_id, skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            **template_kwargs: Any) -> str:
        """The conversation as the template renders it; ``template_kwargs`` become template variables
        (vLLM's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json has no 'chat_template')")
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools, continue_final_message=continue_final_message,
                                             **template_kwargs)


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the template itself when it is inline Jinja (as in vLLM).

    Text with ``{`` or a newline is a template; anything else must be a readable file. Either is
    compiled here, so that a broken template fails the start instead of the first chat request.
    """
    import jinja2  # noqa: PLC0415

    if "{" in value or "\n" in value:
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text()
        except OSError as exc:
            raise FileNotFoundError(f"--chat-template {value}: cannot read it ({exc.strerror}); an inline template "
                                    "must hold Jinja such as '{{ messages }}' or '{% for ... %}'") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


#: The classes a ``tokenizer_config.json`` may name that ``AutoTokenizer`` loads as ``TokenizersBackend`` (the
#: ``tokenizer.json`` as it is), unless the model type is one of :data:`_AUTO_OVERRIDDEN_TYPES`.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
#: Model types for which ``AutoTokenizer`` loads the class ``transformers`` registers for the type (one of its own)
#: in place of a generic class that ``tokenizer_config.json`` names: its ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``
#: that have such a class. ``tests/test_tokenizer_load.py`` holds this equal to the installed ``transformers``'.
_AUTO_OVERRIDDEN_TYPES = frozenset({"hyperclovax_vision_v2", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text",
                                    "qwen4_exp", "siglip2"})


def _load_hf_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer``'s tokenizer for ``model_dir``, loaded as ``TokenizersBackend`` without it where
    ``AutoTokenizer`` would pick that class too (:func:`_auto_picks_backend`).

    ``AutoTokenizer`` reads the model's config through ``AutoConfig`` first, whose imports (torch and
    ``transformers``' modelling utilities) cost some 4 s of CPU, several times the tokenizer's own load, in every
    server process; the test suite starts hundreds of them. Whatever it decides otherwise (a class of the model
    type's own, remote code, Mistral's format) still goes through it.
    """
    if _auto_picks_backend(model_dir):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: PLC0415 - heavy import

        return TokenizersBackend.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy import, only when a tokenizer is needed

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _auto_picks_backend(model_dir: Path) -> bool:
    """Whether ``AutoTokenizer`` loads ``model_dir``'s tokenizer as ``TokenizersBackend`` for sure, read from its
    files alone: ``tokenizer_config.json`` names a generic class and no code of its own (``auto_map``), there is a
    ``tokenizer.json`` and a ``config.json``, and the model type is not one that ``AutoTokenizer`` gives a class of
    its own whatever the file says."""
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(tokenizer_config, dict) and isinstance(config, dict)
            and tokenizer_config.get("tokenizer_class") in _GENERIC_CLASSES and "auto_map" not in tokenizer_config
            and (model_dir / "tokenizer.json").is_file()
            and config.get("model_type") not in _AUTO_OVERRIDDEN_TYPES
            and config.get("model_name") not in _AUTO_OVERRIDDEN_TYPES)


def check_tokenizer_files(model_dir: str | Path) -> Path:
    """Fail fast, without importing ``transformers``, when ``model_dir`` holds no tokenizer files."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in model directory {model_dir}")
    return model_dir


def _eos_ids(model_dir: Path, hf_tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json together (Llama 3 lists several)."""
    return _with_config_eos_ids(model_dir, hf_tokenizer.eos_token_id)


def _with_config_eos_ids(model_dir: Path, tokenizer_eos: int | None) -> list[int]:
    ids: list[int] = [] if tokenizer_eos is None else [int(tokenizer_eos)]
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is not None and int(token_id) not in ids:
                    ids.append(int(token_id))
    return ids


def _grammar_json(rust: Any) -> str:
    rust = copy.copy(rust)
    rust.no_padding()
    rust.no_truncation()
    return rust.to_str()


class TokenizerFiles:
    """An engine process's :class:`Vocabulary`: the model directory's ``tokenizer.json`` through the ``tokenizers``
    library alone. An engine makes no text, and ``transformers``' tokenizer import and load cost an engine process
    more CPU than the rest of its start; the full :class:`Tokenizer` stays where text is made (the server, the
    Python API in direct mode). The vocabulary is what ``transformers`` builds from the same files: the Rust
    tokenizer of ``tokenizer.json`` with the added tokens ``tokenizer_config.json`` declares that it lacks, and the
    EOS token that file names (``tests/test_tokenizer.py`` holds the two equal)."""

    def __init__(self, rust: Any, eos_token_ids: list[int], images: ImageProcessor | None) -> None:
        self._rust = rust
        self.eos_token_ids = eos_token_ids
        self.images = images

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Vocabulary:
        """``model_dir``'s vocabulary; a directory without ``tokenizer.json`` (a slow tokenizer only) gets the full
        :class:`Tokenizer`, which reads what ``tokenizers`` cannot."""
        from tokenizers import AddedToken  # noqa: PLC0415
        from tokenizers import Tokenizer as RustTokenizer  # noqa: PLC0415

        from .multimodal import load_image_processor  # noqa: PLC0415

        model_dir = check_tokenizer_files(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            return Tokenizer.from_pretrained(model_dir)
        rust = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        declared = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
        missing = [token for _, token in declared if rust.token_to_id(token["content"]) is None]
        if missing:
            rust.add_special_tokens([_added_token(AddedToken, t) for t in missing if t.get("special")])
            rust.add_tokens([_added_token(AddedToken, t) for t in missing if not t.get("special")])
        eos = config.get("eos_token")
        eos_text = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = rust.token_to_id(eos_text) if isinstance(eos_text, str) else None
        return cls(rust, _with_config_eos_ids(model_dir, eos_id), load_image_processor(model_dir))

    def grammar_json(self) -> str:
        return _grammar_json(self._rust)


def _added_token(added_token: Any, declared: dict[str, Any]) -> Any:
    """A ``tokenizers.AddedToken`` from its entry in ``tokenizer_config.json``'s ``added_tokens_decoder``."""
    return added_token(declared["content"], single_word=declared.get("single_word", False),
                       lstrip=declared.get("lstrip", False), rstrip=declared.get("rstrip", False),
                       normalized=declared.get("normalized", not declared.get("special", False)),
                       special=declared.get("special", False))
