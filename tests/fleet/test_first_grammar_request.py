"""The first grammar-constrained request of a fresh server does not stall the others.

Before (issue 54) the engine's first constrained request imported ``llguidance.torch`` on the step
path, which compiles a kernel with ``torch.compile`` at import and so pulls in ``torch._dynamo`` (4-6 s
in a fresh process on a quiet 2-core machine, more under load): every request in the step waited
that long, once per engine process. Now the masks are filled through llguidance's numpy binding and
the grammar engine is warmed on a thread at engine start.

A real ``megatron-serve run`` (fresh engine process): a plain streamed request is timed alone, then
while the first grammar request of the server runs beside it, then beside later grammar requests.
The plain request beside the first one must finish within 0.3 s of the slowest of its usual times
(the same process's own baseline, so a loaded machine slows both sides alike).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.run_stack import start_run

pytestmark = pytest.mark.timeout(600)

#: Long enough to span the grammar request's admission and first steps on a loaded machine.
PLAIN_TOKENS = 64


async def timed_plain_beside(http: httpx.AsyncClient, model: str, grammar: bool) -> float:
    """Seconds a plain streamed request takes; with ``grammar``, a constrained request is sent once its first
    token came (so it is admitted while the plain one decodes) and both are awaited."""
    body = {"model": model, "prompt": "Hello", "max_tokens": PLAIN_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    began = time.monotonic()
    side: asyncio.Task | None = None
    async with http.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if grammar and side is None and line.startswith("data: {"):
                side = asyncio.ensure_future(http.post("/v1/completions", json={
                    "model": model, "prompt": "Code:", "max_tokens": 8, "temperature": 1.0, "seed": 3,
                    "structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}}))
    took = time.monotonic() - began
    if side is not None:
        constrained = await side
        assert constrained.status_code == 200, constrained.text
        text = constrained.json()["choices"][0]["text"]
        assert len(text) == 6 and text[3] == "-", text  # control: the grammar held
    return took


def test_a_plain_request_is_not_stalled_by_the_first_grammar_request(tiny_llama, tmp_path):
    stack = start_run(tiny_llama, tmp_path / "run", engines=1)
    try:
        async def main() -> tuple[list[float], float]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=300) as http:
                usual = [await timed_plain_beside(http, stack.model, grammar=False) for _ in range(3)]
                first = await timed_plain_beside(http, stack.model, grammar=True)
                usual += [await timed_plain_beside(http, stack.model, grammar=True) for _ in range(3)]
                return usual, first

        usual, first = asyncio.run(main())
        assert first <= max(usual) + 0.3, f"beside the first grammar request {first:.2f}s, usually {usual}"
    finally:
        stack.kill()
