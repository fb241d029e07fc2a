"""The flat-sky graph of the lensing job (:mod:`flowpm_mtf.jobs.lensing`): the simulation's
state and step on the lightcone's stages, the lens planes and the Born maps.

Its own module so that the job's declarative part (options, configs) imports no Mesh TF:
the job builds this graph in :meth:`~flowpm_mtf.jobs.lensing.LensingJob.build`.
"""
import mesh_tensorflow as mtf
import numpy as np

from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

from ..physics import lensing, lensing_geometry
from . import lensing_pgd
from .nbody_run import SimulationGraph

__all__ = ["LensingGraph"]


class LensingGraph(SimulationGraph):
    r"""The mtf graph of a lensing run: the simulation's state and step
    (:class:`flowpm_mtf.jobs.nbody_run.SimulationGraph` on the lightcone's
    stages), plus plane variables, plane assignments and the Born maps.

    Parameters
    ----------
    conf : SimConfig
    geom : lensing_geometry.LightconeGeometry
    mesh : mtf.Mesh
    pconf : flowpm_mtf.physics.pgd.PGDConfig, optional
        With ``pconf.pgd``, the planes are painted from the particles moved by the PGD
        correction at each plane stage, and their P(k) is of those particles
        (``pgd``: :class:`flowpm_mtf.jobs.lensing_pgd.PGDParticles`, its :math:`\alpha(a)`
        fed per stage); the time loop goes on from the uncorrected particles.
    """

    def __init__(self, conf, geom, mesh, pconf=None):
        self.geom = geom
        stages, self.plane_stage = lensing_geometry.lightcone_stages(conf, geom)
        super().__init__(conf, mesh, stages)
        # one displacement for every plane stage, alpha(a) fed per run (None without PGD)
        self.pgd = lensing_pgd.pgd_particles(self, mesh, pconf)
        x = self.variables.positions if self.pgd is None else self.pgd.positions
        x_mesh = self.variables.positions if self.pgd is None else self.pgd.clipped
        plane_shape = mtf.Shape([mtf.Dimension(n, s) for n, s in zip(("x", "y"), conf.nc[:2])])
        self.planes = [mtf.get_variable(mesh, "plane_%d" % i, plane_shape, dtype=conf.tf_dtype,
                                        trainable=False, initializer=unfolded_zeros_initializer())
                       for i in range(geom.n_planes)]
        # the Born maps' running sum over the planes painted so far, at the rays' resolution
        # (lensing.ray_born_terms, summed over the blocks at each plane stage): [src, thx,
        # thy], small and replicated (a checkpoint holds it once, for any process grid)
        self.born_kappa = mtf.get_variable(
            mesh, "born_kappa", mtf.Shape([
                mtf.Dimension(lensing.SRC, geom.n_source),
                mtf.Dimension(lensing.THX, geom.npix), mtf.Dimension(lensing.THY, geom.npix)]),
            dtype=conf.tf_dtype, trainable=False, initializer=unfolded_zeros_initializer())
        coef = lensing_geometry.born_coefficients(conf, geom)
        # plane_ops[j]: assignments of the planes painted at stage j (the mesh planes and the
        # rays' Born terms of the same particles)
        self.plane_ops = {}
        terms = {}
        for i, j in enumerate(self.plane_stage):
            self.plane_ops.setdefault(int(j), []).append(
                mtf.assign(self.planes[i], lensing.density_plane(x_mesh, conf, geom, i,
                                                                 weight=self.weights)))
            if np.any(coef[:, i] > 0):
                terms.setdefault(int(j), []).append(
                    lensing.ray_born_terms(x, conf, geom, i, weight=self.weights))
        for j, ts in terms.items():
            self.plane_ops[j].append(mtf.assign(self.born_kappa, self.born_kappa
                                                + lensing.born_from_terms(ts)))
        self.kappa = mtf.identity(self.born_kappa)
        self.gamma1, self.gamma2 = lensing.shear_from_potential(self.kappa)
