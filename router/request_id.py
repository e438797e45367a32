"""X-Request-Id: accepted from the client or created here, and carried by every log
line about the request."""

from __future__ import annotations

import logging
import re
import uuid

from aiohttp import web

HEADER = "X-Request-Id"
_VALID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestLog(logging.LoggerAdapter):
    """Prefixes every message with [request_id]."""

    def __init__(self, logger: logging.Logger, request_id: str):
        super().__init__(logger, {"request_id": request_id})

    def process(self, msg, kwargs):
        return f"[{self.extra['request_id']}] {msg}", kwargs


# Keys of the per-request storage (web.RequestKey where aiohttp has it, 3.13+).
_Key = getattr(web, "RequestKey", None)
REQUEST_ID = _Key("pdserve_request_id", str) if _Key else "pdserve_request_id"
REQUEST_LOG = _Key("pdserve_request_log", RequestLog) if _Key else "pdserve_request_log"


def accept_or_create(header: str | None) -> str:
    """The client's id when it is a sane token (<= 128 of [A-Za-z0-9._:-]), else a new one."""
    if header and _VALID.match(header):
        return header
    return uuid.uuid4().hex
