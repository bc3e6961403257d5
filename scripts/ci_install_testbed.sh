#!/usr/bin/env bash
# Install what the isolated-node test bed needs (nanotron_recover.testbed.isolated_nodes, tests/testbed): namespaces
# (unshare, nsenter: util-linux; mount: mount), a bridge and veth pairs (ip: iproute2), hostname. Debian ships them
# in its base system, but a slim image may lack iproute2.
# Idempotent and quiet; needs root to install (CI runs as root on a fresh Debian machine: .ci/run calls it); starts nothing.
set -euo pipefail
packages=(util-linux mount iproute2 hostname)
if command -v unshare >/dev/null && command -v nsenter >/dev/null && command -v mount >/dev/null \
        && command -v ip >/dev/null && command -v hostname >/dev/null; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "ci_install_testbed.sh: needs root to apt-get install ${packages[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${packages[@]}" >/dev/null
echo "ci_install_testbed.sh: installed ${packages[*]}"
