"""Exception classes of ``flowpm_mtf``: one line a user can act on.

Every error raised on purpose by the library derives from :class:`FlowpmError`;
the message names the offending value and, where one exists, the value that
would work. The CLI prints it once as ``flowpm-mtf: error: <message>``.
"""

__all__ = ["FlowpmError", "ConfigError", "RankCountError", "ParticleEscapeError",
           "MemoryBudgetError", "OutputDirError", "ResumeError", "CapacityError"]


class FlowpmError(Exception):
    """Base class of the errors raised by ``flowpm_mtf``."""


class ConfigError(FlowpmError, ValueError):
    """An impossible or inconsistent configuration."""


class RankCountError(FlowpmError):
    """The number of MPI ranks does not match the process grid."""


class ParticleEscapeError(FlowpmError):
    """Particles moved farther than the decomposition allows in one step.

    Attributes
    ----------
    steps_needed : int or None
        A number of time steps that would keep the motion per step in range.
    """

    def __init__(self, message, steps_needed=None):
        super().__init__(message)
        self.steps_needed = steps_needed


class MemoryBudgetError(FlowpmError):
    """The run would not fit in the memory of the ranks."""


class OutputDirError(FlowpmError):
    """The output directory cannot be used (complete run, lock held, not writable)."""


class ResumeError(FlowpmError):
    """A run cannot be resumed from the given directory."""


class CapacityError(FlowpmError):
    """A fixed-capacity particle buffer would overflow (detected before any particle is lost).

    Attributes
    ----------
    capacity, send_capacity : int
        Particle slots per block and per migration send buffer that would work.
    """

    def __init__(self, message, capacity=None, send_capacity=None):
        super().__init__(message)
        self.capacity = capacity
        self.send_capacity = send_capacity
