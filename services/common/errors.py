"""What can go wrong in a worker, in the workers' own words. The servicers raise these
(or the engine's and kvtransfer's errors); one interceptor (interceptor.py) turns each
kind into its gRPC status, so no servicer method picks status codes itself."""

from __future__ import annotations


class RequestExistsError(Exception):
    """A request with this id is already in flight on this worker."""


class RequestAbortedError(Exception):
    """The request was aborted (Abort(), or the caller went away) before it finished."""


class UnknownPeerError(Exception):
    """The caller names a transfer session this worker has not handshaken with."""


class PeerFailedError(Exception):
    """A peer worker this request depends on failed or did not answer in time."""


class EngineFailedError(Exception):
    """The engine's step failed under this request (a bug or a device error)."""


class WorkerFailed(RuntimeError):
    """The worker cannot serve any more (a tensor-parallel rank died, its engine
    process ended): it exits non-zero after leaving the pool."""
