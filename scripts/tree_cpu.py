"""CPU seconds of a command's whole process tree: ``python scripts/tree_cpu.py LABEL CMD...``.

``/usr/bin/time`` counts only descendants that their parents waited for; a multiprocessing forkserver
(tests/dist_utils.py) outlives pytest and is never waited for, so its ranks' CPU would be missed. Here the
command runs under a child subreaper (Linux): every orphaned descendant is re-parented to this process and
reaped, so ``RUSAGE_CHILDREN`` covers the whole tree. Prints ``LABEL rc=.. wall user sys cpu`` to stdout.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    label, cmd = sys.argv[1], sys.argv[2:]
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) must succeed because orphans are counted here; run on Linux")
    start = time.monotonic()
    rc = subprocess.call(cmd)
    while True:  # the orphans (a forkserver, engine workers) until none is left
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, user, system = time.monotonic() - start, usage.ru_utime, usage.ru_stime
    print(f"{label} rc={rc} {wall:.1f} wall {user:.1f} user {system:.1f} sys {user + system:.1f} cpu")
    return rc


if __name__ == "__main__":
    sys.exit(main())
