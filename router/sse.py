"""Server-sent events framing of OpenAI streams."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not hold back tokens
}


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
