"""Server-sent events framing of OpenAI streams."""

from __future__ import annotations

import json

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
