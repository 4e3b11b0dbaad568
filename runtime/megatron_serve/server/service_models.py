"""Pydantic models of what the server says about itself: ``GET /v1/models`` (OpenAI's list, with vLLM's fields for
LoRA adapters) and the probes ``/health`` and ``/ready`` (main port and probe port alike). No request body comes
through them, so they stand apart from the strict request models of :mod:`.models`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "megatron-serve"
    max_model_len: int | None = None
    root: str | None = Field(None, description="a LoRA adapter's directory (vLLM's field); the model's name otherwise")
    parent: str | None = Field(None, description="a LoRA adapter's base model (vLLM's field); null for the base")
    input_modalities: list[Literal["text", "image"]] = Field(
        default_factory=lambda: ["text"], description="extension: what prompts may hold; 'image' for "
                                                      "vision-language models (image_url content parts)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    missing: list[str] | None = Field(None, description=(
        "only while something keeps requests from being served now, by part: coordinator, fleet (not RUNNING), "
        "engines (none can take a request), server (this one drains); /health stays 200 for them (this process is "
        "alive). Absent when nothing is missing: a healthy server answers {\"status\": \"ok\"}"))


class ReadyResponse(BaseModel):
    """Readiness of the fleet behind this server (200 ready, 503 not)."""

    ready: bool
    state: str | None = Field(None, description="lifecycle state: RUNNING, PAUSED, SUSPENDED or STOPPED")
    coordinator_reachable: bool
    busy: bool = Field(False, description="the last status poll timed out while the coordinator kept streaming: "
                                         "the last status stands (the fleet is loaded, not lost)")
    engines: int = 0
    held: bool = Field(False, description="no engine is registered, and requests are held until one is (scale from "
                                          "zero, --scale-from-zero-timeout above 0; the answer is then 200)")
    detail: str | None = None
    missing: list[str] = Field(default_factory=list, description=(
        "the parts missing, by name (on a 503, those that make it so): coordinator (unreachable), fleet (not RUNNING), engines (none can take "
        "a request), server (this server drains, or on the probe port its process does not answer)"))
