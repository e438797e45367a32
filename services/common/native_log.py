"""Mooncake's own log lines (C++ glog, written to the process's stderr) routed through
pdserve's logging.

Mooncake never calls InitGoogleLogging, so glog writes every line to file descriptor 2
and no glog flag sends it elsewhere; GLOG_minloglevel (read when the library loads)
only drops lines. So the worker points fd 2 at a pipe and a thread reads it:
- a glog line ("W1201 11:22:41.231441 22437 topology.cpp:201] message") is logged on
  the `mooncake` logger: I -> DEBUG, W -> WARNING, E -> ERROR, F -> CRITICAL, except
  the start-up lines that are expected on every start without RDMA and read like
  failures (`EXPECTED`), which are DEBUG;
- every other line is written unchanged to the original stderr at once.
Python's own stderr (sys.stderr, and so the logging handler) is moved to a duplicate
of the original stderr first, so Python output does not pass through the pipe. What
does: other native libraries' stderr writes, delayed by one thread hand-off; if the
process dies abruptly, bytes still in the pipe are lost (the window is the reader's
latency, microseconds when the GIL is free).

`--log-level debug` shows every Mooncake line (it sets GLOG_minloglevel=0, so glog
formats INFO lines at all); otherwise a GLOG_minloglevel in the environment is kept,
and the default is 1 (warnings and errors reach the router thread, INFO is dropped)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import sys
import threading

log = logging.getLogger("mooncake")

_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]]+)\] ?(.*)$")
_LEVELS = {"I": logging.DEBUG, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Printed by every worker start without an RDMA NIC or a metadata server, harmless.
EXPECTED = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "No RDMA devices found",
    "Local segment descriptor not found",
    "Using default malloc/free for protocol",
)
_PIPE_BYTES = 1 << 20  # room for bursts while the reader waits for the GIL


def glog_minloglevel(log_level: str, env: dict) -> str:
    """GLOG_minloglevel for a pdserve log level: 0 (everything) at debug, else the
    environment's or 1 (warnings and errors). Must be set before Mooncake loads."""
    if log_level == "debug":
        return "0"
    return env.get("GLOG_minloglevel", "1")


def route_line(line: str) -> tuple[int, str] | None:
    """(level, message) for a Mooncake line, None for any other output."""
    text = line.rstrip("\n")
    m = _GLOG.match(text)
    if m is None:
        if text.startswith(EXPECTED[0]):
            return logging.DEBUG, text
        return None
    sev, where, msg = m.groups()
    level = _LEVELS[sev]
    if any(e in msg for e in EXPECTED):
        level = logging.DEBUG
    return level, f"{msg} ({where})"


class NativeStderrRouter:
    """Owns fd 2 between start() and stop(); see the module docstring."""

    def __init__(self):
        self._saved_fd: int | None = None
        self._saved_stderr = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._saved_stderr = sys.stderr
        # Python keeps writing straight to the terminal, not through the pipe
        out = io.TextIOWrapper(
            os.fdopen(os.dup(self._saved_fd), "wb", buffering=0),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )
        _retarget_handlers(sys.stderr, out)
        sys.stderr = out
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB pipe still works, it just blocks sooner
        os.dup2(w, 2)
        os.close(w)
        self._thread = threading.Thread(
            target=self._pump, args=(r, self._saved_fd), name="native-stderr", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Give fd 2 back; the reader sees end-of-file once every write end is closed."""
        if self._saved_fd is None:
            return
        os.dup2(self._saved_fd, 2)
        if self._thread is not None:
            self._thread.join(timeout)
        _retarget_handlers(sys.stderr, self._saved_stderr)
        sys.stderr = self._saved_stderr
        os.close(self._saved_fd)
        self._saved_fd = None

    @staticmethod
    def _pump(r: int, out_fd: int) -> None:
        with os.fdopen(r, "rb") as pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="backslashreplace")
                routed = route_line(line)
                if routed is None:
                    os.write(out_fd, raw)
                else:
                    log.log(*routed)


def _retarget_handlers(old, new) -> None:
    # logging.basicConfig's handler holds the stream object it was given
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(new)
