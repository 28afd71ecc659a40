"""A stand-in for `sbatch --wait`: submit a job that runs detached, wait for it.

    python fake_sbatch.py --log FILE --wait JOB [ARG...]

Like Slurm, the job runs apart from the client (its own session, its output
in a file beside the log, as slurm-<id>.out) and gets the client's
environment (sbatch's --export=ALL): killing the client, or the daemon that
started it, leaves the job running. With --wait the client exits with the
job's exit code. Every submission appends one line to --log, with the
client's and the job's pids: the tests count submissions there, not in the
daemon's own log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--wait", action="store_true")
    parser.add_argument("job", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    with open(f"{args.log}.job-{os.getpid()}.out", "ab") as out:
        job = subprocess.Popen(args.job, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    with open(args.log, "a", encoding="utf-8") as log:
        log.write(json.dumps({"client": os.getpid(), "job": job.pid, "argv": args.job}) + "\n")
    print(f"Submitted batch job {job.pid}", flush=True)
    if not args.wait:
        return 0
    return job.wait()


if __name__ == "__main__":
    sys.exit(main())
