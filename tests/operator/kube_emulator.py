"""A stricter Kubernetes API emulator on top of KMock (docs/architecture.md, Tests).

What still needs it, now that the operator's suites also run on a real cluster (``test_real_*.py``, on
``tools/kube-cluster``): the tests that run kopf in this process with the fake coordinator of ``helpers.py`` (the
lifecycle walk, pause modes, refits and rolls, gang restarts, the KV node fields, the invalid-spec status) read and
write this store directly: a workload held back from Ready, an object's status set by hand, every request the
operator made (``api_calls``, the RBAC test's record). A real API server gives none of that, and each of those
tests would need a real coordinator and engines instead of the fake. What a real server checks (schema, CEL,
RBAC, admission, controllers, the scheduler, garbage collection, 422 on immutable fields) is tested there.

KMock's ``KubernetesEmulator`` serves discovery and an in-memory object store, but it does not
stamp ``resourceVersion``/``generation``/``uid``, answers creates with 200, treats ``/status``
as a plain patch, ignores label selectors and has no garbage collection. kopf (consistency
checks, status subresource) and kubectl need more, so :class:`StrictKubernetesEmulator`
reimplements the object-level verbs and keeps KMock for the HTTP server and discovery:

- create: 201, ``uid``/``resourceVersion``/``creationTimestamp``/``generation`` stamped,
  ``generateName`` honoured, 409 on duplicates, ``status`` dropped when the resource has a
  status subresource; creating a CRD declares its resource (with subresources) for discovery;
- patch (merge, strategic-as-merge, JSON patch) and PUT: ``resourceVersion`` bumps on every
  real change (no-op patches change nothing), ``generation`` bumps when anything outside
  metadata/status changes, ``/status`` touches only status and the main endpoint never
  touches status, ``/scale`` maps to the CRD's ``specReplicasPath``; stale
  ``resourceVersion`` preconditions give 409;
- delete: finalizers hold objects with a ``deletionTimestamp``; removing the last finalizer
  deletes them; dependents are garbage-collected through ownerReferences (background);
- get/list as a ``Table`` (what ``kubectl get`` asks for) from a CRD's printer columns;
- list/watch: label selectors (``=``, ``==``, ``!=``, ``key``, ``!key``), lists carry ``kind``
  and a real ``resourceVersion``, watches resume from a ``resourceVersion``.

Every request is also recorded as (verb, apiGroup, resource[/subresource], namespace) in
``api_calls`` for the RBAC test.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import secrets
import uuid
import warnings
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import apps, references

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def parse_selector(text: str | None) -> list[tuple[str, str, str | None]]:
    terms: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (t.strip() for t in (text or "").split(","))):
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "==" in raw:
            key, value = raw.split("==", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif "=" in raw:
            key, value = raw.split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif raw.startswith("!"):
            terms.append(("!", raw[1:].strip(), None))
        else:
            terms.append(("exists", raw, None))
    return terms


def selector_matches(labels: dict[str, str], terms: list[tuple[str, str, str | None]]) -> bool:
    for op, key, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!" and key in labels:
            return False
    return True


class StatusError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def response(self) -> aiohttp.web.Response:
        return aiohttp.web.json_response({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": self.code, "reason": self.reason, "message": self.message,
        }, status=self.code)


class StrictKubernetesEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store: dict[tuple[Any, str | None, str], dict[str, Any]] = {}
        self.rv = 1
        self.log: list[tuple[int, Any, dict[str, Any]]] = []
        self._pulse = asyncio.Event()  # set and replaced at every change: see wait_until
        self.scale_paths: dict[Any, dict[str, str]] = {}
        self.printer_columns: dict[Any, list[dict[str, Any]]] = {}
        self.api_calls: list[tuple[str, str, str, str | None]] = []
        self.agents: list[str] = []  # User-Agent of each api_calls entry
        self.closing = False
        with warnings.catch_warnings():  # kmock 0.8 uses importlib.resources.read_binary
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()

    # ------------------------------------------------------------------ helpers

    def info(self, res: Any) -> references.ResourceInfo:
        return self.resources[res]

    def known(self, res: Any) -> bool:
        return res in self.resources

    def _kind(self, res: Any) -> str:
        return self.info(res).kind or res.plural.capitalize()

    def _api_version(self, res: Any) -> str:
        return f"{res.group}/{res.version}" if res.group else res.version

    def _stamp(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _notify(self) -> None:
        pulse, self._pulse = self._pulse, asyncio.Event()
        pulse.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``predicate()`` holds after a change (or at once), or ``timeout`` seconds pass (None: no
        limit); returns whether it holds.

        An event set and replaced at each change, not an ``asyncio.Condition`` under ``asyncio.wait_for``: on
        Python 3.11 a task cancelled there (a controller stopped at the end of a test) could wait forever to get the
        condition's lock back, under load, and the test hung at its teardown."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not predicate():
            pulse = self._pulse
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    await pulse.wait()
            except TimeoutError:
                return predicate()
        return True

    async def end_watches(self) -> None:
        """End every open watch stream (the server waits for open handlers when it stops)."""
        self.closing = True
        self._notify()

    def logged_rv(self) -> int:
        return self.log[-1][0] if self.log else 0

    async def _emit(self, res: Any, kind: str, obj: dict[str, Any]) -> None:
        self.log.append((int(obj["metadata"]["resourceVersion"]), res, {"type": kind, "object": copy.deepcopy(obj)}))
        self._notify()

    def _record(self, request: kmock.Request) -> None:
        res = request.resource
        if res is None or not res.plural:
            return
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if method == "GET":
            if request.params.get("watch") in ("true", "1"):
                verb = "watch"
            else:
                verb = "get" if request.name else "list"
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())
        plural = res.plural + (f"/{request.subresource}" if request.subresource else "")
        self.api_calls.append((verb, res.group or "", plural, request.namespace))
        self.agents.append(request.headers.get("User-Agent", ""))

    # ------------------------------------------------------------------ dispatch

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Serve, then drop the request from kmock's history. kmock keeps every request it served and, to route a
        GET, re-applies its filters to all of them: each request cost more than the last (quadratic over a test),
        so a test slowed by a loaded machine made more operator passes, each slower again, until it ran past its
        time limit (under the thread timeout that ended its xdist worker). :attr:`api_calls` is the record."""
        try:
            return await self._serve(request)
        finally:
            requests = self._requests
            for index in range(len(requests) - 1, -1, -1):  # by identity: equal requests are distinct calls
                if requests[index] is request:
                    del requests[index]
                    break

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or not res.plural or res.version is None:
            return await apps.RawHandler._handle(self, request)
        self._record(request)
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        try:
            if method == "GET":
                if not self.known(res):
                    raise StatusError(404, "NotFound", f"the server could not find the requested resource ({res.plural})")
                return await apps.RawHandler._handle(self, request)  # list/watch/fetch below
            if not self.known(res):
                raise StatusError(404, "NotFound", f"the server could not find the requested resource ({res.plural})")
            if method == "POST" and request.name is None:
                obj, code = await self.create(res, request.namespace, request.data)
            elif method in ("PATCH", "PUT") and request.name is not None:
                obj, code = await self.update(res, request, method)
            elif method == "DELETE" and request.name is not None:
                obj, code = await self.delete(res, request.namespace, request.name)
            else:
                raise StatusError(405, "MethodNotAllowed", f"{method} is not supported here")
        except StatusError as exc:
            return exc.response()
        return aiohttp.web.json_response(obj, status=code)

    # ------------------------------------------------------------------ mutations

    async def create(self, res: Any, namespace: str | None, body: Any) -> tuple[dict[str, Any], int]:
        if not isinstance(body, dict):
            raise StatusError(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise StatusError(422, "Invalid", "metadata.name: Required value")
        if self.info(res).namespaced:
            namespace = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise StatusError(400, "BadRequest", "the namespace of the object does not match the URL")
            meta["namespace"] = namespace
        else:
            namespace = None
        key = (res, namespace, name)
        async with self._lock:
            if key in self.store:
                raise StatusError(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
            obj.setdefault("apiVersion", self._api_version(res))
            obj.setdefault("kind", self._kind(res))
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta["generation"] = 1
            meta.pop("deletionTimestamp", None)
            if "status" in self.info(res).subresources:
                obj.pop("status", None)
            if res.group == "apiextensions.k8s.io" and res.plural == "customresourcedefinitions":
                self._declare_crd(obj)
            meta["resourceVersion"] = self._stamp()
            self.store[key] = obj
            await self._emit(res, "ADDED", obj)
            created = copy.deepcopy(obj)
            refs = meta.get("ownerReferences") or []
            alive = {o["metadata"]["uid"] for o in self.store.values()}
            if refs and not any(r.get("uid") in alive for r in refs):
                # Its owners are gone (a controller acting on a stale view): the garbage collector deletes it, as
                # it would any dependent of a deleted owner (else it lingers and takes a name a new owner needs).
                await self._delete_locked(res, obj)
            return created, 201

    def _declare_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            subs = set((version.get("subresources") or {}).keys())
            res = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"), namespaced=spec["scope"] == "Namespaced",
                verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
                shortnames=set(names.get("shortNames") or []), categories=set(names.get("categories") or []),
                subresources=subs)
            if "scale" in subs:
                self.scale_paths[res] = version["subresources"]["scale"]
            self.printer_columns[res] = list(version.get("additionalPrinterColumns") or [])
        crd["status"] = {
            "acceptedNames": dict(names),
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": _now()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": _now()},
            ],
        }

    def _get(self, res: Any, namespace: str | None, name: str) -> dict[str, Any]:
        key = (res, namespace if self.info(res).namespaced else None, name)
        if key not in self.store:
            raise StatusError(404, "NotFound", f'{res.plural} "{name}" not found')
        return self.store[key]

    async def update(self, res: Any, request: kmock.Request, method: str) -> tuple[dict[str, Any], int]:
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        sub = request.subresource
        async with self._lock:
            old = self._get(res, request.namespace, request.name)
            body = request.data
            if sub == "scale":
                return await self._scale(res, old, body, method)
            if sub not in (None, "status"):
                raise StatusError(404, "NotFound", f"subresource {sub} is not supported")
            if method == "PUT":
                if not isinstance(body, dict):
                    raise StatusError(400, "BadRequest", "the body must be a JSON object")
                new = copy.deepcopy(body)
            elif ctype == "application/json-patch+json":
                try:
                    new = jsonpatch.apply_patch(copy.deepcopy(old), body)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise StatusError(422, "Invalid", f"JSON patch failed: {exc}") from None
            elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                if not isinstance(body, dict):
                    raise StatusError(400, "BadRequest", "a merge patch must be a JSON object")
                new = merge_patch(old, body)
            else:
                raise StatusError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
            wanted_rv = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
            if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
                raise StatusError(409, "Conflict", "the object has been modified; please apply your changes "
                                                   "to the latest version and try again")
            has_status = "status" in self.info(res).subresources
            if sub == "status":
                # only status moves; everything else stays as stored
                status = new.get("status")
                new = copy.deepcopy(old)
                if status is None:
                    new.pop("status", None)
                else:
                    new["status"] = status
            elif has_status:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            meta = new.setdefault("metadata", {})
            for field in ("uid", "creationTimestamp", "namespace", "name", "generation", "resourceVersion",
                          "deletionTimestamp"):
                if field in old["metadata"]:
                    meta[field] = old["metadata"][field]
                else:
                    meta.pop(field, None)
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            if new == old:
                return copy.deepcopy(old), 200  # a no-op changes nothing, not even resourceVersion
            if {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
                    {k: v for k, v in old.items() if k not in ("metadata", "status")}:
                meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
            meta["resourceVersion"] = self._stamp()
            key = (res, old["metadata"].get("namespace"), old["metadata"]["name"])
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                del self.store[key]
                await self._emit(res, "DELETED", new)
                await self._collect(new["metadata"]["uid"])
                return copy.deepcopy(new), 200
            self.store[key] = new
            await self._emit(res, "MODIFIED", new)
            return copy.deepcopy(new), 200

    async def _scale(self, res: Any, old: dict[str, Any], body: Any, method: str) -> tuple[dict[str, Any], int]:
        paths = self.scale_paths.get(res)
        if paths is None:
            raise StatusError(404, "NotFound", f"{res.plural} has no scale subresource")
        replicas = ((body or {}).get("spec") or {}).get("replicas")
        if not isinstance(replicas, int):
            raise StatusError(422, "Invalid", "spec.replicas must be an integer")
        keys = paths["specReplicasPath"].lstrip(".").split(".")
        patch: dict[str, Any] = {}
        cursor = patch
        for k in keys[:-1]:
            cursor = cursor.setdefault(k, {})
        cursor[keys[-1]] = replicas
        new = merge_patch(old, patch)
        if new != old:
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            new["metadata"]["resourceVersion"] = self._stamp()
            self.store[(res, old["metadata"].get("namespace"), old["metadata"]["name"])] = new
            await self._emit(res, "MODIFIED", new)
        return self.scale_of(res, new), 200

    def scale_of(self, res: Any, obj: dict[str, Any]) -> dict[str, Any]:
        paths = self.scale_paths[res]

        def pick(path: str | None) -> Any:
            cursor: Any = obj
            for k in (path or "").lstrip(".").split("."):
                cursor = cursor.get(k) if isinstance(cursor, dict) else None
            return cursor

        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                         "creationTimestamp") if k in obj["metadata"]},
            "spec": {"replicas": pick(paths.get("specReplicasPath")) or 0},
            "status": {"replicas": pick(paths.get("statusReplicasPath")) or 0,
                       **({"selector": pick(paths["labelSelectorPath"])}
                          if paths.get("labelSelectorPath") and pick(paths["labelSelectorPath"]) else {})},
        }

    async def delete(self, res: Any, namespace: str | None, name: str) -> tuple[dict[str, Any], int]:
        async with self._lock:
            obj = self._get(res, namespace, name)
            return await self._delete_locked(res, obj), 200

    async def _delete_locked(self, res: Any, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        key = (res, meta.get("namespace"), meta["name"])
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = self._stamp()
                self.store[key] = obj
                await self._emit(res, "MODIFIED", obj)
            return copy.deepcopy(obj)
        del self.store[key]
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._stamp()
        await self._emit(res, "DELETED", gone)
        await self._collect(meta["uid"])
        return gone

    async def _collect(self, owner_uid: str) -> None:
        """Background garbage collection of the dependents of a deleted owner."""
        alive = {o["metadata"]["uid"] for o in self.store.values()}
        for (res, _, _), obj in list(self.store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if refs and any(r.get("uid") == owner_uid for r in refs) and not any(r.get("uid") in alive for r in refs):
                if (res, obj["metadata"].get("namespace"), obj["metadata"]["name"]) in self.store:
                    await self._delete_locked(res, obj)

    # ------------------------------------------------------------------ reads (via KMock's fallbacks)

    def _select(self, request: kmock.Request) -> list[dict[str, Any]]:
        terms = parse_selector(request.params.get("labelSelector"))
        field_terms = parse_selector(request.params.get("fieldSelector"))
        out = []
        for (res, namespace, name), obj in self.store.items():
            if res != request.resource:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if not selector_matches(obj["metadata"].get("labels") or {}, terms):
                continue
            fields = {"metadata.name": name, "metadata.namespace": namespace or ""}
            if not selector_matches(fields, field_terms):
                continue
            out.append(obj)
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _wants_table(self, request: kmock.Request) -> bool:
        return "as=Table" in (request.headers.get("Accept") or "") and request.resource in self.printer_columns

    def _table(self, res: Any, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Server-side printing of a custom resource, from its CRD's additionalPrinterColumns."""
        columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name of the object"}]
        columns += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                     "priority": c.get("priority", 0), "description": c.get("description", "")}
                    for c in self.printer_columns[res]]
        now = datetime.datetime.now(datetime.timezone.utc)

        def cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
            value: Any = obj
            for key in column["jsonPath"].lstrip(".").split("."):
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None and column["type"] == "date":
                when = datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
                value = f"{max(0, int((now - when).total_seconds()))}s"
            return value

        rows = [{"cells": [o["metadata"]["name"]] + [cell(o, c) for c in self.printer_columns[res]],
                 "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                            "metadata": o["metadata"]}} for o in items]
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(self.rv)},
                "columnDefinitions": columns, "rows": rows}

    async def _serve_list(self, request: kmock.Request) -> Any:
        async with self._lock:
            items = [copy.deepcopy(o) for o in self._select(request)]
            if self._wants_table(request):
                return self._table(request.resource, items)
            return {"apiVersion": self._api_version(request.resource), "kind": f"{self._kind(request.resource)}List",
                    "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        async with self._lock:
            try:
                obj = self._get(request.resource, request.namespace, request.name)
            except StatusError as exc:
                raise kmock.KubernetesObjectNotFoundError(message=exc.message) from None
            if request.subresource == "scale":
                return self.scale_of(request.resource, obj)
            if not request.subresource and self._wants_table(request):
                return self._table(request.resource, [copy.deepcopy(obj)])
            return copy.deepcopy(obj)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""
        terms = parse_selector(request.params.get("labelSelector"))
        since_text = request.params.get("resourceVersion") or ""
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        if since_text.isdigit() and int(since_text) > 0:
            cursor = int(since_text)
        else:
            async with self._lock:
                initial = [copy.deepcopy(o) for o in self._select(request)]
                cursor = self.rv
            for obj in initial:
                yield {"type": "ADDED", "object": obj}
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            if not await self.wait_until(lambda: self.logged_rv() > cursor or self.closing, remaining):
                return
            if self.closing:
                return
            # (a version may be stamped but not logged yet: follow the log, not the counter)
            events = [(rv, e) for rv, res, e in self.log if rv > cursor and res == request.resource]
            cursor = self.logged_rv()
            for _, event in events:
                meta = event["object"]["metadata"]
                if request.namespace is not None and meta.get("namespace") != request.namespace:
                    continue
                if not selector_matches(meta.get("labels") or {}, terms):
                    continue
                yield event

    async def _serve_version(self, request: kmock.Request) -> Any:
        doc = await super()._serve_version(request)
        if request.resource.group == "":
            doc["groupVersion"] = request.resource.version
        for entry in doc.get("resources", []):
            if "/" in entry["name"]:  # subresources have no short names of their own
                entry["shortNames"], entry["categories"] = [], []
            if entry["name"].endswith("/scale"):
                entry["kind"], entry["group"], entry["version"] = "Scale", "autoscaling", "v1"
            if not entry.get("verbs"):
                entry["verbs"] = ["create", "delete", "get", "list", "patch", "update", "watch"]
        return doc

    # ------------------------------------------------------------------ test helpers

    def objects_of(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (res, ns, _), o in sorted(self.store.items(), key=lambda kv: (kv[0][1] or "", kv[0][2]))
                if res.plural == plural and (namespace is None or ns == namespace)]

    def find(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        # over a copy of the items: the operator's thread reads the store too (the tests' fake coordinator), and a
        # dict that grows during a loop over it raises
        for (res, ns, n), obj in list(self.store.items()):
            if res.plural == plural and n == name and (namespace is None or ns == namespace):
                return copy.deepcopy(obj)
        return None

    async def set_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """What a controller would do: merge ``status`` into an object, as through ``/status``."""
        async with self._lock:
            for (res, ns, n), obj in self.store.items():
                if res.plural == plural and ns == namespace and n == name:
                    new = copy.deepcopy(obj)
                    new["status"] = merge_patch(new.get("status") or {}, status)
                    if new != obj:
                        new["metadata"]["resourceVersion"] = self._stamp()
                        self.store[(res, ns, n)] = new
                        await self._emit(res, "MODIFIED", new)
                    return
        raise KeyError((plural, namespace, name))

    def calls_by(self, *agent_prefixes: str) -> list[tuple[str, str, str, str | None]]:
        """The recorded API calls whose User-Agent starts with one of the prefixes."""
        return [call for call, agent in zip(self.api_calls, self.agents) if agent.startswith(agent_prefixes)]

    def mutations_since(self, rv: int) -> list[tuple[int, str, str, str]]:
        """(resourceVersion, event type, plural, name) of every change after ``rv``."""
        return [(r, e["type"], res.plural, e["object"]["metadata"]["name"]) for r, res, e in self.log if r > rv]


def kubeconfig_text(url: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    })
