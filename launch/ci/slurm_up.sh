#!/usr/bin/env bash
# A real one-host Slurm for CI: install slurm-wlm and munge (Debian, as root), write a slurm.conf for this
# host, start munged, slurmctld and slurmd, and wait until the node is idle. Running it again is a no-op
# once the node answers.
#
#   bash launch/ci/slurm_up.sh            # one node named after this host, all its CPUs
#   SLURM_NODES=2 bash launch/ci/slurm_up.sh   # two slurmd on this host (nodes n1, n2) for multi-node jobs
#
# The container has no systemd and maybe no writable cgroups: processes are tracked by /proc
# (proctrack/linuxproc), and finished jobs are recorded by jobcomp/filetxt, which `sacct -c` reads
# (sacct's own accounting needs slurmdbd and a database). Stop everything with launch/ci/slurm_down.sh.
set -euo pipefail
NUM_NODES=${SLURM_NODES:-1}
ROOT=${SLURM_CI_ROOT:-/var/spool/rlrun-slurm}
CONF_DIR=/etc/slurm
HOST=$(hostname -s)
CPUS=$(env -u OMP_NUM_THREADS nproc)  # nproc honours OMP_NUM_THREADS, which the test stages set to 1
MEM_MB=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

node_names() {
  if ((NUM_NODES == 1)); then echo "$HOST"; else for i in $(seq 1 "$NUM_NODES"); do echo "n$i"; done; fi
}

if sinfo -h -o '%T' 2>/dev/null | grep -q idle && [[ $(sinfo -h -N -o '%N' | sort -u | wc -l) == "$NUM_NODES" ]]; then
  echo "slurm: already up ($(sinfo -h -N -o '%N %T' | tr '\n' ' '))"
  exit 0
fi

mkdir -p "$ROOT/ctld" "$ROOT/log" "$CONF_DIR"
if ((NUM_NODES == 1)); then
  NODE_LINES="NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
else
  # Several slurmd on one host: each node has its own name, port and spool; all resolve to this host.
  # Each is given all the host's CPUs (a job asks for a node's CPUs), so the nodes share them.
  NODE_LINES="NodeName=n[1-$NUM_NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001-$((17000 + NUM_NODES))"
  NODE_LINES+=" CPUs=$CPUS RealMemory=$((MEM_MB / NUM_NODES)) State=UNKNOWN"
fi

cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by launch/ci/slurm_up.sh for a one-host CI Slurm.
ClusterName=rlrunci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$ROOT/ctld
SlurmdSpoolDir=$ROOT/d-%n
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
GresTypes=gpu
KillWait=30
MinJobAge=3600
InactiveLimit=0
SlurmdTimeout=60
$NODE_LINES
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
echo "$CONF_DIR/slurm.conf written: $(node_names | tr '\n' ' ')($CPUS CPUs each)"

# munged: the key comes with the package; run it as root when there is no munge user session.
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
if ! munge -n </dev/null >/dev/null 2>&1; then
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- munged
  else
    munged --force
  fi
fi

# Start from a clean daemon state: a previous partial start may hold the ports.
for pidfile in "$ROOT"/slurmctld.pid "$ROOT"/slurmd-*.pid; do
  [[ -f $pidfile ]] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then kill "$pid"; fi
  rm -f "$pidfile"
done
sleep 1

slurmctld -c
for node in $(node_names); do
  mkdir -p "$ROOT/d-$node"
  if ((NUM_NODES == 1)); then slurmd; else slurmd -N "$node"; fi
done

for _ in $(seq 1 60); do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l)
  if [[ $idle == "$NUM_NODES" ]]; then
    echo "slurm: up ($(sinfo -h -N -o '%N %T' | tr '\n' ' '))"
    exit 0
  fi
  sleep 1
done
echo "slurm: nodes not idle after 60 s:" >&2
sinfo -N -l >&2 || true
tail -n 20 "$ROOT"/log/*.log >&2 || true
exit 1
