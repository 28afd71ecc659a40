"""A stand-in optimizer for tests/test_events.py (stdlib only, run by the daemon).

    optimizer_recorder.py RECORD EXIT_CODE GATE [placeholder values...]

Appends one JSON line to RECORD (a file outside runs/): its argv after the
script name, its pid, and the listing of every argument that is a directory
(so a test sees which reports existed when the optimizer ran). Prints two
lines to stdout and one to stderr, waits up to 20 s for the file GATE to
exist unless GATE is "-", then exits with EXIT_CODE.
"""

from __future__ import annotations

import json
import os
import sys
import time

GATE_WAIT_S = 20.0


def main(argv: list[str]) -> int:
    record, exit_code, gate, *values = argv
    dirs = {arg: sorted(os.listdir(arg)) for arg in values if os.path.isdir(arg)}
    with open(record, "a", encoding="utf-8") as f:
        f.write(json.dumps({"argv": argv, "pid": os.getpid(), "dirs": dirs}) + "\n")
    print(f"recorder: optimizing {len(values)} values", flush=True)
    print("recorder: second stdout line", flush=True)
    print("recorder: a warning on stderr", file=sys.stderr, flush=True)
    deadline = time.monotonic() + GATE_WAIT_S
    while gate != "-" and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(exit_code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
