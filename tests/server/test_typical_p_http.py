"""transformers', TGI's and llama.cpp's ``typical_p`` over HTTP: ``/v1/completions`` takes it because its row of the
sampling table has an HTTP field (no route names it), and every seed draws among the tokens transformers' own
``TypicalLogitsWarper`` keeps for the same prompt (the model's logits from transformers). A real engine in this
process (``surface``)."""

from __future__ import annotations

import torch
import transformers
from transformers.generation.logits_process import TypicalLogitsWarper

from .conftest import surface

MODEL = "tiny-llama"
PROMPT = [5, 17, 300, 42, 9]
MASS = 0.05
SEEDS = range(12)


async def test_every_draw_is_among_the_tokens_transformers_warper_keeps(tiny_model, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[:, -1].float()
    kept = set(torch.isfinite(TypicalLogitsWarper(MASS)(None, logits))[0].nonzero().flatten().tolist())
    assert 0 < len(kept) < logits.shape[-1] // 8  # a few of the tiny model's nearly even tokens
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "return_token_ids": True}
    async with surface(tiny_model, tokenizer) as (_, http):
        async def first(seed: int, **extra: float) -> int:
            answer = await http.post("/v1/completions", json={**body, "seed": seed, **extra})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["token_ids"][0]

        typical = {await first(seed, typical_p=MASS) for seed in SEEDS}
        free = {await first(seed) for seed in SEEDS}
        assert typical <= kept, (typical, kept)
        assert not free <= kept, (free, kept)  # control: the same seeds without typical_p leave the kept tokens
        for bad in (0, 1.5, "x"):
            refused = await http.post("/v1/completions", json={**body, "typical_p": bad})
            assert refused.status_code == 400 and "typical_p" in refused.text, (bad, refused.text)
