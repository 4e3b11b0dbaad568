"""Tenants: whose a request is, from the key it presents or the fairness id a gateway sets, with its class, weight
and limits (docs/tenants.md).

The key file (``--api-key-file``, ``--api-key`` or ``$MEGATRON_SERVE_API_KEY``) holds one key, as before, or a
document (YAML or JSON) of several keys and their tenants::

    tenants:                  # a tenant's class, weight and limits, shared by all its keys
      team-a: {class: critical, weight: 3, tokens_per_minute: 200000, requests_per_minute: 600, max_concurrent: 64}
      batch: {class: sheddable}
      default: {class: standard}      # the anonymous tenant, and the settings of tenants with no entry
    keys:
      - {key_env: TEAM_A_KEY, tenant: team-a}      # key (inline), key_file (a path) or key_env (a variable)
      - {key_file: /secrets/batch/key, tenant: batch}
      - {key: sk-gateway}                            # no tenant: the fairness id names it, else `default`
      - {key: sk-b, tenant: team-b, class: standard, weight: 1}   # a tenant's settings on its key

A request's tenant is its key's. A key without a tenant (and an open server, ``keys: []``) takes the tenant from
the fairness header (``--tenant-header``, the Gateway API Inference Extension's
``x-gateway-inference-fairness-id`` by default), else the anonymous tenant ``default``. A header never moves a
request away from its key's tenant: a tenant's key cannot borrow another tenant's share or budget. A tenant named
by a header with no entry of its own has ``default``'s settings, and budgets of its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..http_options import TenancyOptions
from ..wire.tenancy import BANDS, CLASSES, DEFAULT_CLASS, MAX_TENANT_NAME, TenantTag

#: The anonymous tenant, whose entry also gives the settings of tenants that have none.
DEFAULT_TENANT = "default"
#: The Gateway API Inference Extension's fairness header (its flow control's tenant).
_LIMITS = ("tokens_per_minute", "requests_per_minute", "max_concurrent")
_SETTINGS = ("class", "weight", *_LIMITS)
_KEY_SOURCES = ("key", "key_file", "key_env")


class TenantConfigError(ValueError):
    """A key document that cannot be served, with what is wrong and where."""


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use (None: no limit): tokens (prompt and the most each request may generate, settled with
    what it used) and requests per minute, and requests at once."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in _LIMITS)


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, class, weight and limits; ``tag`` is what its requests carry."""

    name: str
    priority_class: str = DEFAULT_CLASS
    weight: float = 1.0
    limits: TenantLimits = field(default_factory=TenantLimits)
    tag: TenantTag = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", TenantTag(self.name, self.priority_class, float(self.weight)))

    def named(self, name: str) -> "Tenant":
        """A tenant of this one's settings under another name (a fairness id with no entry of its own)."""
        return Tenant(name, self.priority_class, self.weight, self.limits)


@dataclass(frozen=True)
class KeyEntry:
    """One key of the document: its tenant (None: the fairness id names it, else the anonymous tenant)."""

    tenant: Tenant | None


@dataclass
class TenantTable:
    """The tenants of one server and the keys that name them (``keys`` by the SHA-256 of the key: a key is found
    without comparing it with each, and the table holds no key in clear)."""

    tenants: dict[str, Tenant]
    keys: dict[bytes, KeyEntry]

    @property
    def default(self) -> Tenant:
        return self.tenants[DEFAULT_TENANT]

    @property
    def requires_key(self) -> bool:
        return bool(self.keys)

    def entry(self, offered: bytes) -> KeyEntry | None:
        """The entry of the key ``offered``, or None (a wrong key)."""
        return self.keys.get(hashlib.sha256(offered).digest()) if offered else None

    def tenant(self, entry: KeyEntry | None, fairness_id: str | None) -> Tenant:
        """The tenant of a request with key ``entry`` (None: an open server) and header value ``fairness_id``."""
        if entry is not None and entry.tenant is not None:
            return entry.tenant
        if fairness_id:
            known = self.tenants.get(fairness_id)
            return known if known is not None else self.default.named(fairness_id)
        return self.default

    @classmethod
    def open(cls) -> "TenantTable":
        """No keys, no tenants: every request the anonymous tenant's unless a fairness id names another."""
        return cls({DEFAULT_TENANT: Tenant(DEFAULT_TENANT)}, {})


def is_document(text: str) -> bool:
    """Whether the key file's text is a document of keys and tenants rather than one key."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return True
    first = next((line for line in stripped.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")
    return first.split(":", 1)[0].strip() in ("tenants", "keys") and ":" in first


def parse_document(text: str, env: dict[str, str] | None = None) -> TenantTable:
    """The table of a key document (module docstring); :class:`TenantConfigError` names what is wrong."""
    import yaml  # noqa: PLC0415 - only a server with a key document reads YAML

    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise TenantConfigError(f"the key file is neither one key nor a readable document: {exc}") from None
    if not isinstance(data, dict):
        raise TenantConfigError("the key document must be a mapping with 'tenants' and 'keys'")
    unknown = sorted(set(data) - {"tenants", "keys"})
    if unknown:
        raise TenantConfigError(f"the key document has unknown sections {unknown}: it takes 'tenants' and 'keys'")
    if "keys" not in data:
        raise TenantConfigError("the key document lists no keys: give 'keys' (an empty list serves without a key)")
    env = os.environ if env is None else env
    tenants = {name: _tenant(name, settings, f"tenants.{name}") for name, settings in _mapping(data, "tenants").items()}
    inline: dict[str, Tenant] = {}
    keys: dict[bytes, KeyEntry] = {}
    entries = data["keys"]
    if not isinstance(entries, list):
        raise TenantConfigError("keys must be a list of entries")
    for index, item in enumerate(entries):
        where = f"keys[{index}]"
        if not isinstance(item, dict):
            raise TenantConfigError(f"{where} must be a mapping (key, key_file or key_env; tenant; settings)")
        key = _key(item, where, env)
        digest = hashlib.sha256(key.encode()).digest()
        if digest in keys:
            raise TenantConfigError(f"{where} repeats a key given before: each key names one tenant")
        keys[digest] = KeyEntry(_key_tenant(item, where, tenants, inline))
    tenants = {**inline, **tenants}
    tenants.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
    return TenantTable(tenants, keys)


def _mapping(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise TenantConfigError(f"{name} must be a mapping of tenant names to their settings")
    return value


def _key(item: dict[str, Any], where: str, env: dict[str, str]) -> str:
    """The key of one entry, from exactly one of its sources."""
    sources = [name for name in _KEY_SOURCES if name in item]
    if len(sources) != 1:
        raise TenantConfigError(f"{where} needs exactly one of key, key_file, key_env (got {sources or 'none'})")
    source, value = sources[0], item[sources[0]]
    if not isinstance(value, str) or not value.strip():
        raise TenantConfigError(f"{where}.{source} must be a non-empty string")
    if source == "key_file":
        try:
            with open(value) as fh:
                value = fh.read()
        except OSError as exc:
            raise TenantConfigError(f"{where}.key_file {value}: {exc.strerror}") from None
    elif source == "key_env":
        if value not in env:
            raise TenantConfigError(f"{where}.key_env: ${value} is not set")
        value = env[value]
    key = value.strip()
    if not key:
        raise TenantConfigError(f"{where}: its {source} gives an empty key")
    return key


def _key_tenant(item: dict[str, Any], where: str, tenants: dict[str, Tenant], inline: dict[str, Tenant]) -> Tenant | None:
    """The tenant a key entry names, its settings from ``tenants`` or from the entry itself (kept in ``inline``)."""
    unknown = sorted(set(item) - {*_KEY_SOURCES, "tenant", *_SETTINGS})
    if unknown:
        raise TenantConfigError(f"{where} has unknown fields {unknown}")
    settings = {name: item[name] for name in _SETTINGS if name in item}
    name = item.get("tenant")
    if name is None:
        if settings:
            raise TenantConfigError(f"{where} gives settings without a tenant: name the tenant they are for")
        return None
    if not isinstance(name, str):
        raise TenantConfigError(f"{where}.tenant must be a string")
    if name in tenants:
        if settings:
            raise TenantConfigError(f"{where}: tenant {name!r} has its settings under tenants; give them in one place")
        return tenants[name]
    tenant = _tenant(name, settings, where)
    if name in inline and inline[name] != tenant:
        raise TenantConfigError(f"{where}: tenant {name!r} was given other settings on an earlier key")
    inline[name] = tenant
    return tenant


def _tenant(name: Any, settings: Any, where: str) -> Tenant:
    """A tenant from its settings (class, weight, limits), each checked."""
    if not isinstance(name, str) or not name or len(name) > MAX_TENANT_NAME:
        raise TenantConfigError(f"{where}: a tenant's name must be a string of 1 to {MAX_TENANT_NAME} characters")
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise TenantConfigError(f"{where} must be a mapping of settings ({', '.join(_SETTINGS)})")
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise TenantConfigError(f"{where} has unknown settings {unknown} (it takes {', '.join(_SETTINGS)})")
    cls = settings.get("class", DEFAULT_CLASS)
    if cls not in BANDS:
        raise TenantConfigError(f"{where}.class must be one of {', '.join(CLASSES)}, got {cls!r}")
    weight = settings.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise TenantConfigError(f"{where}.weight must be a positive number, got {weight!r}")
    limits = {}
    for limit in _LIMITS:
        value = settings.get(limit)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TenantConfigError(f"{where}.{limit} must be a whole number >= 1, got {value!r}")
        limits[limit] = value
    return Tenant(name, cls, float(weight), TenantLimits(**limits))


def tenant_table(api_key: str | None, options: TenancyOptions | None, env: dict[str, str] | None = None
                 ) -> TenantTable | None:
    """The tenants of a server with key file text ``api_key``: a document's, or with ``--tenant-header`` given the
    single key's (or none: an open server) with every tenant of ``default``'s settings; None: no tenants (one key
    or none, as before tenants existed)."""
    if api_key and is_document(api_key):
        return parse_document(api_key, env)
    if options is None or not options.header:
        return None
    table = TenantTable.open()
    if api_key:
        table.keys[hashlib.sha256(api_key.encode()).digest()] = KeyEntry(None)
    return table
