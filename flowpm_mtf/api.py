r"""The public API in FlowPM's shape: one function per step of a simulation.

A FlowPM script (``flowpm.linear_field``, ``lpt_init``, ``nbody``, ``cic_paint``)
becomes, distributed over the MPI ranks (``docs/from-flowpm.md``)::

    import flowpm_mtf.api as fpm
    conf = fpm.SimConfig(nc=32, box_size=100.0, grid=fpm.process_grid(), a_start=0.1)
    be = fpm.backend_for(conf)                        # HvdSimdMeshImpl on these ranks
    graph = mtf.Graph(); mesh = mtf.Mesh(graph, "mesh")
    linear = fpm.linear_field(conf, mesh)
    state = fpm.lpt_init(conf, linear, a0=0.1)
    final = fpm.nbody(conf, state, np.linspace(0.1, 1.0, 10))
    field = fpm.cic_paint(conf, final)
    lowering = mtf.Lowering(graph, {mesh: be.mesh_impl})

Every function takes the run's :class:`SimConfig` first (mesh size, box, process
grid, dtype, seed, cosmology, LPT order, time steps), then its input, then
keyword options: the configuration replaces FlowPM's positional plumbing
(``nc``, ``boxsize``, ``cosmology``, ``kvec``). Each returns Mesh TensorFlow
tensors (or a :class:`State` of them) that any ``MeshImpl`` lowers: the SPMD
``HvdSimdMeshImpl`` of :func:`backend_for` (one slice per MPI rank) or Mesh TF's
``PlacementMeshImpl`` in one process. The functions are thin wrappers of the
modules that implement them (named in each docstring); they add no physics.

Differences from FlowPM (0.1.1 and its later ``flowpm.cosmology`` API) that a
user sees:

* no batch dimension: one realisation per graph;
* particles live in the blocks of the process grid (a :class:`State` of
  ``[bx, by, npart, xyz]`` tensors with ids, block-local positions [cells]),
  not in one ``[batch, N, 3]`` array; :func:`global_positions` gives global
  positions [cells];
* 2LPT's second-order growth is the physical :math:`D_2` (FlowPM normalises
  :math:`D_2(1) = 1` and puts 3/7 in the source: its second-order term is 0.8 %
  larger for Planck 2015, see :mod:`flowpm_mtf.physics.lpt`).

Units (``docs/design.md``): positions and displacements [cells], momenta
:math:`p = a^3 E\,dx/da` [cells] (:math:`H_0 = 1`), wave numbers [h/Mpc], P(k)
[(Mpc/h)^3], densities as :math:`1 + \delta`.

Every name of ``__all__`` is also reached through the package (``flowpm_mtf.linear_field``,
``flowpm_mtf.nbody``, ...), loaded lazily on first use (``import flowpm_mtf`` imports no
TensorFlow).
"""
import logging
from typing import List, NamedTuple

import mesh_tensorflow as mtf

from . import backend as _backend
from .mesh import slots as _slots
from .physics import ics as _ics
from . import layout as _layout
from .physics import lensing as _lensing
from .physics import lensing_geometry as _lensing_geometry
from .physics import linear_power as _linear_power
from .physics import lpt as _lpt
from .gradients import model_gradient as _model_gradient
from .physics import nbody as _nbody
from .physics import painting as _painting
from .physics import power as _power
from .config import Cosmology, SimConfig, default_stages
from .physics.lensing_geometry import LensingConfig, LightconeGeometry
from .physics.lpt import State
from .gradients.model_gradient import ModelGradient

__all__ = ["SimConfig", "Cosmology", "LensingConfig", "LightconeGeometry", "State",
           "ModelGradient", "Backend", "Lightcone", "default_stages", "process_grid",
           "backend_for", "field_shape", "linear_matter_power", "linear_field", "lpt_init",
           "nbody", "cic_paint", "cic_readout", "global_positions", "power_spectrum",
           "lensing_geometry", "density_plane", "born_convergence", "lightcone",
           "adjoint_gradient"]

log = logging.getLogger(__name__)

Backend = _backend.Backend


# ----------------------------------------------------------------------------- backend
def process_grid(n_ranks=None):
    """The most square process grid ``(P, Q)`` for ``n_ranks`` ranks, ``P >= Q``.

    Parameters
    ----------
    n_ranks : int, optional
        Number of ranks [processes]; default the size of this launch, read from
        the launcher's environment (``mpirun``, ``srun``, ``horovodrun``; 1 without
        a launcher). MPI is not initialised.

    Returns
    -------
    tuple of int
        ``(P, Q)`` with ``P * Q = n_ranks``, for :attr:`SimConfig.grid`
        (wraps :func:`flowpm_mtf.backend.default_grid`).
    """
    n = _backend.world()[1] if n_ranks is None else int(n_ranks)
    if n < 1:
        raise ValueError("process_grid: n_ranks must be >= 1, got %r" % (n_ranks,))
    return _backend.default_grid(n)


def backend_for(conf, kind="hvd"):
    """The Mesh TF backend of ``conf``'s process grid on the ranks at hand.

    Parameters
    ----------
    conf : SimConfig
        ``conf.grid`` is the processor mesh (``[("row", P), ("col", Q)]``) and
        ``conf.layout_rules`` the layout.
    kind : {"hvd", "placement"}, optional
        ``"hvd"`` (default): :class:`hvd_mesh_impl.HvdSimdMeshImpl`, one slice per
        MPI rank (launch ``P * Q`` ranks; Horovod starts here), the rank's
        session configuration and ``mpi4py.MPI.COMM_WORLD``. ``"placement"``:
        Mesh TF's ``PlacementMeshImpl`` on ``P * Q`` logical CPUs of this one
        process, with a one-process comm.

    Returns
    -------
    Backend
        ``mesh_impl`` (for ``mtf.Lowering(graph, {mesh: be.mesh_impl})``),
        ``session_config`` (for ``tf.Session(config=...)``), ``comm`` and
        ``rank`` (wraps :func:`flowpm_mtf.backend.make_backend`).
    """
    return _backend.make_backend(kind, conf)


def field_shape(conf):
    """The Mesh TF shape of a real field of ``conf``: ``[x, y, z]``.

    Parameters
    ----------
    conf : SimConfig

    Returns
    -------
    mtf.Shape
        Dimensions ``x``, ``y``, ``z`` of ``conf.nc`` [cells] (x on mesh axis ``row``, y
        on ``col``), e.g. for a variable of white noise or of the linear field (wraps
        :func:`flowpm_mtf.layout.real_shape`).
    """
    return _layout.real_shape(conf)


# ----------------------------------------------------------------------------- ICs
def linear_matter_power(conf, k, a=1.0):
    """Linear matter power spectrum of ``conf.cosmology`` (Eisenstein & Hu 1998, numpy).

    Parameters
    ----------
    conf : SimConfig or Cosmology
    k : array_like
        Wave numbers [h/Mpc], positive.
    a : float, optional
        Scale factor [dimensionless] (default 1: today).

    Returns
    -------
    numpy.ndarray
        :math:`P(k, a)` [(Mpc/h)^3], float64, shape of ``k``, normalised to
        ``sigma8`` at ``a = 1`` (wraps :func:`flowpm_mtf.physics.linear_power.linear_matter_power`).
    """
    cosmo = conf.cosmology if isinstance(conf, SimConfig) else conf
    return _linear_power.linear_matter_power(cosmo, k, a)


def linear_field(conf, mesh, power=None, a=1.0, noise=None, name="linear_field"):
    """Gaussian linear density contrast on the mesh (``flowpm.linear_field``).

    Parameters
    ----------
    conf : SimConfig
        ``nc``, ``box_size``, ``dtype``, ``seed`` and ``cosmology``.
    mesh : mtf.Mesh
    power : callable or PowerTable, optional
        ``k`` [h/Mpc] (numpy) -> linear ``P(k)`` [(Mpc/h)^3] at ``a = 1``
        (FlowPM's ``ipklin``); default :func:`linear_matter_power` of ``conf``.
    a : float, optional
        Scale factor [dimensionless]: the field is multiplied by :math:`D_1(a)`
        (default 1, as :func:`lpt_init` expects).
    noise : mtf.Tensor, optional
        Real unit white noise ``[x, y, z]`` to colour instead of the noise of
        ``conf.seed`` (e.g. a variable to optimise).
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z]`` (x on mesh axis ``row``, y on ``col``)
        [dimensionless density contrast], zero mean; for a seed, the same field
        on every process grid (wraps :func:`flowpm_mtf.physics.ics.linear_field`).
    """
    return _ics.linear_field(conf, mesh, power=power, a=a, noise=noise, name=name)


def lpt_init(conf, linear, a0=None, order=None, forces=True):
    """Particles displaced from the lattice by LPT at ``a0`` (``flowpm.lpt_init``).

    Parameters
    ----------
    conf : SimConfig
    linear : mtf.Tensor
        Linear density contrast at ``a = 1`` [dimensionless], real ``[x, y, z]``
        (:func:`linear_field`).
    a0 : float, optional
        Scale factor of the initial state [dimensionless]; default ``conf.a_start``.
    order : {1, 2}, optional
        LPT order; default ``conf.lpt_order`` (2).
    forces : bool, optional
        Compute the LPT force (default, as FlowPM's state); ``False`` saves that
        work when the state goes straight to :func:`nbody`, which recomputes
        the force at its first stage.

    Returns
    -------
    State
        ``positions`` (block-local [cells]), ``momenta`` [cells], ``forces``
        [cells] (None with ``forces=False``) and ``ids`` of the particles, one per
        cell, in the blocks that hold them (wraps :func:`flowpm_mtf.physics.lpt.lpt_init`).
    """
    return _lpt.lpt_init(linear, conf, a=a0, order=order, forces=forces)


# ----------------------------------------------------------------------------- N-body
def nbody(conf, state, stages=None, snapshots=None):
    """FastPM kick-drift-kick N-body through the stages (``flowpm.nbody``).

    Parameters
    ----------
    conf : SimConfig
    state : State
        The state at ``stages[0]`` (:func:`lpt_init`).
    stages : array_like, optional
        Increasing scale factors [dimensionless]: one step between two
        consecutive entries; default :func:`default_stages` (``conf.n_steps`` steps
        from ``conf.a_start`` to ``conf.a_end``).
    snapshots : array_like, optional
        Scale factors among ``stages`` [dimensionless] at which to keep the state.

    Returns
    -------
    State
        The state at ``stages[-1]`` (forces recomputed there); with
        ``snapshots``, ``(final, [State, ...])`` (wraps
        :func:`flowpm_mtf.physics.nbody.nbody`).
    """
    return _nbody.nbody(state, conf, stages=stages, snapshot_a=snapshots)


# ----------------------------------------------------------------------------- CIC
def _positions_and_weight(conf, particles, weight):
    """Positions and painting weights of a State (its empty slots weigh 0) or a tensor."""
    if isinstance(particles, State):
        w = _slots.weights(particles.ids, conf)
        if weight is not None:
            w = weight if w is None else w * weight
        return particles.positions, w
    return particles, weight


def cic_paint(conf, particles, weight=None, name="cic_paint"):
    """Cloud-in-cell density of the particles on the mesh (``flowpm.cic_paint``).

    Parameters
    ----------
    conf : SimConfig
    particles : State or mtf.Tensor
        A state (its empty slots are not painted) or block-local positions
        ``[bx, by, npart, xyz]`` [cells].
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` particle masses (default 1).
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z]``: mass per cell [particles], i.e. :math:`1 + \\delta`
        for one particle per cell (FlowPM's ``cic_paint(tf.zeros(...), x)``);
        particles that left their block's halo raise ``InvalidArgumentError``
        when run (wraps :func:`flowpm_mtf.physics.painting.paint_field`).
    """
    positions, w = _positions_and_weight(conf, particles, weight)
    return _painting.paint_field(positions, conf, weight=w, name=name)


def cic_readout(conf, field, particles, name="cic_readout"):
    """A real field read out at the particles with CIC (``flowpm.cic_readout``).

    Parameters
    ----------
    conf : SimConfig
    field : mtf.Tensor
        Real ``[x, y, z]``, optionally followed by component dimensions (e.g.
        ``xyz``).
    particles : State or mtf.Tensor
        A state (its empty slots read 0) or block-local positions
        ``[bx, by, npart, xyz]`` [cells].
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``[bx, by, npart, <components>]``, in the units of ``field`` (wraps
        :func:`flowpm_mtf.physics.painting.readout_field`).
    """
    positions, w = _positions_and_weight(conf, particles, None)
    values = _painting.readout_field(field, positions, conf, name=name)
    return values if w is None else values * w


def global_positions(conf, particles):
    """Global particle positions [cells] (block origin added; not wrapped into the box).

    Parameters
    ----------
    conf : SimConfig
    particles : State or mtf.Tensor
        A state or block-local positions ``[bx, by, npart, xyz]`` [cells].

    Returns
    -------
    mtf.Tensor
        ``[bx, by, npart, xyz]`` [cells]; multiply by ``conf.cell_size`` for
        [Mpc/h]. A state's empty slots (``ids < 0``) hold no particle (wraps
        :func:`flowpm_mtf.physics.painting.to_global`).
    """
    positions = particles.positions if isinstance(particles, State) else particles
    return _painting.to_global(positions, conf)


# ----------------------------------------------------------------------------- P(k)
def power_spectrum(conf, field, edges=None, deconvolve_cic=False, name="power_spectrum"):
    """Shell-averaged power spectrum of a real field (distributed, differentiable).

    Parameters
    ----------
    conf : SimConfig
    field : mtf.Tensor
        Real ``[x, y, z]`` [dimensionless], e.g. :func:`cic_paint`'s :math:`1 + \\delta`
        (the ``k = 0`` mode is never counted).
    edges : array_like, optional
        Increasing shell edges [h/Mpc]; default bins of width
        ``2 pi / min(box_size)`` centred on its multiples, up to Nyquist.
    deconvolve_cic : bool, optional
        Divide by the CIC window squared (for a painted field).
    name : str, optional

    Returns
    -------
    k : mtf.Tensor
        Mean ``|k|`` of each shell [h/Mpc], ``[kbin]``.
    power : mtf.Tensor
        :math:`P(k)` [(Mpc/h)^3], ``[kbin]``.
    n_modes : mtf.Tensor
        Modes per shell (both members of each conjugate pair), ``[kbin]``.
        All three are replicated on every rank (wraps
        :func:`flowpm_mtf.physics.power.power_spectrum`).
    """
    return _power.power_spectrum(field, conf, edges=edges, deconvolve_cic=deconvolve_cic,
                                 name=name)


# ----------------------------------------------------------------------------- lensing
class Lightcone(NamedTuple):
    """What :func:`lightcone` returns.

    Attributes
    ----------
    kappa : mtf.Tensor
        Born convergence ``[src, thx, thy]`` [dimensionless], one map per source.
    planes : list of mtf.Tensor
        The lens planes ``[x, y]`` of :math:`1 + \\bar\\delta` [dimensionless].
    state : State
        The particles at the last stage.
    geometry : LightconeGeometry
        Planes, rays and sources (distances [Mpc/h], angles [rad]).
    """

    kappa: mtf.Tensor
    planes: List[mtf.Tensor]
    state: State
    geometry: LightconeGeometry


def lensing_geometry(conf, lensing=None):
    """Lens planes, rays and sources of a lightcone run (numpy, checked).

    Parameters
    ----------
    conf : SimConfig
    lensing : LensingConfig, optional
        Sources, field of view [deg], rays and planes; default ``LensingConfig()``.

    Returns
    -------
    LightconeGeometry
        Raises ``ValueError`` when a source lies beyond ``conf.a_start`` or the
        field does not fit in the box (wraps :func:`flowpm_mtf.physics.lensing_geometry.geometry`).
    """
    return _lensing_geometry.geometry(conf, LensingConfig() if lensing is None else lensing)


def density_plane(conf, particles, geometry, index, name=None):
    """One lens plane: the particles of shell ``index`` projected with 2D CIC.

    Parameters
    ----------
    conf : SimConfig
    particles : State or mtf.Tensor
        The particles at the plane's scale factor ``geometry.a[index]``.
    geometry : LightconeGeometry
    index : int
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``[x, y]`` :math:`1 + \\bar\\delta` averaged over the shell [dimensionless]
        (wraps :func:`flowpm_mtf.physics.lensing.density_plane`).
    """
    positions, w = _positions_and_weight(conf, particles, None)
    return _lensing.density_plane(positions, conf, geometry, index, name=name, weight=w)


def born_convergence(conf, planes, geometry, name="born"):
    """Born convergence maps from the lens planes (``flowpm.raytracing.convergenceBorn``).

    Parameters
    ----------
    conf : SimConfig
    planes : list of mtf.Tensor
        ``geometry.n_planes`` planes ``[x, y]`` (:func:`density_plane`).
    geometry : LightconeGeometry
    name : str, optional

    Returns
    -------
    mtf.Tensor
        :math:`\\kappa` ``[src, thx, thy]`` [dimensionless], replicated (wraps
        :func:`flowpm_mtf.physics.lensing.born_convergence`).
    """
    return _lensing.born_convergence(planes, conf, geometry, name=name)


def lightcone(conf, linear, lensing=None):
    """LPT, the N-body through the lens planes' stages, the planes and the Born maps.

    Parameters
    ----------
    conf : SimConfig
        ``a_start`` must lie before the farthest source; ``n_steps`` regular
        steps plus one stage per plane.
    linear : mtf.Tensor
        Linear density contrast at ``a = 1`` [dimensionless], ``[x, y, z]``.
    lensing : LensingConfig, optional
        Default ``LensingConfig()`` (z_s = 1, 5 deg, 128^2 rays, 12 planes).

    Returns
    -------
    Lightcone
        ``kappa``, ``planes``, ``state``, ``geometry`` (wraps
        :func:`flowpm_mtf.physics.lensing.lightcone_forward`).
    """
    geom = lensing_geometry(conf, lensing)
    kappa, planes, state = _lensing.lightcone_forward(linear, conf, geom)
    return Lightcone(kappa, planes, state, geom)


# ----------------------------------------------------------------------------- gradients
def adjoint_gradient(conf, mesh, loss_fn, linear=None, noise=None,
                     params=_model_gradient.DEFAULT_PARAMETERS, stages=None):
    """Gradient of a loss of the final state w.r.t. the initial field and the cosmology.

    By the adjoint of the time loop: the memory of one step whatever the number
    of steps.

    Parameters
    ----------
    conf : SimConfig
        The point of the gradient (its cosmology, LPT order, decomposition).
    mesh : mtf.Mesh
    loss_fn : callable
        ``loss_fn(final State) -> scalar mtf.Tensor``.
    linear : mtf.Tensor, optional
        The linear field at ``a = 1`` ``[x, y, z]`` [dimensionless]: the gradient is
        w.r.t. it (P(k) held fixed).
    noise : mtf.Tensor, optional
        Instead of ``linear``: unit white noise ``[x, y, z]`` coloured with
        ``conf.cosmology``'s P(k); the gradient is w.r.t. the noise, and P(k)
        enters the cosmology's gradient.
    params : sequence of str, optional
        Fields of :class:`Cosmology` to differentiate (default Omega_c, sigma8).
    stages : array_like, optional
        N-body stages [dimensionless] (default :func:`default_stages`).

    Returns
    -------
    ModelGradient
        ``field_gradient`` ``[x, y, z]`` [loss units per unit field]; after
        ``ops = mg.lower(lowering)``, ``mg.run(sess, ops)`` gives the loss and
        ``["cosmology"][param]`` [loss units per unit parameter] (wraps
        :class:`flowpm_mtf.gradients.model_gradient.ModelGradient`).
    """
    return ModelGradient(conf, mesh, loss_fn, linear=linear, noise=noise, params=params,
                         stages=stages)

