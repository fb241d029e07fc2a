r"""Statistics of convergence maps (numpy): the measured flat-sky C_ell of a map and the
Limber prediction from the planes' 3D power.

:func:`kappa_power_spectrum` tapers the map (not periodic) before its FFT;
:func:`limber_cl` sums the planes' P(k) at :math:`k = \ell / r_i` with the Born
weights (:func:`flowpm_mtf.physics.lensing_geometry.born_coefficients`), through
the bilinear interpolation's window and images (:func:`interpolated_power`). The
expected C_ell of a whole lensing run, through all of its windows, is
:mod:`flowpm_mtf.physics.lensing_theory`'s.
"""
import numpy as np

from .lensing_geometry import born_coefficients

__all__ = ["DEFAULT_TAPER", "kappa_power_spectrum", "shear_eb_power", "interpolated_power",
           "limber_cl"]

# Default apodisation of kappa_power_spectrum: 10 % of the side at each edge keeps 64 %
# of the map's area at full weight and removed the edge leakage in our tests.
DEFAULT_TAPER = 0.1


def kappa_power_spectrum(kappa, field_deg, edges=None, taper=DEFAULT_TAPER):
    r"""Flat-sky angular power spectrum of a square map (numpy).

    :math:`\hat C_\ell = \langle |\tilde\kappa(\boldsymbol\ell)|^2 \rangle /
    (\Omega\, \overline{w^2})` with :math:`\tilde\kappa = \Delta\theta^2\,
    \mathrm{FFT}(w\,(\kappa - \bar\kappa))` and :math:`\Omega = (n\Delta\theta)^2`,
    averaged over the modes of each :math:`|\boldsymbol\ell|` bin. The map is
    not periodic: without apodisation its edges leak low-ell power to all ell
    (we measured up to 3x the Limber C_ell at ell ~ 2000 on the default run), so
    it is multiplied by :math:`w`, a cosine taper from 0 to 1 over the fraction
    ``taper`` of the side at each edge (1 inside); :math:`\overline{w^2}`
    restores the normalisation of a statistically homogeneous map.

    Parameters
    ----------
    kappa : ndarray
        ``[npix, npix]`` map [dimensionless].
    field_deg : float
        Side of the map [deg].
    edges : array_like, optional
        Bin edges in ell; default: width = 2 fundamentals, from 1/2 fundamental
        to the pixel Nyquist frequency.
    taper : float, optional
        Fraction of the side tapered at each edge, in [0, 0.5] (0: no taper).

    Returns
    -------
    ell, cl, n_modes : ndarray
        Mean ell of each bin, :math:`\hat C_\ell` [sr] and the number of FFT modes
        (both members of each :math:`\pm\boldsymbol\ell` pair); empty bins hold 0.
    """
    kappa = np.asarray(kappa, np.float64)
    n = kappa.shape[0]
    if kappa.ndim != 2 or kappa.shape[1] != n:
        raise ValueError("kappa_power_spectrum: expected a square map, got shape %s"
                         % (kappa.shape,))
    if not 0.0 <= taper <= 0.5:
        raise ValueError("kappa_power_spectrum: taper must be in [0, 0.5], got %r" % taper)
    x = (np.arange(n) + 0.5) / n
    ramp = np.minimum(1.0, np.minimum(x, 1.0 - x) / taper) if taper > 0 else np.ones(n)
    w1 = 0.5 - 0.5 * np.cos(np.pi * ramp)
    w = w1[:, None] * w1[None, :]
    dtheta = np.deg2rad(field_deg) / n
    lf = 2.0 * np.pi / (n * dtheta)
    if edges is None:
        edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * lf
    edges = np.asarray(edges, np.float64)
    lk = 2.0 * np.pi * np.fft.fftfreq(n, d=dtheta)
    ell = np.sqrt(lk[:, None]**2 + lk[None, :]**2).ravel()
    power = (np.abs(np.fft.fft2(w * (kappa - kappa.mean())))**2).ravel() * dtheta**2 / n**2
    power /= np.mean(w**2)
    b = np.digitize(ell, edges) - 1
    ok = (b >= 0) & (b < edges.size - 1) & (ell > 0)
    nb = edges.size - 1
    modes = np.bincount(b[ok], minlength=nb).astype(np.float64)
    safe = np.maximum(modes, 1.0)
    return (np.bincount(b[ok], ell[ok], nb) / safe, np.bincount(b[ok], power[ok], nb) / safe,
            modes)


def shear_eb_power(gamma1, gamma2, field_deg, edges=None, taper=DEFAULT_TAPER):
    r"""E- and B-mode power of a square shear map (flat sky, numpy).

    :math:`\hat E = \cos 2\phi_\ell\,\hat\gamma_1 + \sin 2\phi_\ell\,\hat\gamma_2`,
    :math:`\hat B = -\sin 2\phi_\ell\,\hat\gamma_1 + \cos 2\phi_\ell\,\hat\gamma_2` of
    the tapered components, binned and normalised as :func:`kappa_power_spectrum`
    (the E power of the shear of a convergence map is its C_ell; a shear from a
    potential has no B).

    Returns
    -------
    ell, cl_e, cl_b, n_modes : ndarray
        [sr] for the powers.
    """
    g1, g2 = (np.asarray(g, np.float64) for g in (gamma1, gamma2))
    n = g1.shape[0]
    if g1.shape != (n, n) or g2.shape != (n, n):
        raise ValueError("shear_eb_power: expected two square maps of one shape, got %s, %s"
                         % (g1.shape, g2.shape))
    w = _taper_2d(n, taper)
    dtheta = np.deg2rad(field_deg) / n
    f = np.fft.fftfreq(n)
    lx, ly = f[:, None], f[None, :]
    l2 = np.where(lx**2 + ly**2 > 0, lx**2 + ly**2, 1.0)
    c2, s2 = (lx**2 - ly**2) / l2, 2 * lx * ly / l2
    h1, h2 = np.fft.fft2(w * (g1 - g1.mean())), np.fft.fft2(w * (g2 - g2.mean()))
    out = []
    for mode in (c2 * h1 + s2 * h2, -s2 * h1 + c2 * h2):
        power = np.abs(mode)**2 * dtheta**2 / n**2 / np.mean(w**2)
        ell, cl, modes = _bin_power(power, n, dtheta, edges)
        out.append(cl)
    return ell, out[0], out[1], modes


def _taper_2d(n, taper):
    x = (np.arange(n) + 0.5) / n
    ramp = np.minimum(1.0, np.minimum(x, 1.0 - x) / taper) if taper > 0 else np.ones(n)
    w1 = 0.5 - 0.5 * np.cos(np.pi * ramp)
    return w1[:, None] * w1[None, :]


def _bin_power(power, n, dtheta, edges):
    lf = 2.0 * np.pi / (n * dtheta)
    if edges is None:
        edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * lf
    edges = np.asarray(edges, np.float64)
    lk = 2.0 * np.pi * np.fft.fftfreq(n, d=dtheta)
    ell = np.sqrt(lk[:, None]**2 + lk[None, :]**2).ravel()
    b = np.digitize(ell, edges) - 1
    ok = (b >= 0) & (b < edges.size - 1) & (ell > 0)
    nb = edges.size - 1
    modes = np.bincount(b[ok], minlength=nb).astype(np.float64)
    safe = np.maximum(modes, 1.0)
    return (np.bincount(b[ok], ell[ok], nb) / safe,
            np.bincount(b[ok], np.ravel(power)[ok], nb) / safe, modes)


def interpolated_power(k, conf, table, n_angles=64):
    r"""Expected power of a bilinearly interpolated plane at transverse ``k`` (numpy).

    Bilinear interpolation of grid values is a convolution of the sampled field
    with the tent kernel, so the power of the interpolated field is
    :math:`\mathrm{sinc}^4(k_x\Delta_x/2)\,\mathrm{sinc}^4(k_y\Delta_y/2)\,
    P_g(\mathbf k)` with :math:`P_g` the (periodic) power of the grid: for
    :math:`|k_i|` beyond the Nyquist frequency it is the grid's power at the
    folded wavevector (images). Averaged over ``n_angles`` directions.

    Parameters
    ----------
    k : array_like
        Transverse wavenumbers [h/Mpc].
    conf : SimConfig
    table : (k_tab, p_tab)
        Increasing wavenumbers [h/Mpc] and the grid's power [(Mpc/h)^3]
        (e.g. :func:`flowpm_mtf.physics.power.power_spectrum` of the painted particles,
        not deconvolved); log-log interpolation, 0 below ``k_tab[0]`` (no mode
        below the box's fundamental), the last value above ``k_tab[-1]`` (the
        corners of the Nyquist square).

    Returns
    -------
    ndarray
        [(Mpc/h)^3], shape of ``k``.
    """
    k = np.asarray(k, np.float64)
    k_tab, p_tab = (np.asarray(v, np.float64) for v in table)
    phi = (np.arange(n_angles) + 0.5) * (0.5 * np.pi / n_angles)
    out = np.ones(k.shape + (n_angles,))
    folded = np.zeros(k.shape + (n_angles,))
    for axis, trig in ((0, np.cos), (1, np.sin)):
        d = conf.cell_size[axis]
        kk = k[..., None] * trig(phi)
        out *= np.sinc(kk * d / (2 * np.pi))**4
        nyq = np.pi / d
        folded += (np.mod(kk + nyq, 2 * nyq) - nyq)**2
    folded = np.sqrt(folded)
    p = np.exp(np.interp(np.log(np.maximum(folded, k_tab[0])), np.log(k_tab), np.log(p_tab)))
    p[folded < k_tab[0]] = 0.0
    return (out * p).mean(axis=-1)


def limber_cl(ell, conf, geom, power_at_planes, source=0, interpolation=True):
    r"""Limber prediction of :math:`C_\ell` from the planes' 3D power spectra (numpy).

    .. math::

        C_\ell = \Big(\frac32\Omega_m\frac{H_0^2}{c^2}\Big)^2 \sum_i \Delta r\,
            \frac{(1 - r_i/r_s)_+^2}{a_i^2}\, \tilde P_i(k = \ell / r_i)

    (flat sky, :math:`k = \ell/r`): the discrete form of the Born sum for
    uncorrelated shells, each contributing :math:`P_i(\ell/r_i)/(\Delta r\,
    r_i^2)` (Limber: :math:`k_\perp\Delta r \gg 1`). :math:`\tilde P_i` is the
    3D power at plane ``i`` as seen through the bilinear interpolation
    (:func:`interpolated_power`, with images beyond the Nyquist frequency), or,
    with ``interpolation=False``, :math:`P_i` itself (log-log interpolated, 0
    outside the table).

    Parameters
    ----------
    ell : array_like
        Multipoles.
    conf : SimConfig
    geom : LightconeGeometry
    power_at_planes : list of (k, pk)
        Per plane: increasing wavenumbers [h/Mpc] and the 3D power [(Mpc/h)^3],
        e.g. the simulation's measured P(k) at :math:`a_i` (CIC window not
        deconvolved: the planes are painted with the same window).
    source : int
        Index of the source redshift.
    interpolation : bool
        Include the interpolation window and images.

    Returns
    -------
    ndarray
        :math:`C_\ell` [sr], shape of ``ell``.
    """
    ell = np.asarray(ell, np.float64)
    coef = born_coefficients(conf, geom)[source]
    out = np.zeros_like(ell)
    for i in range(geom.n_planes):
        if coef[i] <= 0:
            continue
        k_tab, p_tab = (np.asarray(v, np.float64) for v in power_at_planes[i])
        k = ell / geom.r[i]
        if interpolation:
            pk = interpolated_power(k, conf, (k_tab, p_tab))
        else:
            inside = (k >= k_tab[0]) & (k <= k_tab[-1])
            pk = np.zeros_like(k)
            pk[inside] = np.exp(np.interp(np.log(k[inside]), np.log(k_tab), np.log(p_tab)))
        # coef_i^2 / (width r_i^2) = (3/2 Om/RH^2)^2 width (1 - r/rs)^2 / a^2
        out += coef[i]**2 / (geom.width[i] * geom.r[i]**2) * pk
    return out
