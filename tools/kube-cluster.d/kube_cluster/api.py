"""A minimal HTTPS client of the API server as the admin, for `up`'s readiness checks.

Standard library only: the tool runs before any virtual environment exists.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path


class Api:
    """GET/POST/DELETE against one API server with the admin's client certificate."""

    def __init__(self, server: str, pki: Path) -> None:
        self.server = server
        self.context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=timeout) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def get(self, path: str) -> dict:
        status, body = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body[:200]!r}")
        return json.loads(body)

    def text(self, path: str) -> str:
        status, body = self.request("GET", path)
        return body.decode() if status == 200 else ""

    def ready_nodes(self, names: list[str]) -> bool:
        """True when every named node reports the Ready condition True."""
        nodes = self.get("/api/v1/nodes")["items"]
        ready = {n["metadata"]["name"] for n in nodes
                 if any(c["type"] == "Ready" and c["status"] == "True"
                        for c in n.get("status", {}).get("conditions", []))}
        return set(names) <= ready
