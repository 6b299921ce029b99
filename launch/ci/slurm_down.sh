#!/usr/bin/env bash
# Stop the daemons launch/ci/slurm_up.sh started (by their pid files; munged too), cancelling any jobs first.
set -euo pipefail
ROOT=${SLURM_CI_ROOT:-/var/spool/rlrun-slurm}
if command -v scancel >/dev/null 2>&1 && squeue -h >/dev/null 2>&1; then
  scancel --user="$(id -un)" || true
fi
for pidfile in "$ROOT"/slurmd-*.pid "$ROOT"/slurmctld.pid; do
  [[ -f $pidfile ]] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then kill "$pid"; fi
  rm -f "$pidfile"
done
# munged last (the daemons above authenticate through it); slurm_up.sh starts it again
if [[ -f /run/munge/munged.pid ]] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
  kill "$(cat /run/munge/munged.pid)"
fi
echo "slurm: stopped"
