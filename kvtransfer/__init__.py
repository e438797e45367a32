"""Moving KV-cache blocks between worker processes.

Never imports the engine nor torch: it speaks integer addresses, byte counts and block
ids. A backend is imported only when a connector of its kind is created: each needs its
own wheel and system libraries (Mooncake: its engine and libibverbs), and a worker loads
only the one it names.
"""

from __future__ import annotations

from typing import Any

from kvtransfer.connector import KVAgentInfo, KVConnector, KVTransferError, TransferStats
from kvtransfer.layout import KVLayout, KVLayoutMismatch, check_compatible, coalesce

# name -> why it cannot be used here (None = available)
BACKENDS: dict[str, str | None] = {
    "mooncake": None,
    "mori": "MORI-IO has only ROCm builds (amd-mori); not available in this package yet",
}


def create_connector(backend: str, **kwargs: Any) -> KVConnector:
    """Build a connector by backend name; kwargs go to the backend's constructor.

    "mooncake": MooncakeConnector(hostname="127.0.0.1", protocol="tcp",
    metadata="P2PHANDSHAKE", device_name="", ...).
    """
    if backend == "mooncake":
        from kvtransfer.mooncake import MooncakeConnector

        return MooncakeConnector(**kwargs)
    if backend in BACKENDS:
        raise ValueError(f"KV transfer backend {backend!r} is not available: {BACKENDS[backend]}")
    raise ValueError(
        f"unknown KV transfer backend {backend!r}; known: "
        + ", ".join(f"{k} ({v})" if v else k for k, v in BACKENDS.items())
    )


__all__ = [
    "BACKENDS",
    "KVAgentInfo",
    "KVConnector",
    "KVLayout",
    "KVLayoutMismatch",
    "KVTransferError",
    "TransferStats",
    "check_compatible",
    "coalesce",
    "create_connector",
]
