"""A worker's host memory once it is ready: resident (VmRSS) and peak (VmHWM) from
/proc, after the start-up warm-up ran every batch kind once.

    python benchmarks/worker_memory.py                    # decode worker, default model
    python benchmarks/worker_memory.py --role prefill -- --num-kv-blocks 256

Arguments after `--` go to `pdserve <role>`. PDSERVE_KERNEL_TUNING_DIR pointed at an
empty folder includes a first start's kernel tuning."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

from services.models.default_model import default_model_dir


def _status_mb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="decode", choices=("prefill", "decode"))
    parser.add_argument("--model", default=None, help="the default model's folder if unset")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to ready")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    model = args.model or str(default_model_dir())
    cmd = [sys.executable, "-m", "pdserve", args.role, "--model", model, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # a worker that hangs is stopped, which ends its stdout and the loop below
    watchdog = threading.Timer(args.timeout, proc.terminate)
    watchdog.start()
    try:
        for line in proc.stdout:
            event = json.loads(line[8:]) if line.startswith("PDSERVE ") else {}
            if event.get("event") == "ready":
                break
        else:
            sys.exit(f"the {args.role} worker was not ready within {args.timeout} s "
                     f"or exited (rc {proc.wait()})")  # fmt: skip
        memory = _status_mb(proc.pid)
        phases = event["startup"]["phases"]
        print(json.dumps({"role": args.role, "args": extra, **memory, "phases_s": phases}))
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
