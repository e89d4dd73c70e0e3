"""Credentials for the cluster's internal endpoints: the cluster token, and optional TLS.

The resource manager, the workers and the proxy's observe API accept a call
only if it carries ``authorization: Bearer <token>``. The token comes from
``--token_file`` (which wins) or the ``PATHWAYS_CLUSTER_TOKEN`` environment
variable; ``pathways-nb up`` and ``LocalCluster`` make one and hand it to
their children. Three things stay open (``OPEN_METHOD_PREFIXES``): gRPC health
checks; the IFRT proxy service, whose stock client cannot send a token (it is
reached through a tunnel: ``ssh -L`` or ``kubectl port-forward``); and the
proxy's host probe ``Observe/GetHost``, which only says whether a caller shares
its host.

A server with no token refuses to listen beyond loopback: anyone who reaches
it could register workers, take devices or end sessions.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

_LOGGER = logging.getLogger(__name__)

TOKEN_ENV = "PATHWAYS_CLUSTER_TOKEN"
METADATA_KEY = "authorization"
NEEDS_TOKEN = "this endpoint needs the cluster token: pass --token_file or set PATHWAYS_CLUSTER_TOKEN"
# Methods served without a token: health checks, the IFRT proxy protocol (its stock client sends none), and
# the proxy's host probe (a hash that only says whether a caller shares this host: plain JAX_PLATFORMS=proxy
# processes, which hold no token, ask it before their client exists to choose shared-memory uploads).
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/xla.ifrt.proxy.GrpcIfrtService/",
    "/pathways_nb.v1.Observe/GetHost",
)


def generate_token() -> str:
    """A fresh random cluster token: 256 bits as hex, safe anywhere (one in 64 URL-safe tokens begins with
    '-', which ``%pathways connect ... --token`` and every argparse command line take for an option)."""
    return secrets.token_hex(32)


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped, as a Kubernetes Secret or ``echo`` leaves it)."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the cluster token from --token_file {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"--token_file {path} is empty; write the cluster token into it")
    return token


def write_token_file(path: str, token: str) -> None:
    """Writes ``token`` to ``path`` readable by this user only (0600)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(token + "\n")


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path}: {e.strerror}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ClusterCredentials:
    """What one component needs to serve internal endpoints and to call them.

    ``token``: required of callers (when serving) and sent (when calling); None: none.
    ``tls_cert``/``tls_key`` (PEM): serve over TLS. ``tls_ca`` (PEM): call over TLS,
    trusting these root certificates.
    """

    token: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls_cert and --tls_key go together: pass both (PEM files) or neither")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterCredentials:
        """From the flags ``add_arguments`` added (the token file wins over the environment variable)."""
        token_file = getattr(args, "token_file", None)
        return cls(
            token=read_token_file(token_file) if token_file else token_from_env(),
            tls_cert=_read(getattr(args, "tls_cert", None), "--tls_cert"),
            tls_key=_read(getattr(args, "tls_key", None), "--tls_key"),
            tls_ca=_read(getattr(args, "tls_ca", None), "--tls_ca"),
        )

    # -- serving ---------------------------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [RequireToken(self.token)] if self.token else []

    def check_bind(self, host: str, what: str) -> None:
        """Refuses to serve beyond loopback without a token; on loopback, warns that any local user may call."""
        if self.token:
            return
        if not is_loopback(host):
            raise ValueError(
                f"{what} would listen on {host} with no cluster token, so anyone who reaches it could use it: "
                f"pass --token_file PATH or set {TOKEN_ENV} (pathways-nb up makes one), or listen on 127.0.0.1"
            )
        _LOGGER.warning(
            "%s on %s accepts any local caller: no cluster token (--token_file or %s)", what, host, TOKEN_ENV
        )

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Binds ``address`` (TLS if a certificate is set); returns the port, 0 if it could not bind."""
        if self.tls_cert is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)]))

    # -- calling ---------------------------------------------------------------------------

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to an internal endpoint at ``host:port`` that sends the token (over TLS if ``tls_ca``;
        never to a ``unix:PATH``, which is this machine's and reached through its file's permissions)."""
        if self.tls_ca is not None and not address.startswith("unix:"):
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(self.tls_ca), options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, SendToken(self.token))
        return channel

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """``channel`` for grpc.aio, made on the loop it serves; its calls pass ``call_metadata()``."""
        if self.tls_ca is not None and not address.startswith("unix:"):
            return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(self.tls_ca), options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The token as call metadata (what ``channel`` adds to every call)."""
        return ((METADATA_KEY, _bearer(self.token)),) if self.token else ()

    def child_env(self) -> dict[str, str]:
        """Environment variables that hand the token to a child server (never its command line, which ps shows)."""
        return {TOKEN_ENV: self.token} if self.token else {}


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of a cluster whose servers all serve TLS and call each other over it (``pathways-nb up``
    on several machines): each server reads them itself, so they are passed on as paths."""

    cert: str
    key: str
    ca: str

    @classmethod
    def of(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """The three files (as absolute paths), or None if none is given; ``ValueError`` if only some are."""
        given = (cert, key, ca)
        if not any(given):
            return None
        if not all(given):
            raise ValueError(
                "--tls_cert, --tls_key and --tls_ca go together for a whole cluster: every server serves TLS with "
                "the certificate (which must name every address a server listens on) and trusts the CA when it "
                "calls the others"
            )
        return cls(*(os.path.abspath(path) for path in given))

    def serving(self) -> list[str]:
        """The flags of a server that serves TLS."""
        return ["--tls_cert", self.cert, "--tls_key", self.key]

    def calling(self) -> list[str]:
        """The flags of a server that calls the others over TLS."""
        return ["--tls_ca", self.ca]

    def credentials(self, token: str | None) -> ClusterCredentials:
        """What a launcher calls the cluster's servers with."""
        return ClusterCredentials(token=token, tls_ca=_read(self.ca, "--tls_ca"))


def add_arguments(parser: argparse.ArgumentParser, serve_tls: bool, call_tls: bool) -> None:
    """The credential flags of a server command (``serve_tls``: it can serve TLS; ``call_tls``: it calls others)."""
    parser.add_argument(
        "--token_file",
        default=None,
        help=f"file holding the cluster token that internal calls must carry; wins over the {TOKEN_ENV} "
        "environment variable. With neither, the server serves only on loopback (127.0.0.1)",
    )
    if serve_tls:
        parser.add_argument("--tls_cert", default=None, help="serve over TLS with this certificate chain (PEM)")
        parser.add_argument("--tls_key", default=None, help="the private key of --tls_cert (PEM)")
    if call_tls:
        parser.add_argument(
            "--tls_ca", default=None, help="call the other components over TLS, trusting these root certificates (PEM)"
        )


# -- the token on the wire -----------------------------------------------------------------


def _bearer(token: str) -> str:
    return f"Bearer {token}"


class RequireToken(grpc.aio.ServerInterceptor):
    """Rejects calls without the cluster token with UNAUTHENTICATED (health and IFRT calls pass)."""

    def __init__(self, token: str):
        self._expected = _bearer(token).encode()

    def authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES)
            or self.authorized(handler_call_details.invocation_metadata)
        ):
            return handler
        return _rejecting(handler)


async def _reject(_request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, NEEDS_TOKEN)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that rejects the call (without parsing the request)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_reject)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_reject)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_reject)
    return grpc.unary_unary_rpc_method_handler(_reject)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class SendToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the cluster token to every call of a channel (call credentials would need TLS)."""

    def __init__(self, token: str):
        self._metadatum = (METADATA_KEY, _bearer(token))

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._metadatum),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
