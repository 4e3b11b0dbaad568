"""Backends for the RL frameworks that plug engines in as classes of their own rather than over HTTP (verl).

Nothing in :mod:`megatron_serve` imports this package: each subpackage imports its framework at the top and is
imported by that framework's own plugin hooks, so megatron-serve never needs the framework installed.
"""
