"""How the command-line clients (`kvshare generate`, `chat`, `transcribe`) reach a worker: the
connection flags, the target address (the worker's port where none is given), and one line that
says what to check when the connection itself fails, in place of gRPC's transport message."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

API_KEY_ENV = "KVSHARE_API_KEY"
WORKER_PORT = 50051
"""`kvshare serve`'s default --port, which a --target without a port gets (services/api/config.py)."""
ROUTER_PORT = 50050
"""`kvshare route`'s default --port (services/route/config.py), named in the hints."""
GRPC_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds"})
"""gRPC name-resolver prefixes: a target that starts with one of them and a colon is gRPC's to read."""


class ConnectionSettingsError(ValueError):
    """A client flag is unusable (a file that cannot be read, a malformed --target); the message says which."""


def target_with_port(target: str) -> str:
    """``target`` with ``WORKER_PORT`` added where it names no port: ``HOST``, ``[V6]`` and a bare IPv6
    address get it; ``HOST:PORT`` and ``[V6]:PORT`` are checked; gRPC's own forms (``dns:///…``,
    ``unix:…``, ``ipv4:…``) pass unchanged. Without this, gRPC takes a bare host to mean port 443."""
    target = target.strip()
    scheme = target.split(":", 1)[0]
    if scheme in GRPC_SCHEMES and ":" in target:
        return target
    if not target:
        raise ConnectionSettingsError("--target is empty: give HOST[:PORT]")
    if "://" in target and scheme not in GRPC_SCHEMES:
        raise ConnectionSettingsError(f"--target {target} is a URL: give the gRPC port's HOST[:PORT] (an --http-port "
                                      "serves the OpenAI-compatible HTTP API, which this command does not speak)")
    if target.startswith("["):
        address, bracket, rest = target[1:].partition("]")
        if not bracket or not address:
            raise ConnectionSettingsError(f"--target {target}: an IPv6 address goes in brackets, [ADDRESS]:PORT")
        if not rest:
            return f"{target}:{WORKER_PORT}"
        host, port = f"[{address}]", rest[1:] if rest.startswith(":") else None
    elif target.count(":") > 1:
        return f"[{target}]:{WORKER_PORT}"
    elif ":" not in target:
        return f"{target}:{WORKER_PORT}"
    else:
        host, port = target.rsplit(":", 1)
    if not host or port is None or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionSettingsError(f"--target {target} is not HOST[:PORT] (a port from 1 to 65535; "
                                      f"without one, {WORKER_PORT})")
    return target


@dataclass(frozen=True, slots=True)
class Connection:
    """How to reach a worker: its address, TLS files (none: plaintext) and API key (none: no header)."""

    target: str
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    api_key: str = field(default="", repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Connection:
        """From ``add_connection_flags``' flags; the key from --api-key-file, else KVSHARE_API_KEY.
        Raises ConnectionSettingsError for a key file that cannot be read or holds no key, and for
        a --target that is not HOST[:PORT]."""
        key = os.environ.get(API_KEY_ENV, "")
        if args.api_key_file is not None:
            try:
                key = args.api_key_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConnectionSettingsError(f"cannot read --api-key-file {args.api_key_file}: {exc}") from exc
            if not key:
                raise ConnectionSettingsError(f"--api-key-file {args.api_key_file} is empty")
        for flag, path in (("--tls-ca-file", args.tls_ca_file), ("--tls-cert-file", args.tls_cert_file),
                           ("--tls-key-file", args.tls_key_file)):
            if path is not None and not path.is_file():
                raise ConnectionSettingsError(f"{flag} {path}: no such file")
        if (args.tls_cert_file is None) != (args.tls_key_file is None):
            raise ConnectionSettingsError("a client certificate needs both --tls-cert-file and --tls-key-file")
        return cls(target_with_port(args.target), args.tls_ca_file, args.tls_cert_file, args.tls_key_file, key)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def channel(self) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes() if self.ca_file else None,
            private_key=self.key_file.read_bytes() if self.key_file else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file else None))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=f"127.0.0.1:{WORKER_PORT}",
                        help=f"the worker's gRPC HOST[:PORT] (no port: {WORKER_PORT}, kvshare serve's; a router "
                             f"listens on {ROUTER_PORT})")
    parser.add_argument("--tls-ca-file", type=Path, default=None, help="connect over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-cert-file", type=Path, default=None, help="client certificate for mutual TLS (PEM)")
    parser.add_argument("--tls-key-file", type=Path, default=None, help="key of --tls-cert-file (PEM)")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help=f"file holding the API key sent as 'authorization: Bearer KEY' (or set {API_KEY_ENV})")


_PORTS = (f"A worker's gRPC port is its --port, {WORKER_PORT} unless set (a router's: {ROUTER_PORT}); "
          "--metrics-port and --http-port do not speak gRPC")


_NOT_CONNECTED = "failed to connect to all addresses"
_NOT_RESOLVED = ("errors resolving", "DNS resolution failed")


def unreachable(exc: grpc.RpcError, connection: Connection) -> str | None:
    """What to check, in one line, when ``exc`` says the channel never reached a gRPC server at
    ``connection.target`` (nothing listening, a TLS/plaintext mismatch, an HTTP/1 port, a name that
    does not resolve); None for every other error, the server's own answers included.

    gRPC reports all of these as UNAVAILABLE with a transport message ("Socket closed", "Failed
    parsing HTTP/2"); the phrases matched are gRPC core's, and one it words otherwise still gets
    the general advice."""
    details = exc.details() or ""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not details.startswith((_NOT_CONNECTED, *_NOT_RESOLVED)):
        return None
    where = f"cannot reach a kvshare server at {connection.target} over {'TLS' if connection.tls else 'plaintext'}"
    if "Connection refused" in details:
        return f"{where}: nothing listens there. Is the server running, on that host and port? {_PORTS}."
    if details.startswith(_NOT_RESOLVED):
        return f"{where}: the host name does not resolve. Check --target HOST[:PORT]"
    if "HTTP/2" in details:
        return f"{where}: that port answers HTTP/1, not gRPC (a --metrics-port or --http-port?). {_PORTS}."
    if "WRONG_VERSION_NUMBER" in details:
        return (f"{where}: the server there does not speak TLS: drop the --tls-* flags for a plaintext server, "
                f"or check the port. {_PORTS}.")
    if "handshake" in details.lower() and connection.tls:
        return (f"{where}: the TLS handshake failed: check that --tls-ca-file "
                "signed the server's certificate, that the certificate names the host of --target, and, for "
                "mutual TLS, --tls-cert-file and --tls-key-file")
    if "Socket closed" in details or "reset" in details:
        if not connection.tls:
            return (f"{where}: the server closed the connection, as a TLS server does to plaintext: "
                    "if it serves TLS, give --tls-ca-file (the CA that signed its certificate)")
        if connection.cert_file is None:
            return (f"{where}: the server closed the connection, as a mutual-TLS server does to a client "
                    "without a certificate: give --tls-cert-file and --tls-key-file")
    return (f"{where} ({details}). Check --target ({_PORTS}) and TLS: --tls-ca-file for a TLS server, "
            "none for a plaintext one.")


def rpc_error_line(command: str, exc: grpc.RpcError, connection: Connection) -> str:
    """The one line a command prints for a failed call: what to check when nothing was reached,
    else the status and the server's message."""
    hint = unreachable(exc, connection)
    return f"kvshare {command}: {hint}" if hint else f"error: {exc.code().name}: {exc.details()}"
