"""An independent numpy P(k) of particles: CIC, FFT, shells, for the cross-check of the package's.

Single process, float64, written from the estimator's definition
(docs/output.md: ``power.txt``; :mod:`flowpm_mtf.physics.power`), sharing no code
with the package: its own cloud-in-cell assignment (``np.bincount`` over the 8
corners), ``numpy.fft.rfftn``, the full-spectrum mode count (a half-spectrum mode
off the ``kz = 0`` and Nyquist planes stands for its mirror), linear shells of
width ``2 pi / L`` centred on its multiples up to the Nyquist frequency, and the
CIC window ``prod_i sinc^2(k_i dx_i / 2)`` divided out on request. No shot noise
is subtracted (nor is it by the package). Used by ``tests/test_gadget4.py`` and
``scripts/bench_pk_check.py``.
"""
import numpy as np

__all__ = ["cic_density", "shell_edges", "power_spectrum"]


def cic_density(positions, nc, box_size):
    """Cloud-in-cell density of unit-weight particles (``1 + delta`` for one particle per cell).

    Parameters
    ----------
    positions : array_like
        ``[N, 3]`` [Mpc/h], any values (wrapped periodically).
    nc : sequence of int
        Mesh cells per axis.
    box_size : sequence of float
        Box sides [Mpc/h].

    Returns
    -------
    ndarray
        float64 ``nc``: the CIC count of unit-weight particles per cell (the
        package's runs have one particle per cell: mean 1).
    """
    nc = np.asarray(nc, np.int64)
    x = np.asarray(positions, np.float64) / (np.asarray(box_size, np.float64) / nc)
    x = np.mod(x, nc)
    i0 = np.floor(x).astype(np.int64)
    d = x - i0
    i0 %= nc
    i1 = (i0 + 1) % nc
    out = np.zeros(int(np.prod(nc)), np.float64)
    for cx in (0, 1):
        ix = i1[:, 0] if cx else i0[:, 0]
        wx = d[:, 0] if cx else 1.0 - d[:, 0]
        for cy in (0, 1):
            iy = i1[:, 1] if cy else i0[:, 1]
            wy = d[:, 1] if cy else 1.0 - d[:, 1]
            for cz in (0, 1):
                iz = i1[:, 2] if cz else i0[:, 2]
                wz = d[:, 2] if cz else 1.0 - d[:, 2]
                flat = (ix * nc[1] + iy) * nc[2] + iz
                out += np.bincount(flat, weights=wx * wy * wz, minlength=out.size)
    return out.reshape(tuple(nc))


def shell_edges(nc, box_size):
    """Shell edges [h/Mpc]: ``(j + 1/2) dk``, ``dk = 2 pi / min(L)``, up to the smallest Nyquist.

    The number of shells is ``max(1, round(k_nyq / dk))``, ``k_nyq = min_i pi nc_i / L_i``.
    """
    box = np.asarray(box_size, np.float64)
    dk = 2.0 * np.pi / box.min()
    k_nyq = np.min(np.pi * np.asarray(nc, np.float64) / box)
    n = max(1, int(np.floor(k_nyq / dk + 0.5)))
    return (np.arange(n + 1) + 0.5) * dk


def power_spectrum(delta, box_size, edges=None, deconvolve_cic=False):
    """Shell-averaged P(k) of a real field on a periodic mesh.

    Parameters
    ----------
    delta : ndarray
        ``[NX, NY, NZ]`` density contrast.
    box_size : sequence of float
        [Mpc/h].
    edges : array_like, optional
        Shell edges [h/Mpc] (default :func:`shell_edges`); shells are half-open
        ``[e_b, e_b+1)``.
    deconvolve_cic : bool
        Divide every mode by the CIC window squared.

    Returns
    -------
    (ndarray, ndarray, ndarray)
        Mean ``|k|`` of the shell's modes [h/Mpc], P(k) [(Mpc/h)^3] =
        ``V <|fftn(delta)/N|^2>`` over the shell, and the number of modes of
        the full spectrum (``k = 0`` excluded).
    """
    delta = np.asarray(delta, np.float64)
    nc = np.array(delta.shape)
    box = np.asarray(box_size, np.float64)
    edges = shell_edges(nc, box) if edges is None else np.asarray(edges, np.float64)
    cell = box / nc
    fk = np.fft.rfftn(delta) / delta.size
    power = fk.real ** 2 + fk.imag ** 2
    kx = 2 * np.pi * np.fft.fftfreq(nc[0], cell[0])[:, None, None]
    ky = 2 * np.pi * np.fft.fftfreq(nc[1], cell[1])[None, :, None]
    kz = 2 * np.pi * np.fft.rfftfreq(nc[2], cell[2])[None, None, :]
    knorm = np.sqrt(kx ** 2 + ky ** 2 + kz ** 2)
    if deconvolve_cic:
        window = (np.sinc(kx * cell[0] / (2 * np.pi)) * np.sinc(ky * cell[1] / (2 * np.pi))
                  * np.sinc(kz * cell[2] / (2 * np.pi))) ** 2
        power = power / window ** 2
    weight = np.full(knorm.shape[2], 2.0)   # each half-spectrum mode and its mirror ...
    weight[0] = 1.0                         # ... but the kz = 0 plane holds both members
    if nc[2] % 2 == 0:
        weight[-1] = 1.0                    # and so does the kz Nyquist plane
    weight = np.broadcast_to(weight[None, None, :], knorm.shape)
    shell = np.digitize(knorm, edges) - 1   # edges[b] <= |k| < edges[b + 1]
    ok = (shell >= 0) & (shell < len(edges) - 1) & (knorm > 0)
    n_bins = len(edges) - 1
    modes = np.bincount(shell[ok], weights=weight[ok], minlength=n_bins)
    ksum = np.bincount(shell[ok], weights=(weight * knorm)[ok], minlength=n_bins)
    psum = np.bincount(shell[ok], weights=(weight * power)[ok], minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return ksum / modes, np.prod(box) * psum / modes, modes
