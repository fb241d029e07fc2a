"""Checkpoints of a job's state (every rank its slices), restart, and SIGTERM handling.

This module holds the SIGTERM handling (:class:`StopRequest`) and is the one name the
callers use (``checkpoint.save``, ``checkpoint.load``, ...): it re-exports the API of
its three parts.

* :mod:`flowpm_mtf.runs.checkpoint_identity`: what a checkpoint is: the layout of
  ``OUT/checkpoint/``, the manifest and the part files, the identity of the run a
  resume is checked against (:func:`identity`, :func:`check_identity`) and which
  checkpoints are complete (:func:`read_manifest`, :func:`candidates`);
* :mod:`flowpm_mtf.runs.checkpoint_save`: writing a checkpoint atomically (:func:`save`),
  with hard links of the outputs written before it; a crash at any moment leaves the
  previous checkpoint intact;
* :mod:`flowpm_mtf.runs.checkpoint_load`: resuming: :func:`verify_resume` (before any
  graph is built), :func:`load` (on the same grid bit for bit, or on another one),
  :func:`restore_outputs`, :func:`check_resume_config`, :func:`resume_hint`.

SIGTERM
-------
:class:`StopRequest` records SIGTERM (what Slurm sends before the time limit,
also ``scancel --signal=TERM``) and :meth:`StopRequest.agreed` makes all ranks
agree at a step boundary (one small allreduce): the signal may reach only some
ranks, or at different times, but every rank sees the same answer at the same
step, finishes that step, writes the checkpoint and exits 0 (a job that does not
checkpoint stops there with an error instead, see :mod:`flowpm_mtf.jobs.runner`).
A signal after the last step lets the run finish; the ``flowpm-mtf`` command
(``StopRequest(until_exit=True)``) then ignores SIGTERM until the process has
exited, so a rank shutting down is not ended by it (exit 0, not 143).
"""
import logging
import signal

from . import digest  # noqa: F401  (checkpoint.digest: the digests the manifests record)
from .checkpoint_identity import (  # noqa: F401  (re-exported: the checkpoint API)
    CHECKPOINT_DIR, FIELDS_GROUP, FORMAT, FORMAT_V1, LAYOUT_FIELDS, OUTPUTS_DIR,
    RESLICEABLE_FIELDS, STATE_NAMES, candidates, check_identity, checkpoint_root, config_hash,
    identity, read_manifest, state_config, step_dir)
from .checkpoint_load import (  # noqa: F401  (re-exported; the private ones for the tests)
    RANGE_MARGIN, _may_overlap, _read_file, _reslice, check_resume_config, load,
    restore_outputs, resume_command, resume_hint, verify_resume)
from .checkpoint_save import save  # noqa: F401  (re-exported)

__all__ = ["CHECKPOINT_DIR", "FORMAT", "LAYOUT_FIELDS", "checkpoint_root", "step_dir",
           "state_config", "config_hash", "identity", "check_identity", "verify_resume", "save",
           "candidates", "read_manifest", "load", "restore_outputs", "StopRequest",
           "check_resume_config", "resume_command", "resume_hint"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- SIGTERM
class StopRequest:
    """SIGTERM recorded on this rank, agreed on by all ranks at step boundaries.

    Parameters
    ----------
    comm : object
        mpi4py-like communicator (``allreduce``).
    signals : tuple of int
        Signals to catch (default SIGTERM).
    until_exit : bool
        The process ends after the block (the ``flowpm-mtf`` command): a block
        left without an exception leaves the signals **ignored** instead of
        restoring the previous handlers, so that a signal after the last step
        (the run complete, or stopped after its checkpoint) cannot kill the rank
        while it shuts down (Horovod, MPI, the interpreter: about a second) and
        make ``mpirun`` report "exited on signal 15" (exit 143). Ignored, not
        caught: Python resets the handlers it called to the default action
        while it finalizes, an ignored signal stays ignored. A block left by an
        exception restores the previous handlers (the failing rank stays
        killable).

    Attributes
    ----------
    received : int or None
        The first signal recorded on this rank.
    finished : bool
        Set once the job's loop is done (:func:`flowpm_mtf.jobs.runner.run`):
        a signal after it lets the run finish, which the log then says.

    Notes
    -----
    Use as a context manager; the previous handlers are restored on exit
    (see ``until_exit``). The handler only sets a flag, so the current
    ``session.run`` completes.
    """

    def __init__(self, comm, signals=(signal.SIGTERM,), until_exit=False):
        self.comm = comm
        self.signals = tuple(signals)
        self.until_exit = bool(until_exit)
        self.received = None
        self.finished = False
        self._previous = {}

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = signum
            log.warning("received %s: %s", signal.Signals(signum).name,
                        "the last step is done, finishing the run (outputs, exit 0)"
                        if self.finished else
                        "stopping at the end of the current step (or iteration)")

    def __enter__(self):
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, exc_type, *exc):
        for s, h in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.until_exit and exc_type is None else h)
        self._previous = {}
        return False

    def agreed(self):
        """True on every rank if any rank received a stop signal (collective)."""
        return int(self.comm.allreduce(1 if self.received is not None else 0)) > 0
