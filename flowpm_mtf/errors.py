"""Exceptions a user can act on.

Library code raises these for every failure that is the user's input or
environment rather than a bug: the message is **one line** saying what is wrong
and, where one exists, the value that would work. The command line
(:mod:`flowpm_mtf.cli`) prints ``flowpm-mtf: error: <message>`` once and exits
with :attr:`FlowpmError.exit_code` on every rank, without a traceback unless
``--verbose``.

``ConfigError`` (and so ``RankCountError``) also derives from ``ValueError``,
so code that already catches ``ValueError`` for bad configurations keeps working.
"""

__all__ = ["EXIT_INTERNAL", "FlowpmError", "ConfigError", "RankCountError", "ParticleEscapeError",
           "MemoryBudgetError", "OutputDirError", "ResumeError", "CapacityError", "StoppedError",
           "error_from_name"]


EXIT_INTERNAL = 1
"""Exit code of an unexpected (internal) error, and of :class:`FlowpmError` itself."""


class FlowpmError(Exception):
    """Base class: a failure with a one-line message for the user.

    Attributes
    ----------
    exit_code : int
        Process exit status the CLI uses for this class (non-zero).
    same_on_every_rank : bool
        Raised identically on every rank (a collective check), so rank 0 alone
        reports it; otherwise each rank that raises it does.
    """

    exit_code = EXIT_INTERNAL
    same_on_every_rank = True

    def __init__(self, message):
        # Keep the message on one line whatever the caller passed.
        super().__init__(" ".join(str(message).split()))


class ConfigError(FlowpmError, ValueError):
    """An impossible or meaningless configuration (value, combination, numerics)."""

    exit_code = 2


class RankCountError(ConfigError):
    """The number of MPI ranks does not match the process grid or the backend."""


class ParticleEscapeError(FlowpmError):
    """A particle left its block's halo; the message names the halo or the number of
    steps that would do.

    Attributes
    ----------
    steps_needed : int or None
        A number of time steps that would keep the motion per step in range.
    """

    exit_code = 3

    def __init__(self, message, steps_needed=None):
        super().__init__(message)
        self.steps_needed = steps_needed


class MemoryBudgetError(FlowpmError):
    """The estimated peak memory per rank exceeds what the node has (``--force`` skips)."""

    exit_code = 4


class OutputDirError(FlowpmError):
    """The run directory cannot be used: not writable, in use, or holding another run."""

    exit_code = 5


class ResumeError(FlowpmError):
    """``--resume`` is impossible or contradicts the checkpoint."""

    exit_code = 6


class CapacityError(FlowpmError):
    """A fixed-capacity particle buffer would overflow (detected before any particle is lost).

    Attributes
    ----------
    capacity, send_capacity : int or None
        Particle slots per block and per migration send buffer that would work.
    """

    exit_code = 7
    same_on_every_rank = False

    def __init__(self, message, capacity=None, send_capacity=None):
        super().__init__(message)
        self.capacity = capacity
        self.send_capacity = send_capacity


class StoppedError(FlowpmError):
    """A signal stopped a job that had nowhere to checkpoint (a job without checkpoints, or
    one run through the Python API without a run directory); nothing was written (rerun it)."""

    exit_code = 8


def error_from_name(name, message):
    """Re-create an error from its class name (as sent between ranks).

    Parameters
    ----------
    name : str
        Class name of one of this module's exceptions; anything else gives a
        :class:`FlowpmError`.
    message : str

    Returns
    -------
    FlowpmError
    """
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, FlowpmError)):
        cls = FlowpmError
    return cls(message)
