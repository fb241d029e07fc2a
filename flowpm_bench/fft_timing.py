"""Timing of the distributed FFT round trip, ours and mpi4py-fft's (FFTW + MPI).

Used by ``scripts/bench_fft.py`` (FFT table in ``results/``), ``scripts/bench_peers.py``
and ``scripts/bench_compare.py`` (mpi4py-fft reference). No Horovod here: the
caller passes the Mesh TF ``MeshImpl`` (and for mpi4py-fft an mpi4py
communicator).

The ``*_runner`` functions set a round trip up and return a :class:`Runner`;
:func:`interleaved` times several runners in turns (A B C A B C ...), so that
on a loaded machine they see the same load and their ratio is meaningful; the
``time_*`` functions time one. Times are dicts [s]: ``first_s`` (first run,
including TensorFlow's and FFTW's one-time set-up), ``times_s`` (the timed
runs), ``median_s`` and ``min_s``. With a ``reduce_max`` callable (e.g.
``lambda t: max(comm.allgather(t))``) each run's time is the slowest rank's.
"""
import collections
import contextlib
import statistics
import time

import numpy as np


def _summary(first, times, **extra):
    out = {"first_s": first, "times_s": times, "median_s": statistics.median(times),
           "min_s": min(times)}
    out.update(extra)
    return out


def timed_runs(fn, warmup=1, repeats=5, barrier=None, reduce_max=None):
    """Run ``fn()`` ``warmup`` times untimed (the first one reported) then ``repeats`` timed.

    Parameters
    ----------
    fn : callable
    warmup, repeats : int
    barrier : callable, optional
        Called before each run (e.g. ``comm.Barrier``).
    reduce_max : callable, optional
        Maps this process's time to the one reported (e.g. the maximum over ranks).

    Returns
    -------
    dict
        ``first_s``, ``times_s``, ``median_s``, ``min_s`` [s].
    """
    def one():
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return reduce_max(dt) if reduce_max is not None else dt

    first = one()
    for _ in range(max(0, warmup - 1)):
        one()
    return _summary(first, [one() for _ in range(repeats)])


Runner = collections.namedtuple("Runner", ["run", "info"])
Runner.__doc__ = """A set-up round trip: ``run()`` does one; ``info`` is a dict of facts."""


def interleaved(runners, warmup=1, repeats=5, barrier=None, reduce_max=None):
    """Time several :class:`Runner` objects in turns.

    Parameters
    ----------
    runners : dict of str to Runner
    warmup, repeats, barrier, reduce_max
        See :func:`timed_runs`; every round runs each runner once, in order.

    Returns
    -------
    dict of str to dict
        Per runner: its ``info`` plus ``first_s``, ``times_s``, ``median_s``, ``min_s`` [s].
    """
    def one(runner):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        runner.run()
        dt = time.perf_counter() - t0
        return reduce_max(dt) if reduce_max is not None else dt

    first = {k: one(r) for k, r in runners.items()}
    for _ in range(max(0, warmup - 1)):
        for r in runners.values():
            one(r)
    times = {k: [] for k in runners}
    for _ in range(repeats):
        for k, r in runners.items():
            times[k].append(one(r))
    return {k: _summary(first[k], times[k], **r.info) for k, r in runners.items()}


@contextlib.contextmanager
def mtf_roundtrip_runner(conf, mesh_impl, devices=("",), session_config=None):
    """Context manager: a :class:`Runner` of ``c2r(r2c(field))`` of :mod:`flowpm_mtf.mesh.fft`.

    The field's slices are TF variables (N(0, 1), ``conf.dtype``) created on
    ``devices`` (one per slice this process builds: ``[""]`` for an SPMD impl
    such as ``HvdSimdMeshImpl``), so no full-size array is fed; one element of
    every output slice is fetched (a data dependency on the whole transform).
    The graph is built and the session opened on entry (the caller's ranks must
    enter together: variable initialisation may communicate).

    Parameters
    ----------
    conf : SimConfig
    mesh_impl : mtf.MeshImpl
        Built for ``conf.mesh_shape`` and ``conf.layout_rules``.
    devices : sequence of str
    session_config : tf.ConfigProto, optional

    Yields
    ------
    Runner
        ``info``: ``build_s`` (graph and lowering) [s], ``native`` (whether the
        local FFTs use the native op), ``max_abs_error`` of the round trip on
        this process's slices.
    """
    from flowpm_mtf.mesh import fft  # first: Mesh TF's TF >= 2.13 shims (hvd_mesh_impl.tf_compat)

    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    with tf.Graph().as_default():
        t0 = time.perf_counter()
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        shape = fft.real_shape(conf)
        sshape = mesh_impl.slice_shape(shape)
        slices = []
        for i, dev in enumerate(devices):
            with tf.device(dev):
                v = tf.Variable(tf.random.normal(sshape, seed=i + 1, dtype=conf.tf_dtype),
                                name="field_%d" % i, trainable=False)
                slices.append(v.read_value())
        x = mtf.import_laid_out_tensor(mesh, mesh_impl.LaidOutTensor(slices), shape,
                                       name="field")
        y = fft.c2r(fft.r2c(x, conf), conf)
        lowering = mtf.Lowering(graph, {mesh: mesh_impl})
        out = lowering.tensors[y].to_laid_out_tensor().tensor_list
        fetch = []
        for t in out:
            with tf.device(t.device):
                fetch.append(tf.reshape(t, [-1])[0])
        err = tf.reduce_max([tf.reduce_max(tf.abs(a - b)) for a, b in zip(out, slices)])
        native = any(op.type.startswith("FlowpmFft")
                     for op in tf.get_default_graph().get_operations())
        build_s = time.perf_counter() - t0
        with tf.Session(config=session_config) as sess:
            sess.run(tf.global_variables_initializer())
            info = {"build_s": build_s, "native": native,
                    "max_abs_error": float(sess.run(err))}
            yield Runner(lambda: sess.run(fetch), info)


@contextlib.contextmanager
def mpi4py_fft_roundtrip_runner(comm, nc, grid, real=False, single=True):
    """Context manager: a :class:`Runner` of ``backward(forward(u))`` of ``mpi4py_fft.PFFT``
    (FFTW) on a P x Q pencil grid.

    Parameters
    ----------
    comm : mpi4py communicator
        Of ``P * Q`` ranks.
    nc : sequence of 3 int
        Mesh cells per axis.
    grid : (int, int)
        Process grid (the first two axes split, the third local, as ours).
    real : bool
        True: real-to-complex transform of a real field (half spectrum);
        False: complex-to-complex transform of the field cast to complex.
    single : bool
        float32/complex64 (True) or float64/complex128.

    Yields
    ------
    Runner
        ``info``: ``build_s`` (plan set-up, slowest rank) [s] and
        ``max_abs_error`` of one round trip (all ranks).
    """
    from mpi4py import MPI
    from mpi4py_fft import PFFT, newDistArray

    P, Q = grid
    if comm.Get_size() != P * Q:
        raise ValueError("mpi4py-fft: grid %dx%d needs %d ranks, the communicator has %d"
                         % (P, Q, P * Q, comm.Get_size()))
    dtype = (np.float32 if single else np.float64) if real else (
        np.complex64 if single else np.complex128)
    comm.Barrier()
    t0 = time.perf_counter()
    # axes=(0, 1, 2): the last axis is transformed first (r2c along it, like ours).
    plan = PFFT(comm, list(nc), axes=(0, 1, 2), dtype=dtype, grid=(P, Q, 1), backend="fftw")
    u = newDistArray(plan, False)
    rng = np.random.default_rng(comm.Get_rank())
    u[:] = rng.standard_normal(u.shape)
    uh = newDistArray(plan, True)
    v = newDistArray(plan, False)
    build_s = max(comm.allgather(time.perf_counter() - t0))

    def run():
        plan.forward(u, uh)
        plan.backward(uh, v)

    run()
    err = comm.allreduce(float(np.max(np.abs(v - u))), op=MPI.MAX)
    try:
        yield Runner(run, {"build_s": build_s, "max_abs_error": err})
    finally:
        plan.destroy()


def time_mtf_roundtrip(conf, mesh_impl, devices=("",), session_config=None, warmup=1,
                       repeats=5, barrier=None, reduce_max=None):
    """Time :func:`mtf_roundtrip_runner` alone (see :func:`timed_runs`)."""
    with mtf_roundtrip_runner(conf, mesh_impl, devices, session_config) as r:
        return interleaved({"ours": r}, warmup, repeats, barrier, reduce_max)["ours"]


def time_mpi4py_fft_roundtrip(comm, nc, grid, real=False, single=True, warmup=1, repeats=5):
    """Time :func:`mpi4py_fft_roundtrip_runner` alone, slowest rank (see :func:`timed_runs`)."""
    with mpi4py_fft_roundtrip_runner(comm, nc, grid, real, single) as r:
        return interleaved({"mpi4py-fft": r}, warmup, repeats, comm.Barrier,
                           lambda dt: max(comm.allgather(dt)))["mpi4py-fft"]
