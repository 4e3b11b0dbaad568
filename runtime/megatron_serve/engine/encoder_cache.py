"""The engine side of images: check them at admission, encode them when a step reaches them, place them.

A request's images (:class:`~megatron_serve.multimodal.PromptImage`) are decoded and preprocessed by
the model's processor when the request is first scheduled, and encoded by the vision tower in the
step whose prefill chunk first reaches their placeholder tokens, together with every other image
that step needs (one tower call per step, whatever the number of requests). The embeddings stay
until the request's prefill has passed the image, so a chunked prefill that splits an image's
tokens over several steps encodes it once; a request recomputed after preemption decodes and
encodes again from the file it carries (nothing is kept for requests that are not running).

For multimodal-rotary models (Qwen-VL) the positions of the whole prompt are computed when its
images are first preprocessed (they need every image's grid) and kept while the request lives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.vision.mrope import MropePositions, mrope_positions
from ..multimodal import ImageError, ImageProcessor, PromptImage
from .sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepImages:
    """What a step's images add to its plan: embeddings for placeholder rows, and rotary positions."""

    rows: list[int]  # rows of the step's tokens that are image placeholders, in plan order
    embeddings: torch.Tensor | None  # [len(rows), hidden]
    positions: list[int] | None  # rotary position of every row (None: each token's index)
    mrope_positions: list[list[int]] | None  # [3][rows] when a chunk holds image tokens of an M-RoPE model


@dataclass
class _Image:
    image: PromptImage
    pixels: dict[str, torch.Tensor] | None = None  # the processor's tensors, until encoded
    embedding: torch.Tensor | None = None  # [length, hidden] on the engine's device, until passed

    @property
    def end(self) -> int:
        return self.image.offset + self.image.length


@dataclass
class _RequestImages:
    images: list[_Image]
    positions: MropePositions | None = None
    failed: str | None = None


@dataclass
class _Pending:
    """Images of this step that still need the tower."""

    owners: list[_Image] = field(default_factory=list)
    inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)


class EncoderCache:
    """Per-request image state of one engine, and the step's image inputs (see the module docstring)."""

    def __init__(self, model: Any, processor: ImageProcessor):
        vision = model.config.vision
        if processor.placeholder_id != vision.image_token_id:
            raise ValueError(f"the processor's image token {processor.placeholder!r} (id {processor.placeholder_id}) "
                             f"is not the model's image_token_id {vision.image_token_id}")
        self.model = model
        self.processor = processor
        self.image_token_id = vision.image_token_id
        self.mrope = vision.mrope_section is not None
        self.merge_size = vision.spatial_merge_size
        self._requests: dict[str, _RequestImages] = {}
        self.images_encoded = 0  # tower runs per image, for counters

    # ------------------------------------------------------------------ admission
    def admission_problem(self, tokens: list[int], images: list[PromptImage]) -> str | None:
        """Why a request's images (placed in its prompt ``tokens``) cannot run (None: they can). Reads image headers
        only."""
        end = 0
        for index, image in enumerate(images, 1):
            if not image.placed:
                return f"image {index} has no placeholder tokens in the prompt (expand the prompt's placeholders)"
            if image.offset < end or image.offset + image.length > len(tokens):
                return (f"image {index} claims prompt tokens {image.offset}..{image.offset + image.length - 1}, "
                        f"which overlap another image or lie outside the {len(tokens)}-token prompt")
            if any(t != self.image_token_id for t in tokens[image.offset:image.offset + image.length]):
                return f"image {index}: its prompt tokens are not all the image placeholder (id {self.image_token_id})"
            try:
                needed = self.processor.num_tokens(image.data)
            except ImageError as exc:
                return f"image {index}: {exc}"
            if needed != image.length:
                return f"image {index} needs {needed} placeholder tokens but the prompt gives it {image.length}"
            end = image.offset + image.length
        stray = tokens.count(self.image_token_id) - sum(image.length for image in images)
        if stray:
            return (f"the prompt holds {stray} image placeholder token(s) (id {self.image_token_id}) "
                    "that belong to no image")
        return None

    # ------------------------------------------------------------------ steps
    def release(self, request_id: str) -> None:
        """Forget a request's images (it finished, was aborted or handed back)."""
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        """Forget everything (suspend releases device memory; a refit changes the tower's weights)."""
        self._requests.clear()

    def prepare(self, entries: list[tuple[Sequence, int]]
                ) -> tuple[StepImages | None, list[tuple[Sequence, int]], list[tuple[Sequence, str]]]:
        """Encode what the step's chunks reach; returns ``(step images, entries to run, failed entries)``.

        A request whose image cannot be decoded fails alone (it leaves the step); the rest runs.
        """
        failed: list[tuple[Sequence, str]] = []
        kept: list[tuple[Sequence, int]] = []
        pending = _Pending()
        for sequence, count in entries:
            state = self._state(sequence)
            if state is not None and state.failed is None:
                self._collect(state, sequence.num_computed, sequence.num_computed + count, pending)
            if state is not None and state.failed is not None:
                failed.append((sequence, state.failed))
                self._requests.pop(sequence.request_id, None)
            else:
                kept.append((sequence, count))
        self._encode(pending)
        return self._step_images(kept), kept, failed

    def _state(self, sequence: Sequence) -> _RequestImages | None:
        if not sequence.images:
            return None
        state = self._requests.get(sequence.request_id)
        if state is None:
            state = _RequestImages([_Image(image) for image in sequence.images])
            self._requests[sequence.request_id] = state
            if self.mrope:
                self._place(state, sequence.num_prompt)
        for image in state.images:  # embeddings the prefill has passed are not needed again
            if image.end <= sequence.num_computed:
                image.embedding = image.pixels = None
        return state

    def _preprocess(self, state: _RequestImages, index: int) -> dict[str, torch.Tensor] | None:
        image = state.images[index]
        if image.pixels is None:
            try:
                image.pixels = self.processor.pixel_inputs(image.image.data)
            except ImageError as exc:
                state.failed = f"image {index + 1}: {exc}"
        return image.pixels

    def _place(self, state: _RequestImages, prompt_len: int) -> None:
        """Multimodal rotary positions of the whole prompt, from every image's grid."""
        grids = []
        for index in range(len(state.images)):
            pixels = self._preprocess(state, index)
            if pixels is None:
                return
            grids.append(tuple(int(x) for x in pixels["image_grid_thw"][0]))
        spans = [(image.image.offset, image.image.length) for image in state.images]
        try:
            state.positions = mrope_positions(prompt_len, spans, grids, self.merge_size)
        except ValueError as exc:
            state.failed = str(exc)

    def _collect(self, state: _RequestImages, start: int, end: int, pending: _Pending) -> None:
        for index, image in enumerate(state.images):
            if image.embedding is None and image.image.offset < end and image.end > start:
                pixels = self._preprocess(state, index)
                if pixels is None:
                    return
                pending.owners.append(image)
                pending.inputs.append(pixels)

    def _encode(self, pending: _Pending) -> None:
        """One tower call for every image of the step."""
        if not pending.owners:
            return
        batch = {name: torch.cat([inputs[name] for inputs in pending.inputs]) for name in pending.inputs[0]}
        embeddings = self.model.encode_images(batch)
        for owner, embedding in zip(pending.owners, embeddings):
            if embedding.shape[0] != owner.image.length:
                raise RuntimeError(f"the vision tower made {embedding.shape[0]} embeddings for an image with "
                                   f"{owner.image.length} placeholder tokens")
            owner.embedding, owner.pixels = embedding, None
        self.images_encoded += len(pending.owners)

    def _step_images(self, entries: list[tuple[Sequence, int]]) -> StepImages | None:
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        positions: list[int] = []
        axes: list[list[int]] = [[], [], []]
        shifted = three_way = False
        row = 0
        for sequence, count in entries:
            start, end = sequence.num_computed, sequence.num_computed + count
            state = self._requests.get(sequence.request_id)
            placement = state.positions if state is not None else None
            if placement is None:
                span = list(range(start, end))
                positions.extend(span)
                for axis in axes:
                    axis.extend(span)
            else:
                shifted = True
                chunk = placement.axes(start, end)
                positions.extend(placement.scalar(i) for i in range(start, end))
                three_way = three_way or chunk[0] != chunk[1] or chunk[0] != chunk[2]
                for axis, values in zip(axes, chunk):
                    axis.extend(values)
            for image in state.images if state is not None else []:
                first, last = max(image.image.offset, start), min(image.end, end)
                if first < last:
                    rows.extend(range(row + first - start, row + last - start))
                    pieces.append(image.embedding[first - image.image.offset:last - image.image.offset])
            row += count
        if not rows and not shifted:
            return None
        return StepImages(rows, torch.cat(pieces) if pieces else None, positions if shifted else None,
                          axes if three_way else None)
