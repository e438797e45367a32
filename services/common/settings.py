"""Worker settings (everything that is not the engine's), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtransfer.faults import TransferFaults
from pdpb import tls

FAILURE_POLICIES = ("recompute", "fail")
TRANSFER_PROTOCOLS = ("tcp", "rdma", "nvlink_intra")
# which thread makes the prefill worker's KV write calls (kvtransfer/mooncake.py
# direct_writes)
TRANSFER_WRITE_MODES = {"auto": None, "direct": True, "thread": False}
# How long a prefill worker waits for a KV write it walked away from at its deadline
# (the engine call may still be writing): Mooncake's TCP transport gives up after 30 s
# (MC_TCP_PROGRESS_TIMEOUT_SEC).
ABANDONED_WRITE_WAIT_S = 45.0


@dataclass
class WorkerSettings:
    host: str = "127.0.0.1"
    served_model_name: str | None = None  # metrics' model_name label; None: the model
    port: int = 50051
    metrics_port: int | None = None  # Prometheus /metrics; None: off
    # TLS on the gRPC port (pdpb/tls.py); no certificate: plaintext
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # clients must present a certificate this CA signed (mutual TLS); the decode worker
    # also verifies prefill workers' certificates against it
    tls_ca_file: str | None = None
    # decode worker -> prefill workers: its client certificate (default: its server pair)
    tls_client_cert_file: str | None = None
    tls_client_key_file: str | None = None
    tls_server_name: str | None = None  # name in prefill workers' certificates, if not their host
    # KV transfer
    transfer_backend: str = "mooncake"
    transfer_protocol: str = "tcp"
    transfer_hostname: str = "127.0.0.1"  # the address peers reach this worker's engine at
    transfer_metadata: str = "P2PHANDSHAKE"
    transfer_device: str = ""  # RDMA device names, comma-separated
    transfer_write_mode: str = "auto"  # auto (direct for nvlink_intra), direct or thread
    kv_transfer_timeout_s: float = 30.0
    # decode side
    prefill_timeout_s: float = 60.0
    prefill_failure_policy: str = "recompute"
    reserve_timeout_s: float = 30.0  # how long a request may wait for free KV blocks
    # shutdown
    drain_timeout_s: float = 30.0
    # start-up: skip the warm-up (services/engine/warmup.py) before SERVING; the first
    # request of each batch shape then compiles kernels on the serving path (logged)
    skip_warmup: bool = False
    # the engine (model, KV cache, scheduler, KV transfer engine) in a process of its own
    # (engine_core.py), so the worker's gRPC and response building do not share its GIL
    engine_process: bool = False
    # Fault injection for tests only (env PDSERVE_FAULT_PAUSE_MID_TRANSFER_S): the prefill
    # worker writes half of a request's blocks, pauses this long, then writes the rest.
    fault_pause_mid_transfer_s: float = 0.0
    # Faults inside the transfer engine's writes (env PDSERVE_FAULT_*, kvtransfer/faults.py)
    transfer_faults: TransferFaults = field(default_factory=TransferFaults)

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def tls_client_pair(self) -> tuple[str | None, str | None]:
        """The decode worker's client identity toward prefill workers: one certificate
        per worker (serverAuth + clientAuth) is the usual setup, so its server pair
        unless a separate client pair is given."""
        if self.tls_client_cert_file is not None:
            return self.tls_client_cert_file, self.tls_client_key_file
        return self.tls_cert_file, self.tls_key_file

    @property
    def abort_timeout_s(self) -> float:
        """The longest a prefill worker's Abort may take to confirm that no write can
        land any more: its transfer deadline plus the wait for an abandoned engine call
        (both roles are assumed to run the same --kv-transfer-timeout)."""
        return self.kv_transfer_timeout_s + ABANDONED_WRITE_WAIT_S + 5.0

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        self._check_tls()
        if self.transfer_protocol not in TRANSFER_PROTOCOLS:
            raise ValueError(
                f"transfer_protocol must be one of {TRANSFER_PROTOCOLS}, got {self.transfer_protocol!r}"
            )
        if self.transfer_write_mode not in TRANSFER_WRITE_MODES:
            raise ValueError(
                f"transfer_write_mode must be one of {tuple(TRANSFER_WRITE_MODES)}, "
                f"got {self.transfer_write_mode!r}"
            )
        if self.prefill_failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"prefill_failure_policy must be one of {FAILURE_POLICIES}, "
                f"got {self.prefill_failure_policy!r}"
            )
        for name in (
            "kv_transfer_timeout_s",
            "prefill_timeout_s",
            "reserve_timeout_s",
            "drain_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def _check_tls(self) -> None:
        tls.check_pair(self.tls_cert_file, self.tls_key_file, "--tls-cert-file", "--tls-key-file")
        tls.check_pair(
            self.tls_client_cert_file,
            self.tls_client_key_file,
            "--tls-client-cert-file",
            "--tls-client-key-file",
        )
        tls.check_ca(self.tls_ca_file, "--tls-ca-file")
        tls.check_server_name(self.tls_server_name, "--tls-server-name")
        if not self.tls:
            # a TLS flag without a server certificate would leave the worker plaintext
            for name in ("tls_ca_file", "tls_client_cert_file", "tls_server_name"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag} needs --tls-cert-file and --tls-key-file")
