"""Configurations and code facts shared by several benchmarks."""
import ast
import importlib.util

#: The default simulation of ``flowpm-mtf simulate`` the benchmarks time.
DEFAULT_SIM = {"box_size": 200.0, "lpt_order": 2, "a_start": 0.1, "a_end": 1.0, "n_steps": 10,
               "dtype": "float32"}
#: Halo [cells] at 64^3 in 200 Mpc/h (25 Mpc/h) of the lagrangian decomposition;
#: scaled with the mesh.
HALO_PER_64 = 8


def sim_config(nc, grid, steps, box_size=None, decomposition="eulerian", halo=None):
    """The SimConfig of ``scripts/bench_sim.py`` and ``scripts/bench_peers.py``' ``ours``.

    The default simulation (:data:`DEFAULT_SIM`) with ``nc`` cells per side.

    Parameters
    ----------
    nc : int
    grid : tuple of int
        Process grid (P, Q).
    steps : int
        N-body steps.
    box_size : float, optional
        [Mpc/h] (default 200).
    decomposition : {"eulerian", "lagrangian"}
    halo : int, optional
        Halo [cells]; default: automatic (2) for the eulerian decomposition, 25 Mpc/h
        at 200 Mpc/h (:data:`HALO_PER_64`, scaled with the mesh) for the lagrangian one.

    Returns
    -------
    flowpm_mtf.config.SimConfig
    """
    from flowpm_mtf.config import SimConfig

    fields = dict(DEFAULT_SIM, nc=nc, grid=grid, n_steps=steps, decomposition=decomposition)
    if box_size is not None:
        fields["box_size"] = box_size
    if halo is not None:
        fields["halo_size"] = halo
    elif decomposition == "lagrangian":
        fields["halo_size"] = max(1, HALO_PER_64 * nc // 64)
    return SimConfig.from_dict(fields)


def readout_calls_per_force():
    """CIC readouts per PM force in ``flowpm_mtf.physics.gravity.pm_forces``.

    3 when the force components are read out one by one (``unstack_xyz``), 1 when
    the 3-component field is read out at once. Each readout does one halo fill
    and one escape check (see ``scripts/scaling_model.py``).

    Read from the module's source, without importing it (that would import TensorFlow:
    ~2 CPU-s in every process that records this, e.g. each mpi4py-fft rank).

    Returns
    -------
    int
    """
    path = importlib.util.find_spec("flowpm_mtf.physics.gravity").origin
    with open(path) as f:
        source = f.read()
    fn = next(node for node in ast.parse(source).body
              if isinstance(node, ast.FunctionDef) and node.name == "pm_forces")
    return 3 if "unstack_xyz(" in ast.get_source_segment(source, fn) else 1
