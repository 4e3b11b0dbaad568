"""``kubectl get KIND [NAME] [-l=...] [--field-selector=...] -o json`` answered in-process from the Kubernetes API,
with the official ``kubernetes`` client: what :class:`tests.operator.real_tools.Kubectl` reads with.

The real-cluster tests poll the cluster's state many times a second; a ``kubectl`` process per poll (a Go binary's
start, its kubeconfig, discovery and printing) made those polls a tenth of the suite's CPU (docs/testing.md). The
answer is the same JSON: the object as the API server sends it, or a list's items each with the ``kind`` and
``apiVersion`` that ``kubectl`` adds to them, without the ``managedFields`` that ``kubectl`` leaves out.

Kinds are resolved as ``kubectl`` resolves them: the plural, the singular, a short name or the kind, case-insensitive,
optionally qualified by its group (``megatroninferences.serving.megatron.dev``) or version and group; the core group
first, then the server's groups in the order discovery lists them, each at its preferred version; a name missing from
the table rediscovers once (a CRD installed since), as ``kubectl`` does when its cached discovery lacks a kind.
"""

from __future__ import annotations

import json
import pathlib
import threading
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3

#: What a read waits for the API server, in seconds (connect, read), as ``kubectl``'s process was given 120 s.
TIMEOUT = (10.0, 60.0)

#: The flags a read accepts, by their prefix, and the query parameter each becomes.
SELECTORS = {"-l=": "labelSelector", "--selector=": "labelSelector", "--field-selector=": "fieldSelector"}


@dataclass(frozen=True)
class Resource:
    """One kind the API server serves: where it lives and what its objects are called."""

    prefix: str  # "/api/v1" or "/apis/apps/v1"
    plural: str
    kind: str
    api_version: str  # "v1" or "apps/v1"
    namespaced: bool

    def path(self, namespace: str, name: str | None) -> str:
        scope = f"/namespaces/{namespace}" if self.namespaced else ""
        return f"{self.prefix}{scope}/{self.plural}" + (f"/{name}" if name else "")


def selector_query(selector: tuple[str, ...]) -> list[tuple[str, str]]:
    """``-l=``/``--selector=`` and ``--field-selector=`` as the list call's query; any other flag is refused."""
    query: dict[str, str] = {}
    for flag in selector:
        prefix = next((p for p in SELECTORS if flag.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"Kubectl.get: {flag!r} is not a selector; it reads with -l=, --selector= or "
                             "--field-selector= only (run() takes kubectl's other flags)")
        parameter = SELECTORS[prefix]
        if parameter in query:
            raise ValueError(f"Kubectl.get: {flag!r} repeats the {parameter}; give it once, comma-separated")
        query[parameter] = flag[len(prefix):]
    return list(query.items())


class Kinds:
    """kubectl's names for one server's resources, discovered once per process and rediscovered on a miss."""

    def __init__(self) -> None:
        self._table: dict[str, Resource] = {}
        self._lock = threading.Lock()

    def resolve(self, api: kubernetes.client.ApiClient, name: str) -> Resource:
        key = name.lower()
        with self._lock:
            if key not in self._table:
                self._table = discover(api)
            if key not in self._table:
                raise AssertionError(f"Kubectl.get: the server doesn't have a resource type {name!r}")
            return self._table[key]


def discover(api: kubernetes.client.ApiClient) -> dict[str, Resource]:
    """Every name of every resource the server serves now; the first resource to claim a name keeps it."""
    table: dict[str, Resource] = {}
    lists = [("v1", "", request(api, "/api/v1"))]
    for group in request(api, "/apis")["groups"]:
        preferred = group["preferredVersion"]["groupVersion"]
        try:
            listing = request(api, f"/apis/{preferred}")
        except AssertionError:
            listing = None
        if listing is not None:  # else an aggregated API that does not answer now: kubectl warns and goes on
            lists.append((preferred, group["name"], listing))
    for group_version, group, listing in lists:
        prefix = "/api/v1" if group == "" else f"/apis/{group_version}"
        version = group_version.rpartition("/")[2]
        for entry in listing["resources"]:
            if "/" in entry["name"]:
                continue  # a subresource (pods/log, scale)
            resource = Resource(prefix, entry["name"], entry["kind"], group_version, entry["namespaced"])
            names = {entry["name"], entry.get("singularName") or entry["kind"].lower(), entry["kind"].lower(),
                     *entry.get("shortNames", [])}
            for short in names:
                for key in (short, *([f"{short}.{group}", f"{short}.{version}.{group}"] if group else [])):
                    table.setdefault(key.lower(), resource)
    return table


def request(api: kubernetes.client.ApiClient, path: str, query: list[tuple[str, str]] | None = None) -> Any:
    """GET ``path`` as JSON; ``None`` for 404 (kubectl's NotFound), AssertionError naming the path otherwise."""
    serialized = api.param_serialize("GET", path, query_params=query or [],
                                     header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
    try:
        response = api.call_api(*serialized, _request_timeout=TIMEOUT)
    except (urllib3.exceptions.HTTPError, kubernetes.client.ApiException) as exc:  # no answer: kubectl exits 1
        raise AssertionError(f"GET {path}: {exc}") from exc
    body = response.read()
    if response.status == 404:
        return None
    if not 200 <= response.status <= 299:
        raise AssertionError(f"GET {path} -> {response.status}: {body.decode(errors='replace').strip()}")
    return json.loads(body)


def printed(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as ``kubectl get -o json`` prints it: without ``metadata.managedFields`` (its
    ``--show-managed-fields`` is off by default)."""
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


#: Each server's table (by kubeconfig), shared by every Kubectl of the process: the tests make one per test.
_KINDS: dict[str, Kinds] = {}
_KINDS_LOCK = threading.Lock()


class Reader:
    """One kubeconfig's API client, made on the first read and kept, and its server's :class:`Kinds`."""

    def __init__(self, kubeconfig: pathlib.Path) -> None:
        self.kubeconfig = kubeconfig
        self._api: kubernetes.client.ApiClient | None = None
        self._lock = threading.Lock()
        with _KINDS_LOCK:
            self.kinds = _KINDS.setdefault(str(kubeconfig), Kinds())

    def api(self) -> kubernetes.client.ApiClient:
        with self._lock:
            if self._api is None:
                self._api = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig),
                                                                     persist_config=False)
            return self._api

    def get(self, namespace: str, kind: str, name: str | None, selector: tuple[str, ...]) -> Any:
        """The object (``None`` when it does not exist), or the items of every kind of a comma-separated list."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"Kubectl.get: kind {kind!r} is not a resource type")
        query = selector_query(selector)
        kinds = kind.split(",")
        if name and (query or len(kinds) > 1):
            raise ValueError(f"Kubectl.get: name {name!r} goes with one kind and no selector (given {kind!r}, "
                             f"{' '.join(selector) or 'no selector'})")
        api = self.api()
        if name:
            found = request(api, self.kinds.resolve(api, kind).path(namespace, name))
            return None if found is None else printed(found)
        items: list[dict[str, Any]] = []
        for each in kinds:
            resource = self.kinds.resolve(api, each)
            listing = request(api, resource.path(namespace, None), query)
            if listing is None:
                return None  # kubectl's NotFound for the list (a kind deleted since discovery)
            items += [printed({"apiVersion": resource.api_version, "kind": resource.kind, **item})
                      for item in listing["items"]]
        return items
