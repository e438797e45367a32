"""RouterConfig: everything the router needs, validated at construction."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from router.policies import POLICIES
from router.reasoning import REASONING_PARSERS

ROLES = ("prefill", "decode")


def parse_address(address: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into (host, port); raises ValueError."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"worker address must be 'host:port', got {address!r}")
    address = address.strip()
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise ValueError(f"worker address must be '[ipv6]:port', got {address!r}")
    else:
        host, sep, port = address.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"worker address must be 'host:port', got {address!r}")
    if not host:
        raise ValueError(f"worker address has no host: {address!r}")
    try:
        port_num = int(port)
    except ValueError:
        raise ValueError(f"worker address has a bad port: {address!r}") from None
    if not 1 <= port_num <= 65535:
        raise ValueError(f"worker port must be in [1, 65535]: {address!r}")
    return host, port_num


def format_address(host: str, port: int) -> str:
    """The gRPC target for (host, port): IPv6 literals in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def normalize_address(address: str) -> str:
    return format_address(*parse_address(address))


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill: tuple[str, ...] = ()  # "host:port"; a DNS name may stand for several workers
    decode: tuple[str, ...] = ()
    prefill_policy: str = "round_robin"
    decode_policy: str = "least_load"
    api_keys: tuple[str, ...] = ()  # empty: no authentication on /v1
    admin_token: str | None = None  # None: /admin endpoints need no token
    served_model_name: str | None = None  # None: the model the workers report
    max_body_bytes: int = 16 * 1024 * 1024
    request_timeout: float = 600.0  # seconds, whole request, retries included
    health_interval: float = 2.0  # seconds between health / load probes
    health_timeout: float = 2.0  # seconds a probe may take before the worker is unhealthy
    dns_interval: float = 10.0  # seconds between re-resolutions of worker DNS names
    max_concurrent_requests: int = 1024  # over this: 429; 0: no limit
    max_retries: int = 2  # other pairs tried when a worker fails before the first token
    retry_after: int = 1  # seconds, the Retry-After header of a 429
    pair_timeout: float = 30.0  # seconds an AddPrefillPeer handshake may take
    # split <think>...</think> into `reasoning` / `content` (vLLM's --reasoning-parser)
    reasoning_parser: str | None = None

    def __post_init__(self):
        self.prefill = tuple(normalize_address(a) for a in self.prefill)
        self.decode = tuple(normalize_address(a) for a in self.decode)
        self.api_keys = tuple(self.api_keys)
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("host must be a non-empty string")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(
                    f"{name} must be one of {sorted(POLICIES)}, got {getattr(self, name)!r}"
                )
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("API keys must be non-empty strings")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("admin_token must be non-empty when given")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must be non-empty when given")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning_parser {self.reasoning_parser!r}; choose one of "
                f"{sorted(REASONING_PARSERS)}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        for name in (
            "request_timeout",
            "health_interval",
            "health_timeout",
            "dns_interval",
            "pair_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_concurrent_requests < 0:
            raise ValueError("max_concurrent_requests must be >= 0 (0: no limit)")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.retry_after < 1:
            raise ValueError("retry_after must be at least 1 second")
