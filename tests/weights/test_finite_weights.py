"""No weights holding NaN or an infinity are applied, on any load path (issue 55): every refusal names the tensor,
and the fleet keeps serving its epoch with the same text.

The check itself (:mod:`megatron_serve.model.finite`) against dtypes and positions; a model's first load; a
directory refit and a refit from tensors in this process (direct mode); and a real fleet (coordinator and engine
processes, gloo) taking a trainer's push of a NaN ``lm_head`` (refused by the sender before the REFIT; a sender
that skips its check is refused by the engine before the bucket is applied), a NaN LoRA push and a NaN adapter
directory through LOAD_LORA.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve import WeightSender
from megatron_serve.client import weight_sender
from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.model.loader import load_model
from megatron_serve.model.lora.checkpoint import WEIGHTS_FILE
from megatron_serve.model.finite import NonFiniteWeights, first_nonfinite, refuse_nonfinite
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import process_fleet
from ..lora_adapters import make_peft_adapter, peft_model

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
POISONED = "model.layers.1.mlp.down_proj.weight"


def poisoned_copy(model_dir: str, target: Path, name: str = POISONED, value: float = float("nan")) -> str:
    """``model_dir`` copied to ``target`` with one element of tensor ``name`` set to ``value``."""
    shutil.copytree(model_dir, target)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    tensors[name].view(-1)[tensors[name].numel() // 2] = value
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(target)


def poisoned_adapter(adapter_dir: str, target: Path) -> str:
    shutil.copytree(adapter_dir, target)
    tensors = load_file(target / WEIGHTS_FILE)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key].view(-1)[0] = float("inf")
    save_file(tensors, target / WEIGHTS_FILE, metadata={"format": "pt"})
    return str(target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_check_finds_one_bad_element_anywhere(dtype, value):
    for position in (0, 4097, 99_999):
        tensor = torch.randn(100_000).to(dtype)
        assert first_nonfinite([("good", tensor)]) is None, "control: random values are finite"
        tensor[position] = value
        assert first_nonfinite([("good", torch.ones(3)), ("bad", tensor.view(100, 1000))]) == "bad"
    assert first_nonfinite([("max", torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min], dtype=dtype))]) is None


def test_fp8_nan_and_integers_and_empty_tensors():
    fp8 = torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn)
    assert first_nonfinite([("fp8", fp8)]) is None
    fp8.view(torch.uint8)[1] = 0xFF  # -NaN
    assert first_nonfinite([("fp8", fp8)]) == "fp8"
    assert first_nonfinite([("ints", torch.arange(5)), ("empty", torch.empty(0))]) is None
    with pytest.raises(NonFiniteWeights, match="LoRA adapter 'x': tensor fp8 holds NaN"):
        refuse_nonfinite([("fp8", fp8)], "LoRA adapter 'x'")


def test_a_checkpoint_with_nan_is_refused_at_load_naming_the_tensor(tiny_llama, tmp_path):
    load_model(tiny_llama, torch.float32, "cpu")  # control: the clean checkpoint loads
    bad = poisoned_copy(tiny_llama, tmp_path / "nan")
    with pytest.raises(NonFiniteWeights, match=f"the checkpoint at {bad}: tensor {POISONED} holds NaN"):
        load_model(bad, torch.float32, "cpu")
    with pytest.raises(ValueError, match="tensor lm_head.weight holds NaN or infinite"):
        MegatronLLM(poisoned_copy(tiny_llama, tmp_path / "inf", "lm_head.weight", float("inf")))


def test_a_directory_refit_with_nan_is_refused_before_any_weight_changes(tiny_llama, tmp_path):
    bad = poisoned_copy(tiny_llama, tmp_path / "nan")
    with MegatronLLM(tiny_llama, InferenceConfig(num_kv_blocks=64)) as llm:
        before = [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]
        with pytest.raises(ValueError, match=f"tensor {POISONED} holds NaN"):
            llm.engine.memory.verify_refit(bad)
        with pytest.raises(ValueError, match=f"tensor {POISONED} holds NaN"):
            llm.refit(bad)
        assert llm.engine.epoch == 0 and not llm.engine.memory.incomplete
        assert [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)] == before
        clean = {name: t.clone() for name, t in load_file(Path(tiny_llama) / "model.safetensors").items()}
        clean["lm_head.weight"][0, 0] = float("-inf")
        with pytest.raises(ValueError, match="the refit's tensors: tensor lm_head.weight holds NaN"):
            llm.refit(list(clean.items()))
        assert llm.engine.epoch == 0
        assert [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)] == before


def test_a_nan_adapter_is_refused_where_it_is_read(tiny_llama, tmp_path):
    good = str(make_peft_adapter(tiny_llama, tmp_path / "good", rank=4, seed=1))
    bad = poisoned_adapter(good, tmp_path / "bad")
    config = InferenceConfig(num_kv_blocks=64, enable_lora=True, max_lora_rank=8, max_cpu_loras=2)
    with MegatronLLM(tiny_llama, config) as llm:
        llm.engine.adapters.load("good", good)  # control
        with pytest.raises(ValueError, match="LoRA adapter 'bad': tensor base_model.*lora_B.weight holds NaN"):
            llm.engine.adapters.load("bad", bad)
        assert set(llm.engine.adapters.names()) == {"good"}


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory):
    engine = ("--enable-lora", "--max-lora-rank", "8", "--lora-allowed-dirs", str(tmp_path_factory.getbasetemp()))
    with process_fleet(tmp_path_factory.mktemp("finite-logs"), tiny_llama, [engine]) as fleet:
        yield fleet


async def serves(client: InferenceClient) -> list[list[int]]:
    answers = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    assert all(set(a.policy_epochs) == {0} for a in answers), "the fleet still serves epoch 0"
    return [a.generated_tokens for a in answers]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_nan_pushes_are_refused_and_the_fleet_keeps_its_epoch_and_text(fleet, tiny_llama, tmp_path,
                                                                          monkeypatch):
    weights = load_file(Path(tiny_llama) / "model.safetensors")
    head = weights["lm_head.weight"].clone()
    head.fill_(float("nan"))
    adapter_dir = str(make_peft_adapter(tiny_llama, tmp_path / "adapter", rank=4, seed=3))
    adapter = peft_model(tiny_llama, adapter_dir)
    with torch.no_grad():
        next(p for n, p in adapter.named_parameters() if "lora_A" in n).view(-1)[3] = float("nan")
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(1, timeout=300)
        before = await serves(client)
        sender = WeightSender(client, backend="gloo", timeout=60)
        await client.pause()
        with pytest.raises(NonFiniteWeights, match="tensor lm_head.weight holds NaN"):
            await sender.send([("lm_head.weight", head)])
        with pytest.raises(NonFiniteWeights, match="tensor .*lora_A.* holds NaN"):
            await sender.send_lora("a", adapter, version=1)
        # a sender that skips its check: each engine refuses the bucket before any of its tensors is applied
        monkeypatch.setattr(weight_sender, "first_nonfinite", lambda named: None)
        monkeypatch.setattr(weight_sender, "refuse_nonfinite", lambda named, what: None)
        with pytest.raises(ControlError, match="tensor lm_head.weight holds NaN.*keeps serving epoch 0") as refused:
            await asyncio.wait_for(sender.send([("lm_head.weight", head)]), 120)
        assert refused.value.code == "refit_failed"
        with pytest.raises(ControlError, match="the transfer from .*: tensor .*lora_A.* holds NaN.*keeps serving epoch 0"):
            await asyncio.wait_for(sender.send_lora("a", adapter, version=1), 120)
        status = await client.status()
        assert status["epoch"] == 0
        await client.unpause()
        assert await serves(client) == before
        # an adapter directory holding an infinity, through LOAD_LORA
        bad = poisoned_adapter(adapter_dir, tmp_path / "inf-adapter")
        with pytest.raises(ControlError, match="LoRA adapter 'inf': tensor .*lora_B.* holds NaN or infinite"):
            await client.load_lora_adapter("inf", bad)
        assert "inf" not in (await client.status())["engines"][0].get("loras", {})
