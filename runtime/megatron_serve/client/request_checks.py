"""What ``generate`` and ``chat`` refuse before anything is sent, with vLLM's ``ValueError`` and its words.

vLLM's ``LLM.generate`` raises ``ValueError`` for an empty prompt, a token id outside the
vocabulary, a prompt that leaves no room for one generated token within ``max_model_len``, and a
``lora_request`` without ``enable_lora``; a LoRA directory that is not there fails its load. The
engines refuse the same requests, but only as a finished request with ``finish_reason`` ``"error"``
and empty text, which a script reads as an answer. So the Python API checks them here, in the
caller's thread, against the facts the engines report (:meth:`ServingBounds.from_status`), and a
batch with one bad prompt raises before any of it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tokenizer import Tokenizer
from ..model.lora.checkpoint import CONFIG_FILE
from ..wire.sampling_params import SamplingParams
from .prompts import ImagePrompt, Prompt

#: Tokens a tokenizer may add to a text beyond one per byte of it (BOS/EOS, SentencePiece's leading space).
_ADDED_TOKENS = 16


@dataclass(frozen=True)
class ServingBounds:
    """The facts a request is checked against; ``None``: not known (a fleet whose engines have not joined yet)."""

    max_model_len: int | None
    vocab_size: int | None
    enable_lora: bool | None
    local_lora_paths: bool  # the engines read LoRA directories from this machine's file system

    @classmethod
    def from_status(cls, status: dict[str, Any], vocab_size: int | None, *, local_lora_paths: bool
                    ) -> "ServingBounds":
        """From a ``STATUS_REPLY`` (direct mode answers one of the same shape): the tightest context limit of
        the engines, and whether any serves LoRA (an engine without ``enable_lora`` reports ``loras`` None)."""
        engines = status.get("engines") or []
        limits = [e["info"]["max_sequence_length"] for e in engines
                  if isinstance((e.get("info") or {}).get("max_sequence_length"), int)]
        lora = any(e.get("loras") is not None for e in engines) if engines else None
        return cls(min(limits) if limits else None, vocab_size, lora, local_lora_paths)

    def check(self, index: int, prompt: Prompt, params: SamplingParams, tokenizer: Tokenizer) -> None:
        """Raise ``ValueError`` (vLLM's words) when the engines would refuse prompt ``index`` under ``params``."""
        self._check_lora(params)
        if isinstance(prompt, ImagePrompt):
            return  # its length counts the images' tokens, placed by the engine's processor: the engine checks
        tokens = self._tokens(prompt, tokenizer)
        if tokens is None:
            return
        where = f" (prompt {index})" if index else ""
        if not tokens:
            raise ValueError(f"The decoder prompt cannot be empty{where}")
        if self.vocab_size is not None:
            outside = [t for t in tokens if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(f"Token id {outside[0]} is out of vocabulary{where} (the model's vocabulary is "
                                 f"[0, {self.vocab_size}))")
        limit = self.max_model_len
        if limit is not None and len(tokens) >= limit:
            need = "is longer than" if len(tokens) > limit else "plus the number of requested output tokens " \
                                                               "(at least 1) is longer than"
            raise ValueError(f"The decoder prompt (length {len(tokens)}){where} {need} the maximum model length of "
                             f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens "
                             "(prompt + requested output tokens).")

    def _tokens(self, prompt: str | list[int], tokenizer: Tokenizer) -> list[int] | None:
        """The prompt's token ids, when a check needs them: a text is tokenized only when it may be empty or too
        long (no text has more tokens than bytes, but for the few a tokenizer adds), so most are not."""
        if not isinstance(prompt, str):
            return prompt
        if prompt and (self.max_model_len is None or len(prompt.encode()) + _ADDED_TOKENS < self.max_model_len):
            return None
        return tokenizer.encode(prompt) if tokenizer is not None else None

    def _check_lora(self, params: SamplingParams) -> None:
        if params.lora_name is None:
            return
        if self.enable_lora is False:
            raise ValueError(f"Got lora_request {params.lora_name!r} but LoRA is not enabled! (build the LLM with "
                             "enable_lora=True)")
        path = params.lora_path
        if path is not None and self.local_lora_paths and not (Path(path) / CONFIG_FILE).is_file():
            what = "does not exist" if not Path(path).exists() else f"holds no {CONFIG_FILE}"
            raise ValueError(f"lora_request {params.lora_name!r}: the LoRA directory {path} {what}")
