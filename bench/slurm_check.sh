#!/usr/bin/env bash
# hardy's Slurm script under a real Slurm, on this one machine (issue 23; not part of `make test`):
#   1. install Debian's slurm-wlm and munge, start munged, slurmctld and slurmd (one node, this host)
#   2. `hardy launch --slurm` writes the sbatch script for a short 2-process CPU run
#   3. sbatch it, wait for the job, and check that the run finished every step with a final checkpoint
# Needs root (apt-get, the daemons). Prints one line per stage and `slurm check: ok` at the end.
#
#   bash bench/slurm_check.sh            (from the repository root, after `make install`)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-$REPO/.venv/bin/python}
RUN=${RUN_DIR:-$REPO/runs/slurm-check}
say() { echo "[slurm_check] $*"; }

say "installing slurm-wlm and munge (Debian packages)"
if ! command -v slurmctld >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

say "munge: key and daemon"
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null; then mungekey --create --force; else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force
munge -n | unmunge >/dev/null

say "slurm.conf for one node ($(hostname -s))"
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
CONF_DIR=/etc/slurm
mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > "$CONF_DIR/slurm.conf" <<EOF
ClusterName=hardy-check
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=check Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
pkill -x slurmctld 2>/dev/null || true
pkill -x slurmd 2>/dev/null || true
sleep 1
slurmctld -c  # a clean state: no jobs from an earlier try
slurmd
for _ in $(seq 60); do
  state=$(sinfo -h -o %T 2>/dev/null | head -n 1 || true)
  [ "$state" = idle ] && break
  sleep 1
done
say "node state: ${state:-unknown}"
[ "$state" = idle ] || { echo "slurm check: FAILED (the node never became idle)"; exit 1; }

say "hardy launch --slurm: the sbatch script"
rm -rf "$RUN"
"$PY" -m hardy launch --slurm --nodes 1 --nproc 2 --max-restarts 1 configs/tiny-cpu.toml --run-dir "$RUN" \
  --set train.steps=30 --set checkpoint.interval=10 --set checkpoint.at_end=true --set log.every=10 \
  --set log.progress=false --set data.seq_len=64 --set model.preset=micro
job=$(sbatch --parsable "$RUN/sbatch.sh")
say "submitted job $job; waiting"
for _ in $(seq 600); do
  squeue -h -j "$job" 2>/dev/null | grep -q . || break
  sleep 1
done
state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
say "job $job: ${state:-gone from the controller}"
cat "$RUN"/slurm-"$job".out | tail -n 12
"$PY" - "$RUN" <<'PYEOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
assert summary["steps"] == 30 and summary["checkpoint"], summary
assert (Path(summary["checkpoint"]) / "COMPLETE").exists()
print(f"[slurm_check] run finished: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
      f"checkpoint {Path(summary['checkpoint']).name}")
PYEOF
echo "slurm check: ok"
