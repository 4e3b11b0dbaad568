"""The schema of speculative decoding (``spec.engine.speculative``) and its cross-field rules.

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse).

The fields are vLLM's ``--speculative-config`` keys in the resource's camelCase (:mod:`.engine_args` writes the
JSON). The engine refuses a config whose fields disagree (``megatron_serve.config.SpeculativeConfig``): a
lookup window whose shortest suffix is longer than its longest, a draft method without the draft's directory, or
``mtp`` with one. Left to the engine, such a resource is accepted by ``kubectl apply`` and its engine pods crash at
start; as CEL rules the API server refuses it, naming the field, before any pod is made.
"""

from __future__ import annotations

from typing import Any

from .crd_fields import int_field, obj_field, str_field
from .crd_rules import CelCheck

METHODS = ["ngram", "draft_model", "mtp", "eagle3"]
#: The methods that run a second network from ``model`` (the engine needs its directory).
DRAFT_METHODS = ("draft_model", "eagle3")


def speculative_schema() -> dict[str, Any]:
    """``spec.engine.speculative`` (its CEL rules are added by :mod:`.crd` from :data:`CEL_RULES`)."""
    return obj_field(
        "Speculative decoding (--speculative-config; docs/speculative.md): a proposer guesses the next "
        "tokens and the engine verifies them in one forward; the output is the same as without it. Absent: "
        "off. Changing it rolls the engine pods.",
        {
            "method": str_field("ngram: prompt lookup in the request's own tokens; draft_model: a smaller "
                                "model of the same vocabulary at `model`; mtp: the checkpoint's own "
                                "multi-token-prediction layer (num_nextn_predict_layers); eagle3: an "
                                "EAGLE-3 head at `model`.",
                                enum=list(METHODS)),
            "numSpeculativeTokens": int_field("Tokens guessed per request and step (the most, with "
                                              "adaptive).", minimum=1, maximum=16, default=3),
            "promptLookupMin": int_field("ngram: shortest suffix looked up.", minimum=1, maximum=64, default=1),
            "promptLookupMax": int_field("ngram: longest suffix looked up.", minimum=1, maximum=64, default=3),
            "model": str_field("draft_model, eagle3: the draft model's or EAGLE-3 head's directory in the "
                               "engine pods (required for them).",
                               minLength=1),
            "adaptive": {"type": "boolean",  # no default: absent keeps pod templates as they were
                         "description": "Default true: each engine picks K (0 up to numSpeculativeTokens) "
                                        "per request and step from its measured acceptance and step cost, "
                                        "0 where drafts do not pay; false: always numSpeculativeTokens."},
        },
        required=["method"],
    )


def _lookup_window_rule(speculative: dict[str, Any]) -> bool:
    return int(speculative.get("promptLookupMin", 1)) <= int(speculative.get("promptLookupMax", 3))


def _draft_needs_model_rule(speculative: dict[str, Any]) -> bool:
    return speculative.get("method") not in DRAFT_METHODS or "model" in speculative


def _mtp_without_model_rule(speculative: dict[str, Any]) -> bool:
    return speculative.get("method") != "mtp" or "model" not in speculative


# (schema path, CEL rule, message, python twin); see crd.CEL_RULES
CEL_RULES: list[tuple[str, str, str, CelCheck]] = [
    (
        "spec.engine.speculative",
        "self.promptLookupMin <= self.promptLookupMax",
        "engine.speculative.promptLookupMin must not exceed engine.speculative.promptLookupMax (the shortest suffix "
        "looked up is at most the longest)",
        _lookup_window_rule,
    ),
    (
        "spec.engine.speculative",
        "!(self.method in ['draft_model', 'eagle3']) || has(self.model)",
        "engine.speculative.model is required for method draft_model and eagle3 (the draft's directory in the "
        "engine pods)",
        _draft_needs_model_rule,
    ),
    (
        "spec.engine.speculative",
        "self.method != 'mtp' || !has(self.model)",
        "engine.speculative.model must be unset for method mtp (it reads the checkpoint's own "
        "multi-token-prediction layers)",
        _mtp_without_model_rule,
    ),
]
