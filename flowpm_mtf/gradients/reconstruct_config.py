"""Settings of a reconstruction of the initial conditions (:class:`ReconConfig`), decided
before any graph (numpy; the graph: :mod:`flowpm_mtf.gradients.reconstruct`).

The forward model maps the linear field to the observed final density: ``"lpt"``, the LPT
displacement to ``conf.a_end`` and the CIC density; ``"nbody"``, LPT at ``conf.a_start``
then the FastPM N-body to ``conf.a_end`` (:func:`flowpm_mtf.physics.nbody.forward`).
"""
import dataclasses

import numpy as np

__all__ = ["ReconConfig", "FORWARD_MODELS", "GRADIENTS", "NOISELESS_SIGMA"]

FORWARD_MODELS = ("lpt", "nbody")
"""Forward models: LPT to ``a_end``, or LPT + FastPM N-body to ``a_end``."""

GRADIENTS = ("adjoint", "stored")
"""How the gradient of the N-body forward model is taken: the adjoint of the time loop
(:class:`flowpm_mtf.gradients.model_gradient.ModelGradient`, memory of one step), or
``mtf.gradients`` through the unrolled model (every step's activations kept)."""

NOISELESS_SIGMA = 0.1
"""Likelihood width [1 + delta units] used when the data have no noise
(``noise = 0``): a noiseless data term has no natural weight; 0.1 per cell
keeps the data dominant over the prior on all scales where the final field
carries signal, while leaving the loss well conditioned for Adam."""


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class ReconConfig:
    """Settings of one reconstruction (the simulation itself is a ``SimConfig``).

    Parameters
    ----------
    iterations : int
        Adam iterations (>= 1).
    learning_rate : float
        Adam step size [linear density contrast per iteration] (> 0).
    noise : float
        Standard deviation of the Gaussian noise added to the observed
        ``1 + delta`` per cell [dimensionless] (>= 0).
    forward : {"lpt", "nbody"}
        Forward model (see the module docstring).
    gradient : {"adjoint", "stored"}
        How the gradient of the ``"nbody"`` forward model is taken
        (:data:`GRADIENTS`); the ``"lpt"`` model has no time loop, and both
        are then the same graph.
    sigma : float or None
        Per-cell standard deviation assumed by the likelihood
        [dimensionless]; default ``noise``, or :data:`NOISELESS_SIGMA` when
        ``noise == 0``.
    beta1, beta2, epsilon : float
        Adam's moment decay rates and regulariser (Kingma & Ba's defaults).
    log_every : int
        Log the loss on rank 0 every this many iterations (>= 1); the loss of
        every iteration is always recorded.

    Raises
    ------
    ValueError
        For any invalid value (the message names it).
    """

    iterations: int = 200
    learning_rate: float = 0.1
    noise: float = 0.1
    forward: str = dataclasses.field(default="lpt", metadata={"choices": FORWARD_MODELS})
    gradient: str = dataclasses.field(default="adjoint", metadata={"choices": GRADIENTS})
    sigma: float = None
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    log_every: int = 10

    def __post_init__(self):
        for name in ("iterations", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError("%s must be an integer >= 1, got %r" % (name, v))
            object.__setattr__(self, name, int(v))
        for name in ("learning_rate", "epsilon"):
            v = getattr(self, name)
            if not _is_number(v) or not (np.isfinite(v) and v > 0):
                raise ValueError("%s must be a positive finite number, got %r" % (name, v))
        if not _is_number(self.noise) or not (np.isfinite(self.noise) and self.noise >= 0):
            raise ValueError("noise must be a finite number >= 0, got %r" % (self.noise,))
        if self.sigma is not None and (not _is_number(self.sigma)
                                       or not (np.isfinite(self.sigma) and self.sigma > 0)):
            raise ValueError("sigma must be a positive finite number or None, got %r"
                             % (self.sigma,))
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not _is_number(v) or not 0 <= v < 1:
                raise ValueError("%s must be in [0, 1), got %r" % (name, v))
        if self.forward not in FORWARD_MODELS:
            raise ValueError("forward must be one of %s, got %r" % (FORWARD_MODELS, self.forward))
        if self.gradient not in GRADIENTS:
            raise ValueError("gradient must be one of %s, got %r" % (GRADIENTS, self.gradient))

    @property
    def uses_adjoint(self):
        """True when the gradient goes through the adjoint of the time loop."""
        return self.forward == "nbody" and self.gradient == "adjoint"

    @property
    def likelihood_sigma(self):
        """The per-cell standard deviation used in chi^2 [dimensionless]."""
        if self.sigma is not None:
            return float(self.sigma)
        return float(self.noise) if self.noise > 0 else NOISELESS_SIGMA

    def to_dict(self):
        """A JSON-able dict of the fields."""
        return dataclasses.asdict(self)


def _is_number(v):
    return not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
