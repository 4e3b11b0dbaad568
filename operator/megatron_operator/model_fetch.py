"""The ``fetch-model`` init container of a resource whose ``spec.model.hub`` names a Hugging Face Hub id.

The runtime image runs ``megatron-serve download HUB_ID --local-dir PATH`` into the model volume,
which is writable in this container only (the serving containers mount it read-only). The image is
offline otherwise (``HF_HUB_OFFLINE``), so this container turns it back on; ``HF_TOKEN`` comes from
``spec.model.hubTokenSecretRef`` when given (gated and private models).
"""

from __future__ import annotations

from typing import Any

from .spec import InferenceSpec


def fetch_container(spec: InferenceSpec, hub: str, *, image: dict[str, Any], resources: dict[str, Any],
                    security_context: dict[str, Any], weights: bool = True) -> dict[str, Any]:
    """The init container that fetches ``hub`` (``spec.model.hub``) to ``spec``'s model path; ``image``: the
    pod's image fields.

    Without ``weights`` (the coordinator pod reads only config and tokenizer) it skips the safetensors.
    """
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/.cache/huggingface"},
        {"name": "HF_HUB_OFFLINE", "value": "0"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if spec.hub_token_secret_ref:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": spec.hub_token_secret_ref["name"], "key": spec.hub_token_secret_ref["key"]}}})
    return {
        "name": "fetch-model",
        **image,
        "args": ["download", hub, "--local-dir", spec.model_path, *([] if weights else ["--skip-weights"])],
        "env": env,
        "resources": resources,
        "securityContext": security_context,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "model", "mountPath": spec.model_mount_path}],
    }
