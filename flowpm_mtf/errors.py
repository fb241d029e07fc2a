"""Exceptions of flowpm_mtf: one line a user can act on.

The CLI prints ``flowpm-mtf: error: <message>`` for a :class:`FlowpmError`
(no traceback unless ``--verbose``) and exits non-zero on every rank.
"""

__all__ = ["FlowpmError", "ConfigError", "RankCountError", "ParticleEscapeError",
           "MemoryBudgetError", "OutputDirError", "ResumeError", "CapacityError"]


class FlowpmError(Exception):
    """Base class: an error the user can fix; the message is one line."""


class ConfigError(FlowpmError, ValueError):
    """Invalid or inconsistent configuration."""


class RankCountError(FlowpmError):
    """The process grid does not match the number of ranks."""


class ParticleEscapeError(FlowpmError):
    """A particle left its block's halo."""


class MemoryBudgetError(FlowpmError):
    """The run would not fit in memory."""


class OutputDirError(FlowpmError):
    """The output directory cannot be used (complete run, unfinished run, not writable)."""


class ResumeError(FlowpmError):
    """``--resume``: no valid checkpoint, or a config that contradicts it."""


class CapacityError(FlowpmError):
    """A per-rank particle buffer overflowed."""
