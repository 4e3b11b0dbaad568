"""The Python API (docs/python-api.md): ``MegatronLLM`` and vLLM's ``LLM``, ``MegatronAsyncLLM`` and vLLM's
``AsyncLLM``, over an engine in this process or a fleet of engine processes, started here or found at an address.

It stands above the wings it puts together: the client (:mod:`megatron_serve.client`), the local fleet it may start
(:mod:`.fleet_client`) and the HTTP server that ``serve()`` runs in this process. Nothing beneath it imports it; the
package root re-exports its names.
"""
