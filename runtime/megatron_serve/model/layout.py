"""How a model's layers and query heads split over pipeline stages and tensor-parallel ranks: arithmetic alone,
without torch, so that ``run`` refuses a layout before any rank starts (its server process imports no torch)."""

from __future__ import annotations


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Each stage's layers, contiguous; an uneven split gives the first ``num_layers % stages`` stages one more."""
    if stages > num_layers:
        raise ValueError(f"{num_layers} layers do not split into {stages} pipeline stages (one layer at least each)")
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def heads_problem(num_heads: int, tensor_parallel: int) -> str | None:
    """Why ``num_heads`` query heads cannot split over ``tensor_parallel`` ranks, or None: replicated query heads
    would not match ``o_proj``'s split of their features."""
    if num_heads % tensor_parallel:
        return (f"num_attention_heads={num_heads} does not split over {tensor_parallel} tensor-parallel ranks: each "
                "rank needs whole query heads")
    return None


def check_layout(num_layers: int, num_heads: int, tensor_parallel: int, pipeline_parallel: int) -> None:
    """``ValueError`` when the model cannot be laid out over the ranks: what ``run`` asks before any rank starts, so
    the refusal is one line instead of a rank's traceback."""
    stage_layers(num_layers, pipeline_parallel)
    problem = heads_problem(num_heads, tensor_parallel)
    if problem is not None:
        raise ValueError(problem)
