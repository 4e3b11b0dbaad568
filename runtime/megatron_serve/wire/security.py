"""The fleet secret, and what it protects on the ZeroMQ plane (the user's guide: ``docs/security.md``).

A fleet has one shared secret (``--token-file`` / ``$MEGATRON_SERVE_TOKEN``; ``run`` generates one
per run, the operator renders one per resource). It never crosses the network. Two things are
derived from it, each with HMAC-SHA256 under a label of its own:

* **the coordinator's CURVE key pair.** The coordinator's ROUTER is a CURVE server with it; every
  peer (engine, client, control, operator, trainer) derives the public half and connects as a CURVE
  client, so the connection is encrypted and the peer knows it talks to the fleet's coordinator (an
  impostor cannot complete the handshake). A peer with another secret, or none, fails the
  handshake and sends not a single frame (:class:`HandshakeWatch` tells it why).
* **the HELLO proof.** Each peer holds a CURVE key pair of its own (:class:`PeerKeys`, made fresh by
  each process, kept across its reconnects): its identity. Its HELLO carries
  ``proof = HMAC(secret, its public key)``; the coordinator learns the key of every connection from
  the handshake (ZAP ``User-Id``) and accepts a HELLO only with the proof for that very key. A
  recorded HELLO is worthless on another connection (another key), and a key cannot be used without
  its private half, so a stolen peer identity cannot be reused elsewhere. Until a connection has
  proven the secret this way, the coordinator acts on nothing it sends and sends it nothing.

Replay of recorded traffic fails in CURVE itself: every connection has fresh short-term keys and a
cookie, and every message a nonce that must grow. ``--insecure`` turns all of this off (plain TCP,
no proof: benchmarks only) and says so in the log.

What it costs is measured against an insecure fleet by ``benchmarks/coordinator_peer.py --baseline insecure``
(the figures: docs/design-measurements.md).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
from typing import Any

import zmq
from zmq.utils import z85

#: The environment variable that carries the fleet secret to the processes a fleet starts (never their command
#: lines, where ``ps`` would show it), and that clients and commands read it from.
TOKEN_ENV = "MEGATRON_SERVE_TOKEN"
#: Shorter secrets are refused: a recorded handshake lets an eavesdropper test guesses offline.
MIN_SECRET_CHARS = 32
_LABEL = b"megatron-serve/v1/"

#: Handshakes in a row that failed without a reason after which a peer gives up (one may be a coordinator
#: dying mid-handshake).
REFUSALS_BEFORE_GIVING_UP = 3

#: The monitor events :class:`HandshakeWatch` reads.
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

SECRET_HINT = "pass --token-file FILE or set $MEGATRON_SERVE_TOKEN"


def read_secret_file(path: str, source: str) -> bytes:
    """The secret kept in the file ``path``, surrounding whitespace dropped: the fleet's (``--token-file``), an API
    key's, the operator's token key. ``ValueError`` naming ``source`` (what named the file) when the file cannot be
    read or holds nothing."""
    try:
        with open(path, "rb") as file:
            secret = file.read().strip()
    except OSError as exc:
        raise ValueError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None
    if not secret:
        raise ValueError(f"{source}: {path} is empty")
    return secret


class WeakSecret(ValueError):
    """A fleet secret too short to resist guessing."""


def make_secret() -> str:
    """A new random fleet secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, _LABEL + label, hashlib.sha256).digest()


class FleetSecret:
    """A fleet's secret and the keys derived from it (see the module docstring). ``repr`` hides it."""

    __slots__ = ("value", "server_public", "server_secret", "_proof_key")

    def __init__(self, value: str) -> None:
        if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS:
            size = len(value) if isinstance(value, str) else 0
            raise WeakSecret(f"the fleet secret has {size} characters; it needs at least {MIN_SECRET_CHARS} random "
                             "ones (`megatron-serve run` makes one per run; or: python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))' > FILE)")
        self.value = value
        raw = value.encode()
        self.server_secret = z85.encode(_derive(raw, b"coordinator-curve-key"))
        self.server_public = zmq.curve_public(self.server_secret)
        self._proof_key = _derive(raw, b"hello-proof")

    def proof(self, peer_public: bytes) -> str:
        """What a peer whose CURVE public key (Z85) is ``peer_public`` sends in HELLO."""
        return hmac.new(self._proof_key, peer_public, hashlib.sha256).hexdigest()

    def proves(self, proof: str | None, peer_public: bytes | None) -> bool:
        """Whether ``proof`` is this secret's proof for the connection whose key is ``peer_public``."""
        if not proof or not peer_public:
            return False
        return hmac.compare_digest(proof.encode(), self.proof(peer_public).encode())

    def __repr__(self) -> str:
        return "FleetSecret(<hidden>)"


class TokenFrom(enum.Enum):
    """Where a client takes the fleet secret from when ``token=`` is not given: ``$MEGATRON_SERVE_TOKEN``, as the
    commands read it (the hint of :data:`SECRET_HINT`), else none."""

    ENVIRONMENT = TOKEN_ENV


def fleet_secret(token: "str | FleetSecret | None | TokenFrom") -> FleetSecret | None:
    """``token`` as a :class:`FleetSecret` (``None``: no secret, an insecure fleet; ``TokenFrom.ENVIRONMENT``:
    the environment's, or none); raises :class:`WeakSecret`."""
    if token is TokenFrom.ENVIRONMENT:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None or isinstance(token, FleetSecret):
        return token
    return FleetSecret(token)


class PeerKeys:
    """A peer's own CURVE key pair (its identity on the coordinator), made fresh per process object."""

    __slots__ = ("public", "secret")

    def __init__(self) -> None:
        self.public, self.secret = zmq.curve_keypair()


def hello_credentials(secret: FleetSecret | None, keys: PeerKeys) -> dict[str, Any]:
    """The HELLO fields that prove the secret on a connection made with ``keys`` (none when insecure)."""
    return {} if secret is None else {"proof": secret.proof(keys.public)}


def refused_message(address: str, secure: bool) -> str:
    """The one line a peer reports when the coordinator keeps refusing its handshake."""
    if secure:
        return (f"the coordinator at {address} refused the encrypted handshake: it holds another fleet secret, or "
                f"runs with --insecure (give every process of the fleet the same secret: {SECRET_HINT})")
    return (f"the coordinator at {address} refused an unencrypted connection: it requires the fleet secret "
            f"({SECRET_HINT}; `megatron-serve run` keeps its own in its run directory, which `control` finds)")


class HandshakeWatch:
    """Reads one socket's monitor events: how its connections' handshakes went.

    :meth:`event` returns ``"connected"`` when a handshake succeeded (the first on this socket, or a
    reconnection: the coordinator then knows this peer under a new connection, which must HELLO
    again) and ``"refused"`` when the coordinator will not talk to this peer: a handshake that failed
    on its protocol or its authentication (one side encrypts and the other does not, or it is no
    coordinator), or :data:`REFUSALS_BEFORE_GIVING_UP` in a row that failed without a reason (what
    a coordinator holding another secret causes: it drops the connection), else ``None``.
    """

    def __init__(self) -> None:
        self.handshakes = 0
        self.failures = 0

    def event(self, event: int) -> str | None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshakes += 1
            self.failures = 0
            return "connected"
        if event & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            return "refused"
        if event & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # also a connection reset mid-handshake
            self.failures += 1
            if self.failures >= REFUSALS_BEFORE_GIVING_UP:
                return "refused"
        return None
