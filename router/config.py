"""RouterConfig: everything the router needs, validated at construction."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdpb import tls
from router.bounds import RequestLimits
from router.policies import POLICIES
from router.reasoning import REASONING_PARSERS
from router.tools import TOOL_PARSERS

if TYPE_CHECKING:
    import grpc

ROLES = ("prefill", "decode")

ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"  # the admin token, when no flag gives it


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
    admin_token: str | None = None  # None: the /admin endpoints are off (404)
    served_model_name: str | None = None  # None: the model the workers report
    # log request bodies (prompts) at INFO (vLLM's --enable-log-requests); off, no
    # prompt or completion text is logged at any level
    enable_log_requests: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    # bounds on every list and string of a request body (router/bounds.py)
    limits: RequestLimits = field(default_factory=RequestLimits)
    request_timeout: float = 600.0  # seconds, whole request, retries included
    health_interval: float = 2.0  # seconds between health / load probes
    health_timeout: float = 2.0  # seconds a probe may take before it counts as failed
    # timed-out probes in a row before a live worker is unhealthy (a busy worker answers
    # late; a refused connection or NOT_SERVING counts at once), as Kubernetes' probes
    health_failure_threshold: int = 3
    dns_interval: float = 10.0  # seconds between re-resolutions of worker DNS names
    max_concurrent_requests: int = 1024  # over this: 429; 0: no limit
    max_concurrent_requests_per_key: int = 0  # per API key (with --api-key); 0: no limit
    max_retries: int = 2  # other pairs tried when a worker fails before the first token
    retry_after: int = 1  # seconds, the Retry-After header of a 429
    pair_timeout: float = 30.0  # seconds an AddPrefillPeer handshake may take
    # split <think>...</think> into `reasoning` / `content` (vLLM's --reasoning-parser)
    reasoning_parser: str | None = None
    # tool calls in chat output (vLLM's --tool-call-parser); tool_choice "auto" also
    # needs enable_auto_tool_choice, as in vLLM
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # TLS to the workers (pdpb/tls.py): on when a CA or a client certificate is given;
    # without a CA the workers' certificates are checked against the system's roots
    worker_tls_ca_file: str | None = None
    worker_tls_cert_file: str | None = None  # the router's client identity (mutual TLS)
    worker_tls_key_file: str | None = None
    worker_tls_server_name: str | None = None  # name in workers' certificates, if not their host
    # HTTP server processes sharing the port (vLLM's --api-server-count): one Python
    # process streams about 16k tokens/s (docs/performance.md), more need more processes
    api_server_count: int = 1

    @property
    def worker_tls(self) -> bool:
        return self.worker_tls_ca_file is not None or self.worker_tls_cert_file is not None

    def worker_channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for every channel to a worker (the files read now); None:
        plaintext."""
        if not self.worker_tls:
            return None
        return tls.channel_credentials(
            self.worker_tls_ca_file, self.worker_tls_cert_file, self.worker_tls_key_file
        )

    def __post_init__(self):
        self._check_worker_tls()
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
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool_call_parser {self.tool_call_parser!r}; choose one of "
                f"{sorted(TOOL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not isinstance(self.limits, RequestLimits):
            raise ValueError(f"limits must be a RequestLimits, got {type(self.limits).__name__}")
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
        if self.max_concurrent_requests_per_key < 0:
            raise ValueError("max_concurrent_requests_per_key must be >= 0 (0: no limit)")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.health_failure_threshold < 1:
            raise ValueError(
                f"health_failure_threshold must be >= 1, got {self.health_failure_threshold}"
            )
        if self.retry_after < 1:
            raise ValueError("retry_after must be at least 1 second")
        if not isinstance(self.api_server_count, int) or self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count!r}")
        if self.api_server_count > 1 and self.admin_token is not None:
            # a POST /admin/workers would change one process's worker list of several
            raise ValueError(
                "the /admin endpoints (--admin-token) need --api-server-count 1: with several "
                "processes an added or removed worker would reach only one of them; give "
                "workers by flag or DNS name instead"
            )

    def _check_worker_tls(self) -> None:
        tls.check_pair(
            self.worker_tls_cert_file,
            self.worker_tls_key_file,
            "--worker-tls-cert-file",
            "--worker-tls-key-file",
        )
        tls.check_ca(self.worker_tls_ca_file, "--worker-tls-ca-file")
        tls.check_server_name(self.worker_tls_server_name, "--worker-tls-server-name")
        if self.worker_tls_server_name is not None and not self.worker_tls:
            raise ValueError(
                "--worker-tls-server-name needs --worker-tls-ca-file or --worker-tls-cert-file"
            )
