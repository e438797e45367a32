"""Server-sent events framing of OpenAI streams."""

from __future__ import annotations

import json

from aiohttp import web

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not hold back tokens
}


# one encoder for every chunk: json.dumps with options builds a new one per call
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def event(obj: dict) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


class EventStream(web.StreamResponse):
    """An SSE response whose headers go out with its first event, in one send (the
    buffering aiohttp's own web.Response opts into): a short stream then costs two
    sends, headers with the first event and the rest with the end of the body."""

    _send_headers_immediately = False
