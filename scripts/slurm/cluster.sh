#!/usr/bin/env bash
# A throwaway Slurm cluster for tests and demos, everything under one scratch folder: one node, or
# CLUSTER_NODES=N nodes n1..nN on this one machine (one slurmd each, `slurmd -N nI`, each on its own port).
#
#   scripts/slurm/cluster.sh up     <scratch_dir>   # munged + slurmctld + slurmd(s), waits until every node is idle
#   scripts/slurm/cluster.sh status <scratch_dir>   # daemons alive? sinfo
#   scripts/slurm/cluster.sh down   <scratch_dir>   # stops the daemons by the pids in their pid files
#   scripts/slurm/cluster.sh env    <scratch_dir>   # prints `export SLURM_CONF=...` (eval it to use sbatch etc.)
#
# Needs root and Debian's `slurmctld slurmd slurm-client munge` (scripts/ci_install_slurm.sh installs them).
# No systemd, no cgroups, no accounting (sacct is off: use `scontrol show job`, `sbatch --wait`, squeue).
# The node declares CLUSTER_CPUS CPUs (default 16, more than the cores: SlurmdParameters=config_overrides) so
# that jobs with more ranks than cores start; the partition has OverSubscribe=FORCE:4.
# Ports: CLUSTER_CTLD_PORT / CLUSTER_SLURMD_PORT (one node), else free ports are picked (one per slurmd).
# Several nodes on one machine: their jobs' processes all run here; a multi-node `mpirun` inside the allocation
# starts one prted per node through srun, as on a real cluster.
# SlurmdTimeout (CLUSTER_SLURMD_TIMEOUT, default 30 s; Slurm's default 300 s): how long a node whose slurmd is gone
# stays in its jobs' allocations before slurmctld marks it down.
# cred_expire (CLUSTER_CRED_EXPIRE, default 5 s; Slurm default 120 s) is also how long a requeued job waits
# before it may start again.
# Clients need SLURM_CONF=<scratch_dir>/slurm.conf (see `env`).
# Isolated nodes (nanotron_recover.testbed.isolated_nodes: each node its own namespaces and address): with
# CLUSTER_NODE_PREFIX=10.213.<bed>. node nI is NodeHostname nI at <prefix>I, slurmctld listens on the host's bridge
# address CLUSTER_CTLD_ADDR, and CLUSTER_SLURMD_IN names the command that runs a command inside a node (each slurmd
# then lives in its node: `... exec <bed> nI -- slurmd ...`). Their pid files hold pids of the nodes' namespaces:
# `down` leaves the slurmds to the bed's teardown, which ends every process of a node.
set -euo pipefail

usage() { echo "usage: $0 up|down|status|env <scratch_dir>" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
scratch=$(mkdir -p "$2" && cd "$2" && pwd)
conf=$scratch/slurm.conf
export SLURM_CONF=$conf
PY=${PYTHON:-python3}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

pid_alive() {  # pid_alive <pidfile>
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

write_conf() {
    local host ctld_port slurmd_port cpus
    host=$(hostname -s)
    ctld_port=${CLUSTER_CTLD_PORT:-$(free_port)}
    slurmd_port=${CLUSTER_SLURMD_PORT:-$(free_port)}
    cpus=${CLUSTER_CPUS:-16}
    mkdir -p "$scratch"/{state,spool,log,run}
    local nodes=${CLUSTER_NODES:-1} node_lines partition_nodes i
    if (( nodes > 1 )); then
        node_lines=""
        for i in $(seq 1 "$nodes"); do
            mkdir -p "$scratch/spool/n$i"
            if [[ -n ${CLUSTER_NODE_PREFIX:-} ]]; then
                node_lines+="NodeName=n$i NodeHostname=n$i NodeAddr=${CLUSTER_NODE_PREFIX}$i Port=$(free_port) CPUs=$cpus RealMemory=1 State=UNKNOWN"$'\n'
            else
                node_lines+="NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus RealMemory=1 State=UNKNOWN"$'\n'
            fi
        done
        partition_nodes="n[1-$nodes]"
        slurmd_files="SlurmdSpoolDir=$scratch/spool/%n
SlurmdPidFile=$scratch/run/slurmd-%n.pid
SlurmdLogFile=$scratch/log/slurmd-%n.log"
    else
        node_lines="NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1 State=UNKNOWN"
        partition_nodes=$host
        slurmd_files="SlurmdSpoolDir=$scratch/spool
SlurmdPidFile=$scratch/run/slurmd.pid
SlurmdLogFile=$scratch/log/slurmd.log"
    fi
    cat >"$conf" <<EOF
# written by scripts/slurm/cluster.sh: a throwaway cluster on one machine
ClusterName=recover
SlurmctldHost=$host${CLUSTER_CTLD_ADDR:+($CLUSTER_CTLD_ADDR)}
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$scratch/munge/munge.sock,cred_expire=${CLUSTER_CRED_EXPIRE:-5}
StateSaveLocation=$scratch/state
SlurmctldPidFile=$scratch/run/slurmctld.pid
SlurmctldLogFile=$scratch/log/slurmctld.log
$slurmd_files
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=${CLUSTER_SLURMD_TIMEOUT:-30}
$node_lines
PartitionName=debug Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

start_munge() {
    local m=$scratch/munge
    mkdir -p "$m/key" "$m/log"
    if [[ ! -s $m/key/munge.key ]]; then
        head -c 1024 /dev/urandom >"$m/key/munge.key"
    fi
    chown -R munge:munge "$m"
    chmod 0755 "$m"            # socket dir: clients must reach it
    chmod 0700 "$m/key" "$m/log"
    chmod 0400 "$m/key/munge.key"
    runuser -u munge -- munged --force \
        --key-file="$m/key/munge.key" --socket="$m/munge.sock" \
        --pid-file="$m/log/munged.pid" --log-file="$m/log/munged.log" --seed-file="$m/log/munged.seed"
}

wait_idle() {  # every node idle (or mixed)
    local i states want=${CLUSTER_NODES:-1}
    for i in $(seq 1 300); do
        states=$(sinfo -h -N -o '%T' 2>/dev/null || true)
        if [[ -n $states ]] && (( $(grep -c -E '^(idle|mixed)' <<<"$states") == want )); then
            echo "slurm cluster up in $scratch ($want node(s): $(tr '\n' ' ' <<<"$states"))"
            return 0
        fi
        sleep 0.1
    done
    echo "slurm node did not become idle; logs in $scratch/log" >&2
    tail -n 20 "$scratch"/log/*.log >&2 || true
    return 1
}

cmd_up() {
    [[ $(id -u) -eq 0 ]] || { echo "cluster.sh up needs root" >&2; exit 1; }
    for bin in munged slurmctld slurmd sinfo; do
        command -v "$bin" >/dev/null || { echo "$bin not found: run scripts/ci_install_slurm.sh" >&2; exit 1; }
    done
    if pid_alive "$scratch/run/slurmctld.pid"; then
        echo "already up in $scratch" && return 0
    fi
    # munge runs as its own user: it must be able to walk into the scratch folder
    chmod 0755 "$scratch"
    if ! runuser -u munge -- test -x "$scratch"; then
        echo "the munge user cannot reach $scratch (a parent folder is not world-executable)" >&2; exit 1
    fi
    write_conf
    start_munge
    slurmctld -f "$conf" -i -c
    local nodes=${CLUSTER_NODES:-1} i
    if (( nodes > 1 )); then
        for i in $(seq 1 "$nodes"); do
            # shellcheck disable=SC2086 # CLUSTER_SLURMD_IN is a command line
            ${CLUSTER_SLURMD_IN:+$CLUSTER_SLURMD_IN n$i --} slurmd -f "$conf" -N "n$i"
        done
    else
        slurmd -f "$conf"
    fi
    wait_idle
}

stop_pidfiles() {  # stop_pidfiles <pidfile>...: SIGTERM them all, wait up to 5 s, SIGKILL what is left
    local pidfile pid i alive pids=()
    for pidfile in "$@"; do
        [[ -s $pidfile ]] || continue
        pid=$(cat "$pidfile")
        kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
        rm -f "$pidfile"
    done
    for i in $(seq 1 50); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [[ $alive -eq 0 ]] && return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then echo "pid $pid ignored SIGTERM: SIGKILL" >&2; kill -KILL "$pid" 2>/dev/null || true; fi
    done
}

cmd_down() {
    # by the pids in the daemons' own pid files, never by name; an isolated node's slurmd ends with its node
    if [[ -n ${CLUSTER_SLURMD_IN:-} ]]; then
        stop_pidfiles "$scratch/run/slurmctld.pid" "$scratch/munge/log/munged.pid"
        rm -f "$scratch"/run/slurmd*.pid
    else
        stop_pidfiles "$scratch"/run/slurmd*.pid "$scratch/run/slurmctld.pid" "$scratch/munge/log/munged.pid"
    fi
    echo "slurm cluster in $scratch down"
}

cmd_status() {
    local rc=0 name file slurmds
    slurmds=("$scratch"/run/slurmd*.pid)
    [[ -e ${slurmds[0]} ]] || slurmds=("$scratch/run/slurmd.pid")
    for file in "$scratch/munge/log/munged.pid" "$scratch/run/slurmctld.pid" "${slurmds[@]}"; do
        name=$(basename "$file" .pid)
        if pid_alive "$file"; then echo "$name: running (pid $(cat "$file"))"; else echo "$name: stopped"; rc=1; fi
    done
    [[ $rc -eq 0 ]] && sinfo
    return $rc
}

case $action in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$conf" ;;
    *) usage ;;
esac
