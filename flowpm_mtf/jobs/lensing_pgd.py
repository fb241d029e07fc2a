r"""PGD in the lensing job: the corrected particles both skies paint from.

With ``--pgd`` (:class:`flowpm_mtf.physics.pgd.PGDConfig`), the flat sky's planes
(:class:`flowpm_mtf.jobs.lensing_graph.LensingGraph`) and the full sky's HEALPix shells
(:class:`flowpm_mtf.jobs.lensing_fullsky.FullSkyGraph`) are painted from the particles moved
by the PGD displacement at their stage, :math:`\alpha(a) = \alpha_0 a^\mu` fed per plane
stage; the P(k) at those stages (the Limber prediction's input) is the corrected particles'.
The time loop goes on from the uncorrected particles. One displacement in the graph serves
every stage: :class:`PGDParticles` builds it, :meth:`PGDParticles.feed` gives its
:math:`\alpha` at a stage, and :func:`power_at_stages` runs the planes of a stage and their
P(k) with that feed.
"""
import numpy as np

from ..physics import painting, pgd, power, stepper
from . import nbody_run, runner

__all__ = ["PGDParticles", "pgd_particles", "lower_pgd", "power_at_stages"]


class PGDParticles:
    r"""The PGD-corrected particles of a lensing graph and their P(k) (mtf tensors).

    Parameters
    ----------
    graph : flowpm_mtf.jobs.nbody_run.SimulationGraph
        Its positions, slot weights and stages.
    mesh : mtf.Mesh
    pconf : flowpm_mtf.physics.pgd.PGDConfig

    Attributes
    ----------
    positions : mtf.Tensor
        ``x + dx`` [cells], block-local, unclipped (what the rays' planes and the HEALPix
        shells take: they place every particle by its global position).
    clipped : mtf.Tensor
        ``positions`` held inside the padded blocks (:func:`flowpm_mtf.physics.pgd.clip_to_blocks`):
        what is painted on the PM mesh (the flat sky's mesh planes, the P(k)).
    k, pk, modes : mtf.Tensor
        The P(k) of the corrected particles (replicated).
    alpha : tf.Tensor
        The placeholder of :math:`\alpha` ``[1]``, fed by :meth:`feed`.
    """

    def __init__(self, graph, mesh, pconf):
        conf = graph.conf
        self.pconf = pconf
        self.stages = graph.stages
        self.dtype = conf.np_dtype
        self.alpha, (alpha,) = stepper.fed_factors(mesh, conf.tf_dtype, 1, "pgd_alpha")
        x = graph.variables.positions
        self.positions = x + pgd.pgd_displacement(x, conf, pconf, alpha, weight=graph.weights)
        self.clipped = pgd.clip_to_blocks(self.positions, conf)
        rho = painting.paint_field(self.clipped, conf, graph.weights, name="pgd_density")
        self.k, self.pk, self.modes = power.power_spectrum(rho - 1.0, conf,
                                                           deconvolve_cic=False)

    def feed(self, j):
        r"""The feed of stage ``j``'s plane and P(k) runs: :math:`\alpha(a_j)`."""
        return {self.alpha: np.array([self.pconf.alpha(self.stages[j])], self.dtype)}


def pgd_particles(graph, mesh, pconf):
    """:class:`PGDParticles` of ``graph`` with ``pconf.pgd``, else None."""
    if pconf is None or not pconf.pgd:
        return None
    return PGDParticles(graph, mesh, pconf)


def lower_pgd(lowering, corrected, ops):
    """Add ``ops["pgd_fetch"]``, the corrected particles' P(k) (replicated), with PGD."""
    if corrected is not None:
        ops["pgd_fetch"] = runner.replicated(lowering, {"k": corrected.k, "pk": corrected.pk,
                                                        "modes": corrected.modes})
    return ops


def power_at_stages(sess, corrected, ops):
    r"""The observer painting a stage's planes (``ops["planes"][j]``) and measuring its P(k):
    with PGD, of the corrected particles, :math:`\alpha` fed
    (:class:`flowpm_mtf.jobs.nbody_run.PowerAtStages`)."""
    feed = None if corrected is None else corrected.feed
    return nbody_run.PowerAtStages(
        sess, ops.get("pgd_fetch", ops["fetch"]), ops["planes"],
        before=lambda j: sess.run(ops["planes"][j], None if feed is None else feed(j)),
        feed=feed)
