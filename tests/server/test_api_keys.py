"""Every route asks for the key the documented rule names (``key_for``, from which the HTTP reference is
generated): the routes that use the model the API key, ``/v1/admin/*`` the admin key, the probes,
``/metrics`` and the API description none. The app's own route list is enumerated, so a route added later
is held to the rule too."""

from __future__ import annotations

import re

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Route

from megatron_serve.commands.run import bearer_header, curl_example
from megatron_serve.server import create_app
from megatron_serve.server.app import key_for

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

API_KEY, ADMIN_KEY = "api-k3y", "admin-k3y"


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, its documentation's included."""
    found = []
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            found += [(method, route.path) for method in sorted(route.methods - {"HEAD"})]
    return found


async def test_every_route_asks_for_the_key_the_rule_names(tokenizer):
    app = create_app(FakeBackend(tokenizer), tokenizer, "tiny-llama", api_key=API_KEY, admin_key=ADMIN_KEY,
                     vocab_size=512, max_model_len=1024, status_interval=0.05)
    served = routes(app)
    assert ("POST", "/tokenize") in served and ("GET", "/docs") in served and ("GET", "/metrics") in served
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        for method, path in served:
            path = path.replace("{model}", "tiny-llama")
            statuses = {}
            for key in (None, API_KEY, ADMIN_KEY):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                statuses[key] = (await http.request(method, path, headers=headers, json={})).status_code
            kind = key_for(path)
            if kind == "api":
                assert statuses[None] == statuses[ADMIN_KEY] == 401 and statuses[API_KEY] not in (401, 403), path
            elif kind == "admin":
                # no credential: 401; another key, the API key included: 403
                assert statuses[None] == 401 and statuses[API_KEY] == 403 and statuses[ADMIN_KEY] not in (401, 403), \
                    path
            else:
                assert all(code not in (401, 403) for code in statuses.values()), (path, statuses)
    assert key_for("/tokenize") == key_for("/detokenize") == "api"


def test_the_banner_prints_a_command_that_works_without_the_key_in_it(monkeypatch):
    """The banner goes to logs: a key from --api-key (kept out of ``ps`` or not) is a variable the user sets, a
    single key file is read by its path, and a key document (tenants) is not sent whole as a key (a 400)."""
    class Args:
        api_key, api_key_file = None, None

    monkeypatch.delenv("MEGATRON_SERVE_API_KEY", raising=False)
    args = Args()
    assert bearer_header(args, None) == ("", "")
    variable = ' -H "Authorization: Bearer $MEGATRON_SERVE_API_KEY"'
    args.api_key = "sk-it's"
    assert bearer_header(args, "sk-it's") == (variable, "with MEGATRON_SERVE_API_KEY set to the key given by --api-key")
    args.api_key, args.api_key_file = None, "/keys/my key"
    assert bearer_header(args, "sk-file") == (' -H "Authorization: Bearer $(cat \'/keys/my key\')"', "")
    document = "keys:\n  - {key: sk-a, tenant: team-a}\n"
    assert bearer_header(args, document) == (variable, "with MEGATRON_SERVE_API_KEY set to one of the keys in "
                                                       "/keys/my key")
    args.api_key_file = None
    monkeypatch.setenv("MEGATRON_SERVE_API_KEY", "from-the-environment")
    assert bearer_header(args, "from-the-environment") == (variable, "")
    command = curl_example("http://127.0.0.1:8000", "m", *bearer_header(args, "from-the-environment"))
    assert re.match(r"try: curl http://127\.0\.0\.1:8000/v1/completions -H 'Content-Type: application/json' -H",
                    command)
    noted = curl_example("http://127.0.0.1:8000", "m", variable, "with X set")
    assert noted.startswith("try (with X set): curl ") and "sk-" not in noted


async def test_a_client_that_sets_no_header_presents_its_keys_from_netrc(tokenizer, tmp_path, monkeypatch):
    """The RL frameworks' clients (TRL's ``VLLMClient``, SkyRL's, slime's) set no Authorization header; ``requests``
    then sends HTTP Basic from ``~/.netrc`` for the host, and a key given as its password is taken. The same
    client with a wrong password, or with no netrc line, is refused as before."""
    import asyncio  # noqa: PLC0415

    import requests  # noqa: PLC0415

    app = create_app(FakeBackend(tokenizer), tokenizer, "tiny-llama", api_key=API_KEY, admin_key=ADMIN_KEY,
                     vocab_size=512, max_model_len=1024, status_interval=0.05)
    netrc = tmp_path / ".netrc"
    monkeypatch.setenv("NETRC", str(netrc))

    def statuses(password: str | None) -> tuple[int, int]:
        netrc.write_text(f"machine 127.0.0.1 login trainer password {password}\n" if password else "")
        netrc.chmod(0o600)
        with requests.Session() as session:  # as the frameworks make theirs: no auth of its own
            admin = session.get(f"{url}/v1/admin/status", timeout=30).status_code
            api = session.post(f"{url}/tokenize", json={"model": "tiny-llama", "prompt": "hi"}, timeout=30)
        return admin, api.status_code

    async with serving(app) as url:
        assert await asyncio.to_thread(statuses, ADMIN_KEY) == (200, 401)  # the admin key opens admin routes only
        assert await asyncio.to_thread(statuses, API_KEY) == (403, 200)
        assert await asyncio.to_thread(statuses, "wrong") == (403, 401)
        assert await asyncio.to_thread(statuses, None) == (401, 401)
