"""Latency probe, run inside the destination's network namespace.

Reads requests from stdin, one per line: `PATH SIZE SHA256 TIMEOUT_S`. For each, polls PATH
in a tight loop (every 1 ms: stat, and when the size matches, read and hash) until the
content is exactly the expected one, then prints `ok MONOTONIC_NS` (CLOCK_MONOTONIC is
system-wide, so the writer's timestamps are comparable) or `timeout`. Prints `ready` once
at start.
"""
import hashlib
import os
import sys
import time


def main():
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if len(parts) != 4:
            continue
        path, size, digest, timeout = parts[0], int(parts[1]), parts[2], float(parts[3])
        deadline = time.monotonic() + timeout
        answer = "timeout"
        while time.monotonic() < deadline:
            try:
                if os.stat(path).st_size == size:
                    with open(path, "rb") as f:
                        data = f.read()
                    now = time.monotonic_ns()
                    if hashlib.sha256(data).hexdigest() == digest:
                        answer = f"ok {now}"
                        break
            except OSError:
                pass
            time.sleep(0.001)
        print(answer, flush=True)


if __name__ == "__main__":
    main()
