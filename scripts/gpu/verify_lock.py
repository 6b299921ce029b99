"""Print every package of a lock whose installed version differs (or is missing); exit 1 if any does.

python3 scripts/gpu/verify_lock.py requirements/gpu-py312.txt
"""

from __future__ import annotations

import re
import sys
from importlib import metadata


def main(lock: str) -> int:
    wrong = []
    for line in open(lock):
        match = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if match is None:
            continue
        name, want = match[1], match[2]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "missing"
        if have.split("+")[0] != want.split("+")[0]:
            wrong.append(f"{name}: lock {want}, installed {have}")
    print("\n".join(wrong) or f"every package of {lock} is installed at its locked version")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
