"""vLLM's progress bar for ``generate(..., use_tqdm=True)``: "Processed prompts", one step per prompt.

The bar is made in the caller's thread and stepped from the event loop's thread as requests finish
(``tqdm.update`` takes the bar's own lock); a prompt counts once all its ``n`` requests finished.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Sequence


class ProgressBar:
    """Counts each prompt's finished requests; steps the bar when a prompt's last one finishes."""

    def __init__(self, bar: Any, prompt_of_job: Sequence[int]) -> None:
        self._bar = bar
        self._prompt_of_job = list(prompt_of_job)
        self._left = Counter(self._prompt_of_job)
        self._lock = threading.Lock()

    def finished(self, job: int) -> None:
        prompt = self._prompt_of_job[job]
        with self._lock:
            self._left[prompt] -= 1
            done = self._left[prompt] == 0
        if done:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def progress_bar(use_tqdm: bool | Callable[..., Any], jobs: Sequence[tuple[int, Any, Any]]) -> ProgressBar:
    """A bar over the prompts of ``jobs`` (``(prompt index, prompt, params)``); ``use_tqdm`` is ``True`` (tqdm's
    own bar) or a ``tqdm``-like class, as vLLM takes."""
    if use_tqdm is True:
        from tqdm.auto import tqdm  # noqa: PLC0415 - only when a bar is shown

        factory: Callable[..., Any] = tqdm
    else:
        factory = use_tqdm
    prompts = [prompt for prompt, _, _ in jobs]
    bar = factory(total=len(set(prompts)), desc="Processed prompts", dynamic_ncols=True)
    return ProgressBar(bar, prompts)
