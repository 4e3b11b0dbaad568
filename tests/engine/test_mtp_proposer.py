"""Issue 39, method ``mtp``: the target's own MTP layer (DeepSeek-V3 style, ``model.layers.{num_hidden_layers}``)
guesses from the target's hidden states; the output is the target's, token for token and log prob for log prob.

Checkpoints are tiny Llama models given an MTP layer by :func:`megatron_serve.model.tiny_mtp.add_mtp_layer`:
``copy`` (one decoder layer, the MTP layer a copy of it reading the next token's embedding: mostly the
target's own next token), ``random`` (two layers, a random MTP layer that mixes in the hidden state).
"""

from __future__ import annotations

import functools
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve import DynamicInferenceRequest, SamplingParams
from megatron_serve.engine.speculative.mtp import MtpCheckpointError
from megatron_serve.model.loader import iterate_checkpoint
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.model.tiny_mtp import add_mtp_layer
from megatron_serve.weights.sources import TensorSource

from ..prompts import run_steps
from .speculative_heads import counts, engine_on, greedy_runs, record_guesses

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}  # K pinned: the tests count guesses
RNG = random.Random(39)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(RNG.randint(1, 40))] for _ in range(6)]
COUNT = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"copy": str(add_mtp_layer(make_tiny_model(root / "copy", seed=0, num_layers=1), copy_layer=True)),
            "random": str(add_mtp_layer(make_tiny_model(root / "random", seed=1), seed=2)),
            "mixed": str(add_mtp_layer(make_tiny_model(root / "mixed", seed=0, num_layers=1), seed=3, copy_layer=True,
                                       hidden_weight=2.0)),
            "plain": str(make_tiny_model(root / "plain", seed=1))}


run = functools.partial(greedy_runs, count=COUNT)


def served(model_dir: str, speculative: dict | None) -> tuple[list, tuple[int, int], list[int]]:
    engine = engine_on(model_dir, speculative)
    out = run(engine, PROMPTS)
    result = out, counts(engine), list(engine.stats.accepted_per_pos)
    engine.shutdown()
    return result


@pytest.mark.parametrize("name", ["copy", "random"])
def test_greedy_tokens_and_log_probs_equal_no_speculation(models, name):
    plain, _, _ = served(models[name], None)
    speculated, (drafts, accepted), per_position = served(models[name], MTP)
    assert speculated == plain  # tokens and log probs, ==
    assert drafts > 0 and sum(per_position) == accepted
    if name == "copy":  # the copied layer mostly guesses the target's own token, also chained
        assert accepted >= drafts // 2 and per_position[2] > 0, (drafts, accepted, per_position)


def test_acceptance_comes_from_the_mtp_layer(models):
    """Negative control: the same target with a random MTP layer in place of the copy is rarely right."""
    _, (drafts, accepted), _ = served(models["copy"], MTP)
    engine = engine_on(models["copy"], MTP)
    proposer = engine.speculator.proposer
    layer = proposer.mtp.layer
    with torch.no_grad():
        layer.eh_proj.weight.copy_(torch.randn(layer.eh_proj.weight.shape, generator=torch.Generator().manual_seed(0)))
    run(engine, PROMPTS)
    control_drafts, control_accepted = counts(engine)
    engine.shutdown()
    assert control_drafts > 0 and control_accepted / control_drafts < accepted / drafts / 2


def test_the_hook_keeps_no_hidden_states_without_mtp(models):
    engine = engine_on(models["random"], None)
    run(engine, PROMPTS[:1])
    assert not engine.model.model.capture_hidden and engine.model.model.captured_hidden is None
    engine.shutdown()


def test_a_refit_switches_the_mtp_layer_with_the_policy(models):
    """Served with the random MTP layer, refit with the copy checkpoint's tensors (policy and MTP layer) under
    load: the new requests' tokens are the copy target's, and acceptance is the copied layer's. A refit of the
    policy alone leaves the layer stale: no draft after it."""
    expected, (copy_drafts, copy_accepted), _ = served(models["copy"], MTP)
    random_dir = models["random"].replace("random", "random1")
    add_mtp_layer(make_tiny_model(random_dir, seed=1, num_layers=1), seed=2)
    engine = engine_on(random_dir, MTP)
    proposer = engine.speculator.proposer
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
    requests = [DynamicInferenceRequest(f"old{i}", None, p, params) for i, p in enumerate(PROMPTS)]
    run_steps(engine, requests, 3)
    copy_tensors = [(name, tensor[:]) for name, tensor in iterate_checkpoint(models["copy"])]
    assert engine.memory.refit(TensorSource.of(copy_tensors), epoch=7)["epoch"] == 7
    assert not proposer.stale and proposer.mtp_epoch == 7
    copied = dict(copy_tensors)["model.layers.1.eh_proj.weight"]
    assert torch.equal(proposer.mtp.layer.eh_proj.weight, copied)
    # an MTP tensor of another shape refuses the whole refit before any weight changes (the policy's included)
    misshapen = [(n, torch.zeros(3, 3) if n == "model.layers.1.eh_proj.weight" else t) for n, t in copy_tensors]
    with pytest.raises(ValueError, match=r"MTP layer tensors do not fit the MTP layer: .*eh_proj"):
        engine.memory.refit(TensorSource.of(misshapen), epoch=9)
    assert engine.epoch == 7 and not proposer.stale and torch.equal(proposer.mtp.layer.eh_proj.weight, copied)
    while engine.has_unfinished_requests():
        engine.step()
    before = counts(engine)
    assert run(engine, PROMPTS, "new") == expected
    drafts, accepted = (now - then for now, then in zip(counts(engine), before))
    assert drafts > 0 and accepted / drafts >= copy_accepted / copy_drafts * 0.9

    policy_only = [(name, tensor) for name, tensor in copy_tensors if not proposer.owns(name)]
    assert engine.memory.refit(TensorSource.of(policy_only), epoch=8)["epoch"] == 8
    assert proposer.stale
    before = counts(engine)
    assert run(engine, PROMPTS, "late") == expected
    assert counts(engine) == before
    engine.shutdown()


def test_a_checkpoint_without_mtp_layers_is_refused(models):
    with pytest.raises(MtpCheckpointError, match="num_nextn_predict_layers is missing or 0"):
        engine_on(models["plain"], MTP)


def test_missing_or_misshapen_mtp_tensors_are_named(models, tmp_path):
    def broken(name: str, edit) -> str:
        path = tmp_path / name
        shutil.copytree(models["random"], path)
        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)

    missing = broken("missing", lambda t: t.pop("model.layers.2.eh_proj.weight"))
    with pytest.raises(MtpCheckpointError, match=r"missing weights: .*model\.layers\.2\.eh_proj\.weight"):
        engine_on(missing, MTP)
    wrong = broken("wrong", lambda t: t.update({"model.layers.2.eh_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(MtpCheckpointError, match=r"model\.layers\.2\.eh_proj\.weight"):
        engine_on(wrong, MTP)


def _reference_first_guesses(model_dir: str, token_lists: list[list[int]]) -> list[int]:
    """The MTP layer's first guess after each of ``token_lists``, computed with ``transformers`` alone: the target's
    pre-norm last hidden states of every position, then the MTP layer (a one-layer Hugging Face Llama holding its
    decoder weights) over positions ``0 .. L-2`` fed ``eh_proj(cat(enorm(embed(tokens[i + 1])), hnorm(h_i)))``.
    Both models are built once for every guess."""
    import transformers  # noqa: PLC0415

    target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    config = target.config
    weights = load_file(f"{model_dir}/model.safetensors")
    prefix = f"model.layers.{config.num_hidden_layers}."
    layer_config = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    mtp = transformers.LlamaForCausalLM(layer_config).eval()
    mtp.model.layers[0].load_state_dict({name[len(prefix):]: t for name, t in weights.items() if name.startswith(prefix)
                                         and not name[len(prefix):].startswith(("enorm", "hnorm", "eh_proj",
                                                                                "shared_head", "embed_tokens"))})
    eps = config.rms_norm_eps

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weights[prefix + name]

    captured = {}
    target.model.layers[-1].register_forward_hook(lambda module, args, out: captured.update(h=out[0] if isinstance(
        out, tuple) else out))
    mtp.model.layers[0].register_forward_hook(lambda module, args, out: captured.update(m=out[0] if isinstance(
        out, tuple) else out))

    def first_guess(tokens: list[int]) -> int:
        captured.clear()
        with torch.no_grad():
            target(torch.tensor([tokens[:-1]]))
            embeds = target.model.embed_tokens(torch.tensor([tokens[1:]]))
            x = torch.cat([norm(embeds, "enorm.weight"), norm(captured["h"], "hnorm.weight")], -1) @ weights[
                prefix + "eh_proj.weight"].T
            mtp.model(inputs_embeds=x, position_ids=torch.arange(len(tokens) - 1)[None])
            logits = target.lm_head(norm(captured["m"][0, -1], "shared_head.norm.weight"))
        return int(logits.argmax())

    return [first_guess(tokens) for tokens in token_lists]


def test_first_guesses_equal_a_transformers_reference(models):
    """Every first guess of a long run (hidden states filed across verify steps, accepted rows recomputed from
    the target's hidden states, rejected ones rolled back) is the MTP layer's argmax computed by ``transformers``
    from the whole token sequence. The copied layer mixing in the hidden state: guesses often accepted, and
    depending on the hidden states."""
    engine = engine_on(models["mixed"], MTP)
    proposer = engine.speculator.proposer
    recorded = record_guesses(proposer)
    run(engine, PROMPTS)
    drafts, accepted = counts(engine)
    engine.shutdown()
    assert 0 < accepted < drafts
    checked = [(tokens, guess) for tokens, guess in recorded if len(tokens) > 2]
    assert len(checked) >= 20
    assert [guess[0] for _, guess in checked] == _reference_first_guesses(models["mixed"], [t for t, _ in checked])
