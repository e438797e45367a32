"""TLS and mutual TLS on the gRPC hops (router -> workers, decode -> prefill).

It lives in pdpb because that is the one first-party package both the router and the
workers may import (tests/test_imports.py), so both ends read certificates one way.

Certificates, keys and CA bundles are PEM files. The `check_*` functions parse them with
the standard library's ssl module when the settings are built: a wrong path, a key that
does not belong to its certificate or a CA file that holds no certificate fails at start
with the flag's name, not at the first handshake. The files are read once, when the
server or channel is created: replacing a certificate takes a restart."""

from __future__ import annotations

import ssl

import grpc

# The name the certificate of the peer we dial must carry, when it is not the host we
# dial (workers are dialed by pod IP, which no certificate names).
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"


def _no_password():
    # without a callback OpenSSL would prompt on the terminal for an encrypted key
    raise ValueError("encrypted private keys are not supported")


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


def check_pair(cert_file: str | None, key_file: str | None, cert_flag: str, key_flag: str):
    """Both or neither; when both, the key must be the certificate's."""
    if (cert_file is None) != (key_file is None):
        given, missing = (key_flag, cert_flag) if cert_file is None else (cert_flag, key_flag)
        raise ValueError(f"{given} needs {missing}")
    if cert_file is None:
        return
    _read(cert_file, cert_flag)
    _read(key_file, key_flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
            cert_file, key_file, password=_no_password
        )
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(
            f"{key_flag} {key_file} and {cert_flag} {cert_file} are not a usable pair "
            f"(a key that does not match the certificate, or an encrypted key): {e}"
        ) from None


def check_ca(ca_file: str | None, flag: str) -> None:
    if ca_file is None:
        return
    _read(ca_file, flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca_file)
    except ssl.SSLError as e:
        raise ValueError(f"{flag} {ca_file}: no usable CA certificate: {e}") from None


def check_server_name(name: str | None, flag: str) -> None:
    if name is not None and (not name.strip() or any(c.isspace() for c in name)):
        raise ValueError(f"{flag} must be a host name, got {name!r}")


def server_credentials(
    cert_file: str, key_file: str, ca_file: str | None = None
) -> grpc.ServerCredentials:
    """A server's TLS identity. With ca_file: mutual TLS, every client must present a
    certificate that CA signed, or its handshake fails."""
    return grpc.ssl_server_credentials(
        [(_read(key_file, "key"), _read(cert_file, "certificate"))],
        root_certificates=_read(ca_file, "CA") if ca_file else None,
        require_client_auth=ca_file is not None,
    )


def channel_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """A client's TLS: servers verified against ca_file (None: the system's root CAs),
    cert_file / key_file presented when the server asks for a client certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "CA") if ca_file else None,
        private_key=_read(key_file, "key") if key_file else None,
        certificate_chain=_read(cert_file, "certificate") if cert_file else None,
    )


def aio_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    server_name: str | None = None,
    options: list | tuple = (),
) -> grpc.aio.Channel:
    """A TLS channel when credentials are given (never a plaintext fallback), else a
    plaintext one."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    if server_name:
        options = [*options, (TARGET_NAME_OVERRIDE, server_name)]
    return grpc.aio.secure_channel(address, credentials, options=list(options))
