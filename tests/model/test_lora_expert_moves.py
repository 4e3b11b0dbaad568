"""Expert LoRA rows follow EPLB's moves (:mod:`megatron_serve.model.lora.slots`), in one process: a rank's stack
rearranged as a move installs it (experts from the other rank, one expert twice, one gone) gives each (row, logical
expert) pair the bits it had before, whichever replica runs it, for an adapter written before the move and for one
written after it; each slot row holds the adapter's rows of the logical expert there. The control: rows left where
they were written (the placement not followed) give other outputs."""

from __future__ import annotations

import pytest
import torch

from megatron_serve.model.loader import load_model
from megatron_serve.model.lora.checkpoint import read_adapter
from megatron_serve.model.lora.experts import EXPERT_PROJECTIONS
from megatron_serve.model.lora.slots import LoraSlots, _ExpertSlotWeights
from megatron_serve.model.experts.moves import install_rows, pack_rows
from megatron_serve.model.parallel import TensorParallel
from megatron_serve.model.tiny import make_tiny_model

from ..lora_adapters import make_peft_adapter
from .test_moe import VARIANTS

#: rank 0's stack after the move: logical experts 9 and 14 come from rank 1, 0 sits twice, 3, 4 and 6 leave
MOVED = [9, 0, 0, 5, 1, 7, 2, 14]
#: the logical experts of the rows (each row one expert, as the dispatcher hands rows to a rank's experts)
LOGICAL = [0, 5, 1, 7, 2, 0]


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("lora-moves")
    base = make_tiny_model(root / "base", seed=1, **VARIANTS["qwen3_moe"])
    adapter = make_peft_adapter(base, root / "adapter", rank=4, seed=24, targets=[],
                                parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], b_scale=2.0)
    return str(base), str(adapter)


def _outputs(experts, local: list[int]) -> torch.Tensor:
    """The experts' rows for ``LOGICAL``'s pairs run on stack slots ``local``: rows 0 and 2-5 on LoRA slot 1,
    row 1 on LoRA slot 0 (a different adapter, or none)."""
    x = torch.randn(len(local), experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(0))
    ids = torch.tensor(local)[:, None]
    return experts(x, torch.ones(ids.shape), ids, torch.arange(len(local)))


def test_expert_rows_follow_a_move_and_every_replica_holds_them(model_and_adapter):
    base, adapter_dir = model_and_adapter
    models = [load_model(base, torch.float32, "cpu", TensorParallel(rank, 2, expert_parallel=True))
              for rank in range(2)]
    model = models[0]
    model.use_batch_invariant_ops()
    adapter = read_adapter("experts", adapter_dir, model.config, 8)
    slots = LoraSlots(model, 2, 8, batch_invariant=True)
    slots.write(1, adapter)
    indices = torch.tensor([1, 0, 1, 1, 1, 1])
    slots.rows.set(indices, indices.numpy())
    experts = model.model.layers[0].mlp.experts
    before = _outputs(experts, LOGICAL)  # rank 0 holds logical experts 0..7 at slots 0..7

    donors = [(models[e // 8].model.layers[0].mlp.experts, e % 8) for e in MOVED]
    install_rows(experts, MOVED, torch.cat([pack_rows(donor, [slot]) for donor, slot in donors]))
    target = next(t for _, t in slots._targets if isinstance(t, _ExpertSlotWeights) and t.experts is experts)
    written_for = target.placed[1]
    target.placed[1] = list(experts.slots)  # the control: the rows stay where they were written
    stale = _outputs(experts, [MOVED.index(e) for e in LOGICAL])
    target.placed[1] = written_for

    first = _outputs(experts, [MOVED.index(e) for e in LOGICAL])
    second = _outputs(experts, [len(MOVED) - 1 - MOVED[::-1].index(e) for e in LOGICAL])  # 0's other replica
    assert torch.equal(first, before) and torch.equal(second, before)
    assert not torch.allclose(stale[[0, 2, 3, 4, 5]], before[[0, 2, 3, 4, 5]], atol=1e-3)
    for projection in EXPERT_PROJECTIONS:
        a, b = adapter.weights[(0, projection)]
        assert torch.equal(target.a[projection][1, :, :4], a[MOVED])
        assert torch.equal(target.b[projection][1, :, :, :4], b[MOVED])

    slots.write(0, adapter)  # written after the move: cut for the experts where they sit
    indices = torch.tensor([0, 0, 0, 0, 0, 0])
    slots.rows.set(indices, indices.numpy())
    assert torch.equal(_outputs(experts, [MOVED.index(e) for e in LOGICAL])[[0, 2, 3, 4, 5]],
                       before[[0, 2, 3, 4, 5]])
