"""Multimodal rotary positions (M-RoPE) of Qwen2-VL and Qwen2.5-VL.

Every token has three positions (temporal, height, width). Text tokens have the same value in all
three, counting on from the previous item; an image's tokens form a grid: temporal = the image's
start, height = start + row, width = start + column, and the text after it starts at
``start + max(rows, columns)``. The rotary frequencies of ``head_dim // 2`` are split into
``mrope_section`` bands that rotate by the temporal, height and width position respectively.

Because an image's tokens need fewer positions than they occupy, a sequence's positions fall
behind its token indices: generated tokens sit at ``index + delta`` (``delta <= 0``). Where the
three positions agree (all text, every decode step) M-RoPE *is* plain rotary at that position,
so only prefill chunks that hold image tokens need the three-way tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MropePositions:
    """Positions of one prompt (``[3][prompt tokens]``) and the shift of every token after it."""

    prompt: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    delta: int

    @property
    def multimodal(self) -> bool:
        """Whether any prompt token has positions that differ between the three axes."""
        return self.prompt[0] != self.prompt[1] or self.prompt[0] != self.prompt[2]

    def scalar(self, index: int) -> int:
        """The position of token ``index`` where the three axes agree (text and generated tokens)."""
        if index < len(self.prompt[0]):
            return self.prompt[0][index]
        return index + self.delta

    def axes(self, start: int, end: int) -> list[list[int]]:
        """``[3][end - start]`` positions of tokens ``start .. end - 1``."""
        prompt_len = len(self.prompt[0])
        return [list(axis[start:min(end, prompt_len)]) + [i + self.delta for i in range(max(start, prompt_len), end)]
                for axis in self.prompt]


def mrope_positions(prompt_len: int, spans: list[tuple[int, int]], grids: list[tuple[int, int, int]],
                    merge_size: int) -> MropePositions:
    """Positions of a prompt whose image ``i`` fills tokens ``spans[i] = (offset, length)`` with grid ``grids[i]``.

    ``grids`` are the vision encoder's patch grids ``(t, h, w)``; the language model sees them merged
    by ``merge_size`` in height and width (as ``image_grid_thw`` of the processor).
    """
    axes: list[list[int]] = [[], [], []]
    cursor = 0  # next token index
    position = 0  # next text position
    for (offset, length), (grid_t, grid_h, grid_w) in sorted(zip(spans, grids)):
        for axis in axes:
            axis.extend(range(position, position + offset - cursor))
        position += offset - cursor
        rows, columns = grid_h // merge_size, grid_w // merge_size
        if grid_t * rows * columns != length:
            raise ValueError(f"image at token {offset} has {length} placeholder tokens but its grid "
                             f"{grid_t}x{grid_h}x{grid_w} (merge {merge_size}) needs {grid_t * rows * columns}")
        for t in range(grid_t):
            for r in range(rows):
                axes[0].extend([position + t] * columns)
                axes[1].extend([position + r] * columns)
                axes[2].extend(range(position, position + columns))
        position += max(rows, columns)
        cursor = offset + length
    for axis in axes:
        axis.extend(range(position, position + prompt_len - cursor))
    position += prompt_len - cursor
    return MropePositions((tuple(axes[0]), tuple(axes[1]), tuple(axes[2])), position - prompt_len)


def mrope_cos_sin(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, section: tuple[int, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``[T, head_dim // 2]`` tables from the plain ``cos``/``sin`` tables and ``[3, T]`` positions.

    Frequency band ``i`` (``section[i]`` wide, cycling over the three axes) rotates by axis ``i % 3``.
    """
    pieces_cos, pieces_sin, start = [], [], 0
    for band, width in enumerate(section):
        axis = positions[band % 3]
        pieces_cos.append(cos[axis, start:start + width])
        pieces_sin.append(sin[axis, start:start + width])
        start += width
    return torch.cat(pieces_cos, dim=-1), torch.cat(pieces_sin, dim=-1)
