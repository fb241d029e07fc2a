#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up (idempotent), then pytest on 1, 2 and
# 4 MPI ranks (oversubscribed). Prints one closing line "N passed, M failed, K skipped"
# summed over all rank counts (rank 0's view), and exits non-zero on any failure.
#
#   bash scripts/run_tests.sh                 # everything
#   NPS="1 2" bash scripts/run_tests.sh       # only 1 and 2 ranks
#   NP1_PARTS=3 bash scripts/run_tests.sh     # the 1-rank pass as 3 pytest processes (default 2)
#   bash scripts/run_tests.sh -k fft          # extra pytest arguments
#   FLOWPM_MTF_STACK=tf2.12 bash scripts/run_tests.sh   # on the previous stack, TensorFlow 2.12
#   bash scripts/run_tests.sh --quick         # work in progress: a chosen subset on 1 and 2
#                                             # ranks, < 5 min (QUICK_TESTS below; docs/testing.md)
#   bash scripts/run_tests.sh --quick -k fft  # the subset, filtered further
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1

QUICK=0
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then QUICK=1; else args+=("$a"); fi
done
set -- "${args[@]}"
# --quick: every layer once, on 1 and 2 ranks; what it leaves out is listed in
# docs/testing.md ("Quick mode"). Whole test functions (all their parameters for the
# world size), so that a renamed test fails the run ("not found") instead of silently
# dropping out. Keep the list in step with that page.
QUICK_TESTS=(
  # Mesh TF backend: data movement and collectives against PlacementMeshImpl, gradients
  tests/test_backend.py::test_import_export_and_relayouts_exact
  tests/test_backend.py::test_allreduce_sum_max_min
  tests/test_backend.py::test_allconcat_alltoall_direct
  tests/test_backend.py::test_receive_and_shift_direct
  tests/test_backend.py::test_gradients_through_collectives
  # distributed FFT against numpy, its adjoint, finite differences of its gradient
  tests/test_fft.py::test_fft_matches_numpy
  tests/test_fft.py::test_adjoint_and_explicit_gradients
  tests/test_fft.py::test_finite_difference_gradients
  # halo exchange: exact on integer fields, fill/reduce adjoint, only halo bytes move
  tests/test_halo.py::test_blocks_and_halo_exact_on_arange
  tests/test_halo.py::test_fill_and_reduce_are_adjoint
  tests/test_halo.py::test_only_halo_bytes_move
  # CIC paint/readout against FlowPM, their adjoint, finite differences of the positions'
  # gradient; the native CIC op against its TensorFlow path (1 rank)
  tests/test_painting.py::test_matches_flowpm
  tests/test_painting.py::test_paint_readout_adjoint
  tests/test_painting.py::test_position_gradients_finite_difference
  tests/test_cic_native.py::test_native_equals_tensorflow_path
  # particle migration: exact, overflow seen by every rank, its gradient
  tests/test_domain.py::test_migration_exact
  tests/test_domain.py::test_overflow_detected_on_every_rank
  tests/test_domain.py::test_migration_gradient
  # initial conditions and LPT against FlowPM / numpy
  tests/test_ics.py::test_decomposition_independent
  tests/test_lpt.py::test_lpt1_matches_flowpm
  tests/test_lpt.py::test_lpt2_matches_flowpm
  # N-body (1LPT + 3 KDK steps) against FlowPM
  tests/test_nbody.py::test_nbody_1lpt_matches_flowpm
  # configuration, CLI and layout errors
  tests/test_config.py
  tests/test_layout_errors.py
  tests/test_cli.py::test_parsers
  tests/test_cli.py::test_grid_not_matching_rank_count_fails_clearly
)
# Parameters left out of the functions above (node id prefixes, pytest --deselect): dtypes
# and halo widths that run the same code as the ones kept; the meshes are all kept.
QUICK_DESELECT=(
  "tests/test_backend.py::test_import_export_and_relayouts_exact["{int32,int64,float32,complex128}-
  "tests/test_backend.py::test_allreduce_sum_max_min["{int32,float32}-
  "tests/test_backend.py::test_allconcat_alltoall_direct[float64-"
  "tests/test_backend.py::test_receive_and_shift_direct["{int64,bool}-
  "tests/test_halo.py::test_blocks_and_halo_exact_on_arange[int32-"
  "tests/test_halo.py::test_fill_and_reduce_are_adjoint[2-"
)
# The 4-rank pass runs only what needs 4 ranks: a 2x2 grid (both mesh axes split at once:
# corners, two sub-communicators per rank, 2D pencils) or a process set of 4. Everything
# else runs on 1 and 2 ranks, where each axis is split on its own (2x1, 1x2). A test file
# that needs 4 ranks goes on this list (docs/testing.md, "Which tests run on 4 ranks").
FOUR_RANK_TESTS=(
  tests/test_horovod_runtime.py  # process sets from the Cartesian sub-communicators of 2x2
  tests/test_backend.py          # every collective on (4,), (2, 2), (2, 1, 2)
  tests/test_layout_errors.py    # layouts that do not fit a 2x2 / 4-rank mesh
  tests/test_fft.py              # pencil FFT with both transposes distributed
  tests/test_radial_filter.py    # the half spectrum with ky and kz both split
  tests/test_halo.py             # corner cells: the diagonal neighbour's halo
  tests/test_domain.py           # migration across both axes (diagonal moves)
  tests/test_painting.py         # CIC paint/readout across block corners
  tests/test_lensing_fullsky.py  # HEALPix shells painted on a 2x2 grid, all-reduced
  tests/test_noise.py            # white noise independent of the decomposition
  tests/test_ics.py
  tests/test_lpt.py              # 2LPT: mixed second differences read corner halos
  tests/test_power.py            # P(k) shell sums reduced over both axes
  tests/test_nbody.py            # the forward model on 2x2 against one processor's
  tests/test_adjoint.py          # the adjoint gradient on 2x2
  tests/test_lensing.py          # lens planes reduced over both axes
  tests/test_pgd.py              # PGD's potential gradient and readout across block corners
  tests/test_mri_conv.py         # 3D convolution halos with corners (imaging)
  tests/test_mri_sense.py        # SENSE and TV-SENSE with x and y both split; x and the coils
  tests/test_h5dist.py           # per-rank parts of a 2x2 / 4x1 grid in one file
  tests/test_checkpoint.py       # a 4-rank checkpoint read back on another grid
  tests/test_fof.py              # FoF groups across the corner of 4 blocks (2x2 ghosts)
  tests/test_gadget4.py          # Gadget-4 files of a 2x2 grid read by yt and pynbody
)
# The 1-rank pass's pytest processes side by side (below); 1 to 8.
NP1_PARTS="${NP1_PARTS:-2}"
if ! [[ "$NP1_PARTS" =~ ^[1-8]$ ]]; then
  echo "NP1_PARTS must be 1 to 8, not '$NP1_PARTS'"; exit 2
fi
bash scripts/setup_env.sh || { echo "setup failed"; exit 1; }
# shellcheck disable=SC1091  # functions only: mpirun_options, stack_venv
source scripts/launch_lib.sh
# the stack's venv (FLOWPM_MTF_STACK, docs/setup.md), unless VENV is set
VENV="${VENV:-$(stack_venv "$REPO")}" || exit 1
# shellcheck disable=SC1091
source "$VENV/bin/activate"

if [ $QUICK = 1 ]; then
  NPS="${NPS:-1 2}"
  # its own directory: a quick run keeps the last full run's logs
  LOGDIR="${FLOWPM_MTF_TEST_LOGDIR:-$REPO/test-logs/quick}"
else
  NPS="${NPS:-1 2 4}"
  LOGDIR="${FLOWPM_MTF_TEST_LOGDIR:-$REPO/test-logs}"
fi
export FLOWPM_MTF_TEST_LOGDIR="$LOGDIR"
rm -rf "$LOGDIR"; mkdir -p "$LOGDIR"
# References that every pass computes from the same inputs (FlowPM, a 1-processor mesh; the
# keyed ones of tests/world_share.py): the first pass computes them, the later passes load
# them. A directory of this run only: removed at its end.
FLOWPM_MTF_TEST_REFERENCES="$(mktemp -d "${TMPDIR:-/tmp}/flowpm_mtf_test_references.XXXXXX")"
export FLOWPM_MTF_TEST_REFERENCES
trap 'rm -rf "$FLOWPM_MTF_TEST_REFERENCES"' EXIT
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# Native ops must be built by set-up and used: a missing or stale library fails the
# tests instead of silently falling back to the TensorFlow path.
export FLOWPM_MTF_NATIVE=require
# A collective that one rank never joins shows up in the logs after 60 s.
export HOROVOD_STALL_CHECK_TIME_SECONDS=60

# Byte-compile our packages and tests once: every test process and every job a test starts
# imports them, and with PYTHONDONTWRITEBYTECODE=1 (set on some CI machines) or a fresh
# clone each would compile ~30,000 lines again (~0.3 s of CPU apiece, hundreds of them).
python -m compileall -q -j 0 flowpm_mtf hvd_mesh_impl mri_mtf flowpm_bench tests scripts \
  _flowpm_mtf_startup.py >/dev/null || true

mapfile -t MPI_OPTS < <(mpirun_options local)
MPIRUN=(mpirun "${MPI_OPTS[@]}")
# --durations: every log names its slowest tests (where the suite's time goes)
if [ $QUICK = 1 ]; then
  PYTEST_ARGS=("${QUICK_TESTS[@]}" "${QUICK_DESELECT[@]/#/--deselect=}" -q -p no:randomly
               --timeout 300 --timeout-method=thread --durations=10 "$@")
else
  PYTEST_ARGS=(tests -q -p no:randomly --timeout 600 --timeout-method=thread --durations=15 "$@")
fi

status=0
for np in $NPS; do
  echo "================ pytest on $np rank(s) ================"
  # The per-job limit turns a hang into a failure instead of a stuck CI run (a test
  # that hangs is stopped after 600 s by pytest-timeout first). 2700 s: the longest
  # pass with room for the slower machines of this kind (docs/testing.md).
  if [ "$np" = 1 ] && [ $QUICK = 1 ]; then
    # one process: the subset is small (np1_rank0.xml)
    timeout 900 python scripts/mpi_pytest.py "${PYTEST_ARGS[@]}"
    rc=$?
  elif [ "$np" = 1 ]; then
    # No launcher. NP1_PARTS pytest processes side by side (default 2, one per core of a
    # small machine; a third cost ~10 % more CPU and wall than it saved, docs/testing.md):
    # each collects every test and runs the test files it claims first from a directory
    # they share, the longest files first (tests/file_queue.py, tests/file_costs.tsv), so
    # that they end together. The other parts print their reports after part a's.
    queue="$(mktemp -d "${TMPDIR:-/tmp}/flowpm_mtf_test_queue.XXXXXX")"
    parts=(a b c d e f g h)
    parts=("${parts[@]:0:$NP1_PARTS}")
    other_pids=()
    for part in "${parts[@]:1}"; do
      FLOWPM_MTF_TEST_QUEUE="$queue" FLOWPM_MTF_TEST_PART=$part timeout 2700 \
        python scripts/mpi_pytest.py "${PYTEST_ARGS[@]}" > "$LOGDIR/np1_$part.out" 2>&1 &
      other_pids+=($!)
    done
    FLOWPM_MTF_TEST_QUEUE="$queue" FLOWPM_MTF_TEST_PART=a timeout 2700 \
      python scripts/mpi_pytest.py "${PYTEST_ARGS[@]}"
    rc=$?
    for i in "${!other_pids[@]}"; do
      wait "${other_pids[$i]}"
      rc_other=$?
      part="${parts[$((i + 1))]}"
      echo "---------------- 1 rank: the files of process $part ----------------"
      cat "$LOGDIR/np1_$part.out"
      if [ $rc -eq 0 ]; then rc=$rc_other; fi
    done
    rm -rf "$queue"
  elif [ "$np" = 4 ] && [ $QUICK = 0 ]; then
    timeout 2700 "${MPIRUN[@]}" -np 4 python scripts/mpi_pytest.py "${FOUR_RANK_TESTS[@]}" \
      "${PYTEST_ARGS[@]:1}"
    rc=$?
  else
    timeout 2700 "${MPIRUN[@]}" -np "$np" python scripts/mpi_pytest.py "${PYTEST_ARGS[@]}"
    rc=$?
  fi
  if [ $rc -ne 0 ]; then
    status=1
    echo "---- $np rank(s): exit code $rc; tails of the other ranks' logs:"
    for f in "$LOGDIR"/np"${np}"_rank*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 30 "$f"; }; done
  fi
done

python - "$LOGDIR" "$NPS" "$QUICK" "$NP1_PARTS" <<'PY'
import glob, os, sys
import xml.etree.ElementTree as ET
logdir, nps, quick = sys.argv[1], sys.argv[2].split(), sys.argv[3] == "1"
n_parts = int(sys.argv[4])
tot = dict(tests=0, failures=0, errors=0, skipped=0)
for np_ in nps:
    # one file per rank count; the 1-rank job's parts have one each (not in --quick)
    paths = (sorted(glob.glob(os.path.join(logdir, "np1_rank0_?.xml")))
             if np_ == "1" and not quick else [os.path.join(logdir, "np%s_rank0.xml" % np_)])
    if np_ == "1" and not quick and len(paths) != n_parts:
        print("results of %d of the %d 1-rank processes" % (len(paths), n_parts))
        tot["errors"] += 1
    for path in paths:
        if not os.path.exists(path):
            print("no results in %s" % os.path.basename(path)); tot["errors"] += 1; continue
        for suite in ET.parse(path).getroot().iter("testsuite"):
            for k in tot:
                tot[k] += int(suite.get(k, 0))
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print("summed over %s rank(s), rank 0's view%s:" % ("/".join(nps), ", --quick subset" if quick else ""))
print("total: %d passed, %d failed, %d skipped"
      % (passed, tot["failures"] + tot["errors"], tot["skipped"]))
PY
exit $status
