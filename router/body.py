"""Reading a request body: bounded in size before and after decompression, every
failure an OpenAI-shaped error (413 too large, 415 an unknown Content-Encoding, 400
unreadable or not JSON).

The app turns aiohttp's own decompression off (app.py: auto_decompress=False): aiohttp
refuses a bad gzip / deflate / br body in its HTTP parser, before the app, with a
text/plain 400 (and sometimes inside read() as an exception that was a 500). Here a
compressed body is inflated in bounded steps, so a small body that inflates past the
limit (a zip bomb) is a 413 without being inflated whole."""

from __future__ import annotations

import json
import zlib

from aiohttp import HttpVersion11, web

from router.errors import APIError, bad_request

_STEP = 256 * 1024  # decompressed bytes per step
# zlib's window bits: gzip or zlib header, detected (deflate is often sent raw too)
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": 32 + 15}


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


async def read_json(request: web.Request, limit: int):
    """The parsed body; 413 over `limit` bytes (sent or inflated), 400 when it is not
    JSON."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except web.RequestPayloadError as e:  # e.g. a chunked body that breaks off
        why = " ".join(str(e).split()).removeprefix("400, message: ")
        raise bad_request(f"the request body cannot be read: {why}") from None
    raw = decode(raw, request.headers.get("Content-Encoding", ""), limit)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # nested deeper than the interpreter's stack allows
        raise bad_request(
            "the request body is nested too deeply", code="nested_too_deeply"
        ) from None


async def expect_handler(request: web.Request) -> None:
    """`Expect: 100-continue` is answered as aiohttp does; any other expectation is
    ignored (RFC 9110 allows it), where aiohttp's default would answer a text/plain 417
    outside the app's error shaping."""
    if request.headers.get("Expect", "").strip().lower() == "100-continue":
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the response proper has not started


def decode(raw: bytes, content_encoding: str, limit: int) -> bytes:
    """The body without its Content-Encoding (gzip, deflate; identity), at most `limit`
    bytes once inflated."""
    for coding in reversed([c.strip().lower() for c in content_encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        if coding not in _WBITS:
            raise APIError(
                415,
                f"Content-Encoding {coding[:32]!r} is not supported: send gzip, deflate or none",
                code="unsupported_content_encoding",
                type="invalid_request_error",
            )
        raw = _inflate(raw, coding, limit)
    return raw


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    attempts = [_WBITS[coding]] + ([-zlib.MAX_WBITS] if coding == "deflate" else [])
    for i, wbits in enumerate(attempts):
        d = zlib.decompressobj(wbits)
        out: list[bytes] = []
        size, rest = 0, data
        try:
            while True:
                chunk = d.decompress(rest, _STEP)
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                out.append(chunk)
                progress = chunk or len(d.unconsumed_tail) != len(rest)
                rest = d.unconsumed_tail
                if d.eof or not progress:
                    break
        except zlib.error:
            if i + 1 < len(attempts):
                continue  # raw deflate, without the zlib header
            raise bad_request(f"the request body is not valid {coding} data") from None
        if not d.eof:
            raise bad_request(f"the request body's {coding} data is incomplete")
        return b"".join(out)
    raise AssertionError("unreachable")
