"""Issue 39, method ``eagle3``: an EAGLE-3 head (Llama-3 layout: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``d2t``) guesses from the target's fused hidden states; the output is the target's, token for token and log
prob for log prob.

The head is written by hand here (:func:`write_eagle3`): random weights, its draft vocabulary the target's even
ids (``d2t[i] = i``: draft ``i`` is target ``2 i``) with the target's LM head rows for them. Its guesses are
checked against a plain torch reference; the target rarely agrees with them. The equality of the output with and
without speculation is checked with a head that always guesses the token the target generates most
(``guess``), so that drafts are both accepted and rejected in the same run.
"""

from __future__ import annotations

import collections
import functools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve.model.eagle3 import Eagle3CheckpointError
from megatron_serve.model.loader import iterate_checkpoint
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.weights.sources import TensorSource

from .speculative_heads import counts, engine_on, greedy_runs, record_guesses

RNG = random.Random(393)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(RNG.randint(1, 40))] for _ in range(6)]
COUNT = 16


def write_eagle3(path: Path, target_dir: str, seed: int = 0, guess: int | None = None) -> str:
    """An EAGLE-3 directory for the target at ``target_dir`` (random weights of scale 0.05, norms 1). With ``guess``
    its LM head is zeros and ``d2t`` maps draft 0 (the argmax of equal logits) to target ``guess``: it guesses
    ``guess`` at every depth."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(target_dir, "config.json").read_text())
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, draft_vocab = hidden // heads, vocab // 2
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * 0.05

    target = load_file(f"{target_dir}/model.safetensors")
    tensors = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": target["model.norm.weight"].clone(),
               "lm_head.weight": target["lm_head.weight"][0::2][:draft_vocab].clone(),
               "d2t": torch.arange(draft_vocab), "t2d": torch.arange(vocab) % 2 == 0,
               "midlayer.input_layernorm.weight": torch.ones(hidden), "midlayer.hidden_norm.weight": torch.ones(hidden),
               "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
               "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
               "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
               "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
               "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
               "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
               "midlayer.mlp.down_proj.weight": rand(hidden, inter)}
    if guess is not None:
        tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
        tensors["d2t"][0] = guess  # target = draft + d2t[draft]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": config.get("rms_norm_eps", 1e-6)}))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = str(make_tiny_model(root / "target", seed=5, num_layers=4))
    return {"target": target, "head": write_eagle3(root / "head", target)}


def eagle3(head: str) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}


run = functools.partial(greedy_runs, count=COUNT)


def test_greedy_tokens_and_log_probs_equal_no_speculation(models, tmp_path):
    engine = engine_on(models["target"], None)
    plain = run(engine, PROMPTS)
    engine.shutdown()
    # a head that guesses the target's most frequent token: some drafts are accepted, some rejected
    most = collections.Counter(token for tokens, _ in plain for token in tokens).most_common(1)[0][0]
    engine = engine_on(models["target"], eagle3(write_eagle3(tmp_path / "head", models["target"], guess=most)))
    speculated = run(engine, PROMPTS)
    drafts, accepted = counts(engine)
    per_position = list(engine.stats.accepted_per_pos)
    assert engine.model.model.aux_layers == (2, 2, 1)  # (2, L // 2, L - 3) of a 4-layer target
    engine.shutdown()
    assert 0 < accepted < drafts, (accepted, drafts)  # acceptance and rejection both ran
    assert sum(per_position) == accepted
    assert speculated == plain  # tokens and log probs, ==


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def _reference_first_guesses(models: dict, token_lists: list[list[int]]) -> list[int]:
    """The head's first guess after each of ``token_lists`` in plain torch: ``transformers``' target hidden states
    (inputs of layers 2, 2, 1), ``fc``, then the midlayer over positions ``0 .. L-2`` with causal attention. The
    target and the head load once for every guess."""
    import transformers  # noqa: PLC0415

    target = transformers.AutoModelForCausalLM.from_pretrained(models["target"], torch_dtype=torch.float32).eval()
    config = target.config
    w = load_file(f"{models['head']}/model.safetensors")
    eps, heads, kv_heads = config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name]

    def first_guess(tokens: list[int]) -> int:
        with torch.no_grad():
            states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
            h = torch.cat([states[2][0], states[2][0], states[1][0]], -1) @ w["fc.weight"].T
            embeds = target.model.embed_tokens(torch.tensor(tokens[1:]))
            x = torch.cat([norm(embeds, "midlayer.input_layernorm.weight"), norm(h, "midlayer.hidden_norm.weight")],
                          -1)
            positions = torch.arange(len(tokens) - 1)
            q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, head_dim), positions, theta)
            k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, kv_heads, head_dim), positions, theta)
            v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, kv_heads, head_dim)
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            attended = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
            residual = h + attended.flatten(1) @ w["midlayer.self_attn.o_proj.weight"].T
            y = norm(residual, "midlayer.post_attention_layernorm.weight")
            y = (torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (
                y @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
            logits = norm(residual + y, "norm.weight")[-1] @ w["lm_head.weight"].T
        draft = int(logits.argmax())
        return draft + int(w["d2t"][draft])

    return [first_guess(tokens) for tokens in token_lists]


def test_first_guesses_equal_a_plain_torch_reference(models):
    """Every first guess of a run (hidden states filed across verify steps, accepted rows recomputed, rejected
    ones rolled back) is the head's argmax computed in plain torch from the whole sequence, mapped by d2t."""
    engine = engine_on(models["target"], eagle3(models["head"]))
    proposer = engine.speculator.proposer
    recorded = record_guesses(proposer)
    run(engine, PROMPTS)
    engine.shutdown()
    checked = [(tokens, guess) for tokens, guess in recorded if len(tokens) > 2]
    assert len(checked) >= 20 and all(guess[0] % 2 == 0 for _, guess in checked)  # target ids of draft ids
    assert [guess[0] for _, guess in checked] == _reference_first_guesses(models, [t for t, _ in checked])


def test_a_policy_refit_switches_eagle3_off(models):
    """A refit of the policy alone (no head tensors) leaves the head stale: it proposes nothing, the output stays
    the target's."""
    engine = engine_on(models["target"], eagle3(models["head"]))
    expected = run(engine, PROMPTS[:3], "a")
    tensors = [(name, tensor[:]) for name, tensor in iterate_checkpoint(models["target"])]
    assert engine.memory.refit(TensorSource.of(tensors), epoch=3)["epoch"] == 3
    assert engine.speculator.proposer.stale
    before = counts(engine)
    assert run(engine, PROMPTS[:3], "b") == expected
    assert counts(engine) == before
    engine.shutdown()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("fc.weight"), "lacks fc.weight"),
    (lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}),
     r"midlayer\.self_attn\.q_proj\.weight has shape \(64, 64\), expected \(64, 128\)"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(100, 64)}), r"lm_head\.weight has shape \(100, 64\)"),
    (lambda t: t.update({"d2t": torch.full((t["d2t"].shape[0],), 10_000)}), "d2t maps draft ids outside"),
])
def test_bad_heads_are_refused_naming_the_tensor(models, tmp_path, edit, message):
    path = tmp_path / "bad"
    shutil.copytree(models["head"], path)
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(Eagle3CheckpointError, match=message):
        engine_on(models["target"], eagle3(str(path)))


def test_a_target_of_another_vocabulary_is_refused(models, tmp_path):
    path = tmp_path / "vocab"
    shutil.copytree(models["head"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(Eagle3CheckpointError, match="vocab_size"):
        engine_on(models["target"], eagle3(str(path)))


def test_a_head_refit_with_the_policy_keeps_proposing(models):
    """The head's tensors (``drafter.`` + its checkpoint names) in the policy's refit: loaded in place under the
    same epoch, it keeps proposing, and its drafts are accepted. The new policy and head are made to agree: both
    final norms zero, so the policy's logits are all 0 (greedy: token 0) and so are the head's (draft 0, target
    id 0). The control: the random head before the refit has every draft rejected."""
    engine = engine_on(models["target"], eagle3(models["head"]))
    run(engine, PROMPTS[:3], "a")
    drafts, accepted = counts(engine)
    assert drafts > 0 and accepted == 0  # control: the random head is never right
    policy = [(n, torch.zeros_like(t[:]) if n == "model.norm.weight" else t[:])
              for n, t in iterate_checkpoint(models["target"])]
    head = [(n, torch.zeros_like(t[:]) if n == "norm.weight" else t[:]) for n, t in iterate_checkpoint(models["head"])
            if n not in ("d2t", "t2d")]  # the vocabulary maps: integers, not trained, kept by the head
    refitted = engine.memory.refit(TensorSource.of([*policy, *(("drafter." + n, t) for n, t in head)]), epoch=3)
    assert refitted["epoch"] == 3
    proposer = engine.speculator.proposer
    assert not proposer.stale and not proposer.head.weights["norm.weight"].any()
    outputs = run(engine, PROMPTS[:3], "b")
    assert all(set(tokens) == {0} for tokens, _ in outputs)  # the new policy's
    now = counts(engine)
    assert now[0] > drafts and now[1] - accepted == now[0] - drafts  # proposing, and every draft accepted

    wrong = [*policy, ("drafter.fc.weight", torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=r"EAGLE-3 tensor fc.weight has shape \(3, 3\)"):
        engine.memory.refit(TensorSource.of(wrong), epoch=4)
    assert engine.epoch == 3 and not proposer.stale  # refused before anything changed
    engine.shutdown()


def test_a_head_that_fails_to_load_after_the_commit_leaves_the_policy_whole_and_says_so(models, monkeypatch):
    """Every head tensor is verified before any weight changes (the misshapen one above is refused); a failure of
    the copy itself afterwards (a fault: injected here) cannot be undone for the policy either. The policy's refit
    stands, the head stays stale (it proposes nothing), and the refit's answer says why."""
    engine = engine_on(models["target"], eagle3(models["head"]))
    expected = run(engine, PROMPTS[:3], "a")
    policy = [(n, t[:]) for n, t in iterate_checkpoint(models["target"])]
    head = [("drafter." + n, t[:]) for n, t in iterate_checkpoint(models["head"]) if n not in ("d2t", "t2d")]
    proposer = engine.speculator.proposer

    def fault(named, partial):
        raise RuntimeError("device fault")

    monkeypatch.setattr(proposer.head, "load", fault)
    refitted = engine.memory.refit(TensorSource.of([*policy, *head]), epoch=5)
    assert refitted["epoch"] == 5 and engine.epoch == 5 and proposer.stale
    assert "the drafter stays stale" in refitted["drafter_error"] and "device fault" in refitted["drafter_error"]
    before = counts(engine)
    assert run(engine, PROMPTS[:3], "b") == expected and counts(engine) == before  # the policy's tokens, no draft
    engine.shutdown()
