"""Operator configuration, read from the environment (the chart and kustomize base set it)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_serve.wire.security import read_secret_file

from . import __version__

DEFAULT_IMAGE = f"ghcr.io/megatron-serve/megatron-serve:{__version__}"
DEFAULT_ADDRESS_TEMPLATE = "tcp://{name}-coordinator.{namespace}.svc:5555"

ENV_DEFAULT_IMAGE = "MEGATRON_OPERATOR_DEFAULT_IMAGE"
ENV_TOKEN_KEY = "MEGATRON_OPERATOR_TOKEN_KEY"
ENV_TOKEN_KEY_FILE = "MEGATRON_OPERATOR_TOKEN_KEY_FILE"
ENV_ADDRESS = "MEGATRON_OPERATOR_COORDINATOR_ADDRESS"
ENV_INTERVAL = "MEGATRON_OPERATOR_RECONCILE_INTERVAL"
ENV_CONNECT_TIMEOUT = "MEGATRON_OPERATOR_CONNECT_TIMEOUT"
ENV_COMMAND_TIMEOUT = "MEGATRON_OPERATOR_COMMAND_TIMEOUT"
ENV_POD_LABELS = "MEGATRON_OPERATOR_POD_LABELS"
ENV_SCANNING = "MEGATRON_OPERATOR_SCANNING"
ENV_LEADER_WORKER_SET = "MEGATRON_OPERATOR_LEADER_WORKER_SET"
ENV_PEERING_LIFETIME = "MEGATRON_OPERATOR_PEERING_LIFETIME"
ENV_PEERING_PRIORITY = "MEGATRON_OPERATOR_PEERING_PRIORITY"
#: Above every ``oldest-first`` priority (microseconds since 1970 stay below it for 285 years), and an integer that
#: JSON readers of the peering object keep exactly.
PRIORITY_CEILING = 2**53


def peering_priority(env: Mapping[str, str]) -> int | None:
    """kopf's peering priority from ``$MEGATRON_OPERATOR_PEERING_PRIORITY``: an integer, or ``oldest-first``, which
    ranks this process by its start (the earlier, the higher). kopf pauses every peer of equal priority, so the
    replicas of one Deployment, which share their arguments, need priorities of their own; ranking by start keeps
    the acting replica acting when a standby restarts or a rollout adds a newer one. ``None`` when unset (kopf's
    ``--priority``, default 0)."""
    raw = (env.get(ENV_PEERING_PRIORITY) or "").strip()
    if not raw:
        return None
    if raw == "oldest-first":
        return PRIORITY_CEILING - time.time_ns() // 1000
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_PEERING_PRIORITY}: expected an integer or oldest-first, got {raw!r}") from None


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{ENV_POD_LABELS}: expected key=value[,key=value], got {text!r}")
        out[key.strip()] = value.strip()
    return out


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: must be positive, got {raw!r}")
    return value


def token_key_from_env(env: Mapping[str, str]) -> bytes | None:
    """The operator's token key from ``$MEGATRON_OPERATOR_TOKEN_KEY`` or the file named by
    ``$MEGATRON_OPERATOR_TOKEN_KEY_FILE``; ``None`` when neither is set."""
    if env.get(ENV_TOKEN_KEY):
        return env[ENV_TOKEN_KEY].encode()
    if env.get(ENV_TOKEN_KEY_FILE):
        return read_secret_file(env[ENV_TOKEN_KEY_FILE], ENV_TOKEN_KEY_FILE)
    return None


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str = DEFAULT_IMAGE
    # Never a well-known value: a token derived from public information is no secret. Without a
    # configured key each process draws its own (the operator keeps the token of an existing Secret).
    token_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    coordinator_address_template: str = DEFAULT_ADDRESS_TEMPLATE
    reconcile_interval: float = 15.0
    connect_timeout: float = 5.0
    command_timeout: float = 120.0
    operator_pod_labels: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "megatron-operator"})
    scanning: bool = True
    # gangs as LeaderWorkerSets where the API server serves them (auto); False: always StatefulSets (never)
    leader_worker_set: bool = True
    # kopf peering (an operator run without --standalone): how long a peer's last keep-alive counts, so how soon a
    # paused replica takes over from one that died without saying goodbye (kopf's default, 60 s)
    peering_lifetime: float = 60.0
    peering_priority: int | None = None  # see peering_priority()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorConfig":
        env = os.environ if env is None else env
        # The operator keeps the token of an existing Secret, so a per-process random key only
        # affects resources created while it runs.
        key = token_key_from_env(env) or secrets.token_bytes(32)
        template = env.get(ENV_ADDRESS) or DEFAULT_ADDRESS_TEMPLATE
        try:
            template.format(name="n", namespace="ns")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{ENV_ADDRESS}: bad template {template!r} (use {{name}} and {{namespace}}): {exc}") from None
        labels = _labels(env[ENV_POD_LABELS]) if env.get(ENV_POD_LABELS) else None
        lws_mode = (env.get(ENV_LEADER_WORKER_SET) or "auto").strip().lower()
        if lws_mode not in ("auto", "never"):
            raise ValueError(f"{ENV_LEADER_WORKER_SET}: expected auto or never, got {lws_mode!r}")
        kwargs = {} if labels is None else {"operator_pod_labels": labels}
        return cls(
            default_image=env.get(ENV_DEFAULT_IMAGE) or DEFAULT_IMAGE,
            token_key=key,
            coordinator_address_template=template,
            reconcile_interval=_float(env, ENV_INTERVAL, 15.0),
            connect_timeout=_float(env, ENV_CONNECT_TIMEOUT, 5.0),
            command_timeout=_float(env, ENV_COMMAND_TIMEOUT, 120.0),
            scanning=(env.get(ENV_SCANNING, "true").strip().lower() not in ("0", "false", "no", "off")),
            leader_worker_set=lws_mode == "auto",
            peering_lifetime=_float(env, ENV_PEERING_LIFETIME, 60.0),
            peering_priority=peering_priority(env),
            **kwargs,
        )

    def coordinator_address(self, name: str, namespace: str) -> str:
        """Where the operator reaches a resource's coordinator."""
        return self.coordinator_address_template.format(name=name, namespace=namespace)
