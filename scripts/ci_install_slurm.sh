#!/usr/bin/env bash
# Install Debian's Slurm + munge for tests/slurm (a throwaway cluster of one or more nodes on this machine, see
# scripts/slurm/cluster.sh).
# Idempotent and quiet; needs root (CI runs as root on a fresh Debian machine). No daemon is started here.
set -euo pipefail
packages=(slurmctld slurmd slurm-client munge)
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "ci_install_slurm.sh: needs root to apt-get install ${packages[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${packages[@]}" >/dev/null
# (a daemon the packages may start is harmless: the tests run their own on free ports and a private munge socket)
echo "ci_install_slurm.sh: installed ${packages[*]} ($(slurmctld -V))"
