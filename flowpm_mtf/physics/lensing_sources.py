r"""The sources' redshift distributions (numpy): a Smail n(z) or a table file, and the
lensing efficiency of a tomographic bin.

A :class:`~flowpm_mtf.physics.lensing_geometry.LensingConfig` with ``nz_smail`` or
``nz_file`` asks for one convergence map per bin of ``nz_bins``: the Born sum then
weighs each plane by the bin's mean of :math:`(1 - r_i/\chi(z))_+` over its n(z)
(:func:`nz_efficiency`) instead of a single source's (``geometry.efficiency``,
:func:`flowpm_mtf.physics.lensing_geometry.geometry`).
"""
import numpy as np

from . import cosmology as cosmo_mod

__all__ = ["NZ_POINTS", "NZ_EMPTY_FRACTION", "source_nz", "read_nz_table", "nz_efficiency"]

# Points per tomographic bin of the n(z) integrals (midpoint rule; the efficiency is smooth
# in z but for the kink at chi(z) = r: 512 points give ~1e-6 relative error against scipy's quad, tests/test_lensing.py).
NZ_POINTS = 512
# A bin holding less than this fraction of the n(z) has "no sources".
NZ_EMPTY_FRACTION = 1e-6


def source_nz(lconf):
    r"""The source redshift distribution of a LensingConfig, or None.

    Returns
    -------
    callable or None
        ``n(z)`` [arbitrary units] on arrays of redshifts: Smail
        :math:`z^\alpha \exp(-(z/z_0)^\beta)` or the table of ``nz_file``
        (linear interpolation, 0 outside).

    Raises
    ------
    ValueError
        If the table file breaks a rule of :func:`read_nz_table` (named with its
        line).
    """
    if lconf.nz_smail:
        alpha, beta, z0 = lconf.nz_smail
        return lambda z: np.asarray(z, np.float64)**alpha * np.exp(-(np.asarray(z) / z0)**beta)
    if not lconf.nz_file:
        return None
    z_t, n_t = read_nz_table(lconf.nz_file)
    return lambda z: np.interp(z, z_t, n_t, left=0.0, right=0.0)


def read_nz_table(path):
    """The table of a source redshift distribution: two columns, z and n(z).

    Text, one row per line, the two numbers separated by blanks; ``#`` starts a
    comment, blank lines are skipped.

    Parameters
    ----------
    path : str

    Returns
    -------
    z, n : ndarray
        float64: redshifts [dimensionless], >= 0 and strictly increasing, and
        n(z) [arbitrary units], >= 0, not all zero.

    Raises
    ------
    ValueError
        One line ``nz_file=PATH: ...`` naming the rule that failed and, for a
        row, its line: the file cannot be read; a row without exactly two
        columns; a value that is no number, or NaN or infinite; a negative z or
        n(z); z not increasing; fewer than two rows; n(z) zero everywhere.
    """
    where = "nz_file=%s" % path
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError("%s: cannot read a table of z, n(z): not text (byte %d)"
                         % (where, e.start)) from None
    except OSError as e:
        raise ValueError("%s: cannot read a table of z, n(z): %s"
                         % (where, e.strerror or e)) from None
    rows, at = [], []
    for number, line in enumerate(lines, 1):
        cols = line.split("#", 1)[0].split()
        if not cols:
            continue
        if len(cols) != 2:
            raise ValueError("%s: line %d has %d columns, expected 2 (z and n(z)): %r"
                             % (where, number, len(cols), line.strip()))
        try:
            z, n = float(cols[0]), float(cols[1])
        except ValueError:
            raise ValueError("%s: line %d: %r is not a number" % (
                where, number, next(c for c in cols if not _is_float(c)))) from None
        for name, v in (("z", z), ("n(z)", n)):
            if not np.isfinite(v):
                raise ValueError("%s: line %d: %s = %s; z and n(z) must be finite"
                                 % (where, number, name, cols[0 if name == "z" else 1]))
            if v < 0:
                raise ValueError("%s: line %d: %s = %g is negative; %s"
                                 % (where, number, name, v, "redshifts are >= 0" if name == "z"
                                    else "n(z) is a density of sources, >= 0"))
        if rows and z <= rows[-1][0]:
            raise ValueError("%s: line %d: z = %g after z = %g on line %d; z must increase "
                             "from row to row" % (where, number, z, rows[-1][0], at[-1]))
        rows.append((z, n))
        at.append(number)
    if len(rows) < 2:
        raise ValueError("%s: %d row%s of z, n(z); the table needs at least two"
                         % (where, len(rows), "" if len(rows) == 1 else "s"))
    tab = np.asarray(rows, np.float64)
    if not np.any(tab[:, 1] > 0):
        raise ValueError("%s: n(z) is zero on every row; there are no sources" % where)
    return tab[:, 0].copy(), tab[:, 1].copy()


def _is_float(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def nz_efficiency(cosmo, nz, bins, r):
    r"""Lensing efficiency of each tomographic bin at distances ``r`` (numpy, float64).

    .. math::

        g_b(r) = rac{\int_{z_b}^{z_{b+1}} dz\, n(z)\, (1 - r/\chi(z))_+}
                      {\int_{z_b}^{z_{b+1}} dz\, n(z)}

    (midpoint rule on :data:`NZ_POINTS` points per bin).

    Parameters
    ----------
    cosmo : Cosmology
    nz : callable
        :func:`source_nz`.
    bins : sequence of float
        Bin edges in z.
    r : ndarray
        Comoving distances [Mpc/h].

    Returns
    -------
    ndarray
        ``[n_bins, r.size]`` [dimensionless].

    Raises
    ------
    ValueError
        If a bin holds less than :data:`NZ_EMPTY_FRACTION` of the sources of all bins.
    """
    bins = np.asarray(bins, np.float64)
    out, mass = [], []
    for lo, hi in zip(bins[:-1], bins[1:]):
        z = lo + (np.arange(NZ_POINTS) + 0.5) * (hi - lo) / NZ_POINTS
        w = np.asarray(nz(z), np.float64) * (hi - lo) / NZ_POINTS
        chi = np.asarray(cosmo_mod.comoving_distance(cosmo, 1.0 / (1.0 + z)))
        lens = np.clip(1.0 - np.asarray(r)[None, :] / chi[:, None], 0.0, None)
        mass.append(w.sum())
        out.append(w @ lens / w.sum() if w.sum() > 0 else np.zeros(np.size(r)))
    mass = np.asarray(mass)
    empty = np.nonzero(mass <= NZ_EMPTY_FRACTION * mass.sum())[0]
    if empty.size:
        i = int(empty[0])
        raise ValueError("nz_bins: bin %d (z %g-%g) holds no sources (fraction %.2g of the "
                         "n(z)); change the bins or the n(z)"
                         % (i, bins[i], bins[i + 1], mass[i] / max(mass.sum(), 1e-300)))
    return np.asarray(out)
