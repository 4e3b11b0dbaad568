"""Trainer parity: ``transformers`` under ``megatron_serve.invariant`` computes the engine's log probs bitwise.

The engine serves the target among 7 other requests with ``--batch-invariant``; a ``transformers``
model loaded from the same checkpoint in the same dtype with ``attn_implementation="megatron_invariant"``
runs prompt + completion under ``batch_invariant()``; ``log_softmax(logits.float())`` at each
completion token must ``==`` the engine's log prob. The control is today's trainer: the default
``sdpa`` forward against the default engine differs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from .runs import Setup, differing, run_target, trainer_log_probs

CASES = [("llama", "float32", False), ("llama", "bfloat16", False), ("llama", "bfloat16", True),
         ("llama", "float32", True), ("qwen3", "bfloat16", True), ("qwen3_moe", "bfloat16", False),
         ("qwen3_moe", "float32", True), ("qwen2_moe", "bfloat16", True), ("mixtral", "bfloat16", True)]


@pytest.mark.parametrize("arch, dtype, sampled", CASES)
def test_the_trainer_computes_the_engines_log_probs_bitwise(models, arch, dtype, sampled):
    run = run_target(models[arch], dtype, True, Setup(others=7), sampled=sampled)
    trainer = trainer_log_probs(models[arch], dtype, run, invariant=True)
    assert trainer == run.log_probs, f"{differing(trainer, run.log_probs)} of {len(trainer)} differ"


def test_without_the_mode_the_trainer_differs_in_bfloat16(models):
    run = run_target(models["llama"], "bfloat16", False, Setup(others=7))
    assert differing(trainer_log_probs(models["llama"], "bfloat16", run, invariant=False), run.log_probs) > 8


IMPORT_PROBE = textwrap.dedent("""
    import sys
    import megatron_serve.invariant as invariant
    from transformers import AttentionInterface
    heavy = sorted(name for name in ("zmq", "fastapi", "uvicorn", "msgpack", "kopf", "megatron_serve.engine",
                                     "megatron_serve.server", "megatron_serve.model") if name in sys.modules)
    print(heavy, invariant.ATTENTION_NAME in AttentionInterface._global_mapping)
""")


def test_a_trainer_imports_it_without_the_servers_dependencies():
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True"], out


def test_the_trainer_backward_runs_and_the_forward_stays_the_same(models):
    """With gradients on, the same log probs (the tiles become separate tensors) and a backward pass."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from megatron_serve.invariant import ATTENTION_NAME, batch_invariant  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32,
                                                              attn_implementation=ATTENTION_NAME)
    ids = torch.randint(5, 500, (2, 37))
    with batch_invariant():
        with torch.no_grad():
            expected = torch.log_softmax(model(ids).logits.float(), -1)
        log_probs = torch.log_softmax(model(ids).logits.float(), -1)
        log_probs[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()
    assert torch.equal(log_probs.detach(), expected)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_invariant_norms_keep_the_cpu_forward_and_replace_every_norm(models):
    """``use_invariant_norms`` (the engine's RMSNorm, a Triton kernel on a GPU) finds the model's input,
    post-attention, q/k and final norms; on CPU the engine's norm is ``transformers``' op for op: the same logits."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from megatron_serve.invariant import ATTENTION_NAME, batch_invariant, use_invariant_norms  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.bfloat16,
                                                              attn_implementation=ATTENTION_NAME).eval()
    ids = torch.randint(5, 500, (1, 29))
    with torch.inference_mode(), batch_invariant():
        expected = model(ids).logits
        layers = model.config.num_hidden_layers
        assert use_invariant_norms(model) == 4 * layers + 1
        assert torch.equal(model(ids).logits, expected)
