"""Optional TLS and mutual TLS for the parameter-server channel (gRPC's own credentials).

Server: ``--tls_cert`` + ``--tls_key`` (PEM) serve TLS; adding ``--tls_ca`` makes it mutual:
a client must present a certificate signed by that CA, or the handshake fails (the call never
reaches the server's code). Client: ``tls_ca`` (the CA that signed the server's certificate;
without it, the system's roots) turns TLS on; ``tls_cert`` + ``tls_key`` are its own certificate
for a mutual-TLS server. ``tls_server_name`` overrides the name checked against the server's
certificate (default: the host of the endpoint; the certificate needs it as a subject
alternative name, e.g. ``IP:10.0.0.5``).

Each setting also comes from the environment (flags and arguments win): ``FLEET_PS_TLS_CERT``,
``FLEET_PS_TLS_KEY``, ``FLEET_PS_TLS_CA``, ``FLEET_PS_TLS_SERVER_NAME``. In a fleetrun job, set
them in the job's ``env:`` (paths on every node): the servers serve with the certificate, the
trainers present the same one as clients, both trust the CA.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from collective.errors import ConfigError

ENV = {
    "cert": "FLEET_PS_TLS_CERT",
    "key": "FLEET_PS_TLS_KEY",
    "ca": "FLEET_PS_TLS_CA",
    "server_name": "FLEET_PS_TLS_SERVER_NAME",
}
"""Environment variable of each setting."""


@dataclass(frozen=True)
class TLSConfig:
    """Paths of PEM files (None: not given) and the name to check on the server's certificate."""

    cert: str | None = None
    """This end's certificate chain (a server's: required for TLS; a client's: for mutual TLS)."""
    key: str | None = None
    """The private key of ``cert``."""
    ca: str | None = None
    """Server: clients must present a certificate signed by it (mutual TLS). Client: the CA
    that signed the server's certificate."""
    server_name: str | None = None
    """Client only: the name the server's certificate must carry (default: the endpoint host)."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError(
                "tls_cert and tls_key go together (the certificate and its private key); got "
                f"only {'tls_cert' if self.cert else 'tls_key'}",
                key="tls_cert" if not self.cert else "tls_key",
            )

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **given: str | None) -> TLSConfig:
        """The settings in ``given`` (``cert=``, ``key=``, ``ca=``, ``server_name=``), each
        falling back to its environment variable (:data:`ENV`)."""
        env = os.environ if environ is None else environ
        values = {f: given.get(f) or env.get(var) or None for f, var in ENV.items()}
        return cls(**values)

    @property
    def client_enabled(self) -> bool:
        """A client uses TLS when it has a CA or a certificate."""
        return bool(self.ca or self.cert)

    @property
    def server_enabled(self) -> bool:
        """A server serves TLS when it has a certificate (and key)."""
        return bool(self.cert)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read {path!r}: {err.strerror}", key=flag) from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{path!r} is not a PEM file", key=flag)
    return data


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """TLS credentials of a server (mutual when ``tls.ca`` is set)."""
    assert tls.cert and tls.key
    pair = (_read(tls.key, "tls_key"), _read(tls.cert, "tls_cert"))
    ca = _read(tls.ca, "tls_ca") if tls.ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """TLS credentials of a client channel."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "tls_ca") if tls.ca else None,
        private_key=_read(tls.key, "tls_key") if tls.key else None,
        certificate_chain=_read(tls.cert, "tls_cert") if tls.cert else None,
    )


def channel_options(tls: TLSConfig) -> list[tuple[str, Any]]:
    """Extra channel options (the server-name override)."""
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []


__all__ = ["ENV", "TLSConfig", "channel_credentials", "channel_options", "server_credentials"]
