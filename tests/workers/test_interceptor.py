"""The gRPC edge maps each kind of domain error to its status code (the end-to-end
cases are in test_disaggregated.py and test_worker_lifecycle.py)."""

from __future__ import annotations

import grpc
import pytest

from kvtransfer import KVLayoutMismatch, KVTransferError
from services.common.errors import (
    EngineFailedError,
    PeerFailedError,
    RequestAbortedError,
    RequestExistsError,
    UnknownPeerError,
)
from services.common.interceptor import status_of
from services.engine import NoFreeBlocksError


@pytest.mark.parametrize(
    "error, code",
    [
        (KVLayoutMismatch("block_size differs", ["block_size"]), "FAILED_PRECONDITION"),
        (UnknownPeerError("who?"), "FAILED_PRECONDITION"),
        (ValueError("top_p must be in (0, 1]"), "INVALID_ARGUMENT"),
        (NoFreeBlocksError("3 needed, 0 free"), "RESOURCE_EXHAUSTED"),
        (RequestExistsError("in flight"), "ALREADY_EXISTS"),
        (RequestAbortedError("aborted"), "CANCELLED"),
        (KVTransferError("timed out", timed_out=True), "UNAVAILABLE"),
        (PeerFailedError("prefill worker gone"), "UNAVAILABLE"),
        (EngineFailedError("step failed"), "INTERNAL"),
        (KeyError("a bug"), "INTERNAL"),
    ],
)
def test_status_of(error, code):
    assert status_of(error) == getattr(grpc.StatusCode, code)
