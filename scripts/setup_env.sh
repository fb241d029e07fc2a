#!/usr/bin/env bash
# Idempotent set-up of everything this package needs on a fresh Debian machine:
# OpenMPI (apt), a Python virtualenv, the pinned stack, Horovod built from source with
# MPI + Gloo and our patches (patches/), and this package in editable mode.
# A second run with nothing to do takes a few seconds.
#
# Environment:
#   FLOWPM_MTF_STACK=tf2.21  (default) TensorFlow 2.21.0, numpy 2, the newest of Python 3.13,
#                        3.12, 3.11 found, in .venv (docs/setup.md)
#   FLOWPM_MTF_STACK=tf2.12  the previous stack: TensorFlow 2.12.1, numpy 1.24, Python 3.11,
#                        in .venv-tf2.12
#   VENV=path            virtualenv location (default: <repo>/.venv, <repo>/.venv-tf2.12)
#   PYTHON=python3.X     interpreter used to create the venv (default: see above)
#   HOROVOD_GPU_OPERATIONS=NCCL  (optional) build Horovod for GPUs; see README
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { echo "[setup_env] $*" >&2; }
# shellcheck disable=SC1091  # functions only: stack_venv, stack_requirements, ...
source "$REPO/scripts/launch_lib.sh"
STACK="$(stack_name)" || exit 1
VENV="${VENV:-$(stack_venv "$REPO")}"
REQS="$(stack_requirements "$REPO")"
STAMP="$VENV/.flowpm_mtf_setup_ok"
# Horovod patches of this stack, in the order they apply (the last one sets the version).
HVD_PATCHES=("$REPO/patches/horovod-0.28.1-flowpm.patch")
if [ "$STACK" = tf2.21 ]; then
  HVD_PATCHES=("$REPO/patches/horovod-0.28.1-tf2.21.patch" "${HVD_PATCHES[@]}")
fi

# The interpreter of a new venv: PYTHON, else the newest of the stack's versions that runs
# with venv and ensurepip (pyenv's shims exist for versions that are not selected, and
# Debian's python3.X may lack venv: each candidate is run once). tf2.21: the registry has
# wheels of the whole stack for 3.11-3.13 and the suite passes on each (docs/setup.md).
pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local v p candidates
  if [ "$STACK" = tf2.21 ]; then candidates="3.13 3.12 3.11"; else candidates="3.11"; fi
  for v in $candidates; do
    for p in "python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v"; do
      if "$p" -c 'import venv, ensurepip' >/dev/null 2>&1; then echo "$p"; return; fi
    done
  done
  log "no usable Python for the $STACK stack: it needs one of ${candidates// /, } with venv" \
      "and ensurepip (Debian: apt-get install python3-venv), or PYTHON=/path/to/python"
  return 1
}

# Hash of the inputs that determine the environment: a change re-runs the pip steps.
inputs_hash() {
  cat "$REPO/scripts/setup_env.sh" "$REQS" "$REPO/setup.py" \
      "$REPO"/patches/*.patch 2>/dev/null | sha256sum | cut -c1-16
}

# ---------------------------------------------------------------- 1. system
need_apt=()
command -v mpicc >/dev/null 2>&1 || need_apt+=(libopenmpi-dev openmpi-bin)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++   >/dev/null 2>&1 || need_apt+=(g++)
[ -f /usr/include/fftw3.h ]        || need_apt+=(libfftw3-dev)  # native FFT op; mpi4py-fft (benchmark)
command -v shellcheck >/dev/null 2>&1 || need_apt+=(shellcheck) # tests/test_batch_scripts.py
# Not `ldconfig -p | grep -q`: under pipefail, grep -q exits at the first match and
# ldconfig's SIGPIPE (141) fails the pipeline (~1 run in 200 here): a present library
# read as missing, an apt-get that collides with another's lock (CI of 090a9ea).
grep -q libtcmalloc_minimal.so.4 <<<"$(ldconfig -p 2>/dev/null)" \
  || need_apt+=(libtcmalloc-minimal4)                          # default host allocator (flowpm_mtf/allocator.py)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
    log "missing system packages: ${need_apt[*]}; install them (needs root) and re-run"; exit 1
  fi
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "installing system packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Slurm 22.05 + munge for tests/test_slurm.py, which starts a private one-node cluster
# (its own config, key and ports; the packages' system services are not used). Optional:
# only as root; without them those tests are skipped with the reason.
have_slurm() { for b in slurmctld slurmd sbatch srun munged; do command -v "$b" >/dev/null || return 1; done; }
if [ "$(id -u)" -eq 0 ] && ! have_slurm; then
  log "installing Slurm and munge (tests/test_slurm.py)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; } \
    || log "could not install Slurm: tests/test_slurm.py will be skipped"
fi

# Native CPU ops (flowpm_mtf/native/*.cc, e.g. the FFTW FFT): compiled against this
# venv's TensorFlow; a stamp per library makes this a no-op (well under a second)
# when sources and TensorFlow are unchanged. Runs on every set-up, also when the
# rest is up to date.
build_native() {
  (cd "$REPO" && "$VENV/bin/python" -m flowpm_mtf.native.build) \
    || { log "building the native ops failed (g++ and libfftw3-dev are needed)"; exit 1; }
}

# ---------------------------------------------------------------- 2. venv
# startup_hook_ok: the start-up file of setup.py (flowpm_mtf_startup.pth) ran in a fresh
# interpreter (no TensorFlow import): without it the editable install below runs again.
startup_hook_ok() {
  (cd / && "$VENV/bin/python" -c "import _flowpm_mtf_startup as s; assert s.installed()") 2>/dev/null
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(inputs_hash)" ] \
   && "$VENV/bin/python" -c "import flowpm_mtf, hvd_mesh_impl, horovod.tensorflow, mesh_tensorflow, flowpm_bench" 2>/dev/null \
   && startup_hook_ok; then
  build_native
  log "environment up to date: $VENV"
  exit 0
fi
# The pinned stack takes ~2.1 GB in the venv, plus the Horovod build in $TMPDIR: say so
# before pip fails half-way with "No space left on device" (seen once on a CI machine).
need_mb=3000
mkdir -p "$(dirname "$VENV")"
free_mb="$(df -Pm "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')"
if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ] && [ ! -f "$STAMP" ]; then
  log "not enough disk space: the environment needs ~${need_mb} MB in $(dirname "$VENV")," \
      "${free_mb} MB free (set VENV=path elsewhere)"
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  PY="$(pick_python)" || exit 1
  log "creating $VENV ($STACK stack, $("$PY" -c 'import sys; print("Python %d.%d.%d" % sys.version_info[:3])'))"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip<25" "setuptools<70" wheel

# ---------------------------------------------------------------- 3. pinned stack
log "installing pinned Python packages ($(basename "$REQS"))"
"${PIP[@]}" install -q -r "$REQS"
if [ "$STACK" = tf2.21 ]; then
  # tensorflow-probability 0.25 imports tf_keras; tf-keras 2.21 requires the distribution
  # "tensorflow", which would install the full TensorFlow over tensorflow-cpu: without deps.
  "${PIP[@]}" install -q --no-deps "tf-keras==2.21.0"
  # pynbody 2.8.0 (a reader of the Gadget-4 snapshots in tests/test_gadget4.py) caps
  # scipy < 1.18 in its metadata, below this stack's scipy: without deps (it needs only
  # h5py, numpy, scipy and matplotlib, all in the stack; its Gadget reader works here).
  "${PIP[@]}" install -q --no-deps "pynbody==2.8.0"
  # nilearn 0.14.1 for the MNI152 template file in its wheel (imaging --volume mni152); its
  # dependencies (scikit-learn, pandas, joblib, lxml, requests) are never used here, and
  # Keras 3 imports scikit-learn whenever it is installed (a second per `import tensorflow`)
  "${PIP[@]}" install -q --no-deps "nilearn==0.14.1"
fi

# ---------------------------------------------------------------- 4. horovod
# Horovod 0.28.1 from its PyPI source with our patch (patches/horovod-0.28.1-flowpm.patch:
# the background thread's cycle re-anchored at the global synchronisation, so idle ranks
# stop busy-polling; the version it sets is HOROVOD_VERSION). The wheel is kept in
# HVD_WHEELS, keyed by what it is built against (the patch, the pins of the packages it
# compiles or links against: TensorFlow, numpy, mpi4py; the Python version, the GPU
# option), so a re-install does not rebuild, nor does a new test or benchmark package in
# the requirements.
HOROVOD_VERSION="$(sed -n "s/^+__version__ = '\(.*\)'$/\1/p" "${HVD_PATCHES[@]}")"
HVD_KEY="$(cat "${HVD_PATCHES[@]}" <(grep -E '^(tensorflow(-cpu)?|numpy|mpi4py)[=<>!~ ]' "$REQS") \
  <("$VENV/bin/python" -c 'import sys; print(sys.version)') \
  <(echo "${HOROVOD_GPU_OPERATIONS:-cpu}") | sha256sum | cut -c1-12)"
HVD_WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/flowpm-mtf/horovod-$HVD_KEY"
# The key of the wheel installed in this venv: a venv switched to another stack (another
# TensorFlow, whose ABI Horovod's ops are built against) gets the wheel of its new key.
HVD_INSTALLED="$VENV/.flowpm_mtf_horovod_key"
if [ "$(cat "$HVD_INSTALLED" 2>/dev/null)" != "$HVD_KEY" ] \
   || ! HOROVOD_VERSION="$HOROVOD_VERSION" "$VENV/bin/python" - <<'PY' 2>/dev/null
import os
import horovod, horovod.tensorflow as hvd
assert hvd.mpi_built() and hvd.gloo_built()
assert horovod.__version__ == os.environ["HOROVOD_VERSION"]
PY
then
  if ! ls "$HVD_WHEELS"/horovod-*.whl >/dev/null 2>&1; then
    hvd_t0=$SECONDS
    log "building horovod $HOROVOD_VERSION with MPI and Gloo (about 4 minutes on 2 cores; the wheel is kept in $HVD_WHEELS)"
    # Use the system cmake: the cmake 4.x wheel from PyPI breaks the gloo sub-build.
    "${PIP[@]}" uninstall -y -q cmake >/dev/null 2>&1 || true
    src="$(mktemp -d)"
    "${PIP[@]}" download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$src"
    tar -xzf "$src"/horovod-0.28.1.tar.gz -C "$src"
    for p in "${HVD_PATCHES[@]}"; do
      (cd "$src/horovod-0.28.1" && git apply "$p") \
        || { log "$(basename "$p") does not apply to the downloaded source"; exit 1; }
    done
    mkdir -p "$HVD_WHEELS"
    # TF 2.21's public XLA headers include HighwayHash and FarmHash by paths relative to
    # their own repositories, which tf.sysconfig does not report (as conda-forge's
    # horovod-feedstock build.sh); absent directories (TF 2.12) add nothing.
    tf_inc="$("$VENV/bin/python" -c 'import os, tensorflow as tf; print(os.path.join(tf.sysconfig.get_include(), "external"))' 2>/dev/null)"
    hvd_cxxflags="${CXXFLAGS:-}"
    for d in "$tf_inc/highwayhash" "$tf_inc/farmhash_archive/src"; do
      [ -d "$d" ] && hvd_cxxflags="$hvd_cxxflags -I$d"
    done
    CXXFLAGS="$hvd_cxxflags" HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    MAKEFLAGS="-j$(nproc)" \
      "${PIP[@]}" wheel -q --no-build-isolation --no-deps "$src/horovod-0.28.1" -w "$HVD_WHEELS"
    rm -rf "$src"
    log "horovod built in $((SECONDS - hvd_t0)) s"
  fi
  "${PIP[@]}" install -q --no-deps --force-reinstall "$HVD_WHEELS"/horovod-*.whl
  echo "$HVD_KEY" > "$HVD_INSTALLED"
fi

# ---------------------------------------------------------------- 5. this package
# Editable: flowpm_mtf, hvd_mesh_impl and flowpm_bench (the scripts' library) import from
# this checkout. setup.py is an input of the stamp's hash, so a new package re-runs this.
# Its develop command (re)writes site-packages/flowpm_mtf_startup.pth: Mesh TF imports in
# any order (hvd_mesh_impl/tf_compat.py).
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"

# ---------------------------------------------------------------- 6. verify
check="$("$VENV/bin/horovodrun" --check-build)"
grep -q "\[X\] MPI"  <<<"$check" || { log "horovod built without MPI";  echo "$check"; exit 1; }
grep -q "\[X\] Gloo" <<<"$check" || { log "horovod built without Gloo"; echo "$check"; exit 1; }
"$VENV/bin/python" -c "import flowpm_mtf, hvd_mesh_impl, horovod.tensorflow, mesh_tensorflow, flowpm, flowpm_bench, mpi4py"
# Mesh TF first, in a fresh interpreter outside the checkout: the start-up hook applies its
# TF >= 2.13 shims (README quick start order)
(cd / && "$VENV/bin/python" -c "import mesh_tensorflow") \
  || { log "import mesh_tensorflow fails in a fresh interpreter: flowpm_mtf_startup.pth" \
           "is missing from site-packages or does not run"; exit 1; }
build_native
inputs_hash > "$STAMP"
log "environment ready: $VENV"
