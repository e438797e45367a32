"""Throw-away certificates for TLS tests, made with the openssl binary (no Python
dependency): a CA; a server certificate for 127.0.0.1 / localhost / SERVER_NAME that also
serves as a client identity; one that names SERVER_NAME only (reached by IP only with a
server-name override, as pods are); a client-only certificate; and a second CA with a
client certificate of its own (a stranger that must be refused)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
# the name the server certificate carries besides 127.0.0.1 / localhost: what a
# deployment that dials by IP passes as --tls-server-name
SERVER_NAME = "pdserve-worker"


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class PKI:
    ca: str
    server: Pair  # serverAuth + clientAuth: a worker's single identity
    named: Pair  # as server, for SERVER_NAME only
    client: Pair  # clientAuth only: the router
    other_ca: str
    stranger: Pair  # a client certificate the other CA signed


def _run(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key_and_csr(name: str, cwd: Path) -> None:
    _run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)  # fmt: skip


def _ca(name: str, cwd: Path) -> str:
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=cwd)  # fmt: skip
    return str(cwd / f"{name}.crt")


def _leaf(name: str, ca: str, extensions: str, cwd: Path) -> Pair:
    _key_and_csr(name, cwd)
    (cwd / f"{name}.ext").write_text(extensions)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
         "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext",
         cwd=cwd)  # fmt: skip
    return Pair(str(cwd / f"{name}.crt"), str(cwd / f"{name}.key"))


def make_pki(directory: Path) -> PKI:
    if OPENSSL is None:
        pytest.skip("needs the openssl binary")
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca("ca", directory)
    other_ca = _ca("other-ca", directory)
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    server = _leaf(
        "server",
        "ca",
        leaf + f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{SERVER_NAME}\n"
        "extendedKeyUsage=serverAuth,clientAuth\n",
        directory,
    )
    named = _leaf(
        "named",
        "ca",
        leaf + f"subjectAltName=DNS:{SERVER_NAME}\nextendedKeyUsage=serverAuth,clientAuth\n",
        directory,
    )
    client = _leaf("client", "ca", leaf + "extendedKeyUsage=clientAuth\n", directory)
    stranger = _leaf("stranger", "other-ca", leaf + "extendedKeyUsage=clientAuth\n", directory)
    return PKI(ca, server, named, client, other_ca, stranger)
