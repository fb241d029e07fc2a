"""MRI data of ``mri_mtf``: the phantom, the sampling mask and the k-space noise are
the same on every process grid and equal to their numpy references; bad input gets one
clear ValueError."""
import numpy as np
import pytest
import mesh_tensorflow as mtf

import fpm_harness as H
from flowpm_mtf import layout
from mri_mtf import operators, phantom, sampling
from mri_mtf.config import ImagingConfig

CASES = H.cases(single=True)
SHAPES = [(8, 12, 16)]


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("nc", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_phantom_mask_noise_match_numpy(case, nc):
    """Each rank generates its slice; the gathered fields equal the whole-volume numpy
    references (phantom: bit for bit away from the ellipsoid surfaces; noise: bit for
    bit)."""
    conf = ImagingConfig(nc=nc, grid=case[1], dtype="float64", noise_sigma=0.1, seed=7)
    table = phantom.perturbed_table(3, 0.05)

    def build(mesh):
        return {"ph": phantom.phantom(mesh, conf), "pt": phantom.phantom(mesh, conf, table),
                "mask": sampling.mask(mesh, conf), "noise": sampling.complex_noise(mesh, conf)}

    out = H.run(case[0], conf, build)
    for key, tab in (("ph", None), ("pt", table)):
        ref = phantom.phantom_numpy(nc, tab)
        safe = phantom.boundary_margin(nc, tab) > 1e-12
        assert safe.mean() > 0.999
        assert np.array_equal(out[key][safe], ref[safe]), key
        assert np.max(np.abs(out[key] - ref)) <= 1.0  # at most one ellipsoid flips
    assert np.array_equal(out["mask"], sampling.mask_numpy(conf, stored=True))
    assert np.array_equal(layout.to_natural(out["noise"]), sampling.complex_noise_numpy(conf))


@pytest.mark.rank_independent
def test_phantom_values():
    """The modified Shepp-Logan intensities: skull 1, brain 0.2, ventricles 0, outside 0."""
    p = phantom.phantom_numpy(32)
    assert set(np.round(np.unique(p), 6)) <= {0.0, 0.1, 0.2, 0.3, 0.4, 1.0}
    c = 16
    assert p[c, c, c] == pytest.approx(0.2)        # brain at the centre
    assert p[0, 0, 0] == 0.0                       # outside the head
    assert p[c, 1, c] == pytest.approx(1.0)        # skull at the edge of the y axis
    assert phantom.phantom_numpy(16, dtype=np.float32).dtype == np.float32


@pytest.mark.rank_independent
@pytest.mark.parametrize("R", [4, 8])
@pytest.mark.parametrize("n", [16, 32])
def test_mask_density_and_centre(R, n):
    """round(n^2 / R) samples, the centre fully sampled, density falling with |k|."""
    conf = ImagingConfig(nc=n, acceleration=R)
    m = sampling.mask_numpy(conf)
    assert m.sum() == conf.n_samples == round(n * n / R)
    assert m[0, 0] == 1 and m[0, 1] == m[1, 0] == m[-1, 0] == m[0, -1] == 1
    f = np.fft.fftfreq(n)
    r = np.sqrt(f[:, None] ** 2 + f[None, :] ** 2)
    inner, outer = m[r < 0.2].mean(), m[r > 0.35].mean()
    assert inner > outer
    # the same seed gives the same mask; another seed another one (outside the centre)
    assert np.array_equal(m, sampling.mask_numpy(conf))
    assert not np.array_equal(m, sampling.mask_numpy(conf.replace(seed=1)))
    assert np.array_equal(layout.to_natural(sampling.mask_numpy(conf, stored=True), (0, 1)), m)


@pytest.mark.rank_independent
def test_noise_statistics():
    conf = ImagingConfig(nc=16, noise_sigma=0.5)
    n = sampling.complex_noise_numpy(conf)
    assert n.dtype == np.complex64
    assert np.mean(np.abs(n) ** 2) == pytest.approx(0.25, rel=0.05)
    assert abs(np.mean(n.real * n.imag)) < 0.01


@pytest.mark.rank_independent
@pytest.mark.parametrize("kw,msg", [
    (dict(nc=16, grid=(3, 1)), "grid \\(3, 1\\) does not divide the volume"),
    (dict(nc=(16, 16, 12), grid=(1, 8)), "nc\\[2\\] \\(kz"),
    (dict(acceleration=0.5), "acceleration R=0.5 must be in"),
    (dict(nc=8, acceleration=100), "acceleration R=100"),
    (dict(nc=8, acceleration=60, centre_fraction=0.01), "samples no centre"),
    (dict(acceleration=float("nan")), "acceleration must be a finite number"),
    (dict(nc=(16, 16)), "nc must be"),
    (dict(dtype="float16"), "dtype must be one of"),
    (dict(noise_sigma=-1), "noise_sigma must be >= 0"),
])
def test_config_rejects_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg) as err:
        ImagingConfig(**kw)
    assert "\n" not in str(err.value)


@pytest.mark.rank_independent
def test_operators_reject_a_wrong_mask():
    conf = ImagingConfig(nc=8)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    img = mtf.zeros(mesh, operators.image_shape(conf))
    bad = mtf.zeros(mesh, mtf.Shape([mtf.Dimension("ky", 8), mtf.Dimension("kz", 4)]))
    msg = "the mask must have shape \\[ky=8, kz=8\\] .*got \\[ky=8, kz=4\\]"
    with pytest.raises(ValueError, match=msg) as err:
        operators.forward(img, bad, conf)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="the image must have shape"):
        operators.fft_ortho(mtf.zeros(mesh, sampling.mask_shape(conf)), conf)
