"""The brain volume (:mod:`mri_mtf.volume`): the MNI152 template from nilearn's wheel, its
box, the resampling (rows of weights, slabs read separately equal the whole, ``.nii`` and
``.nii.gz`` alike, anisotropic voxels resampled to their physical aspect, an oblique
affine refused), the brain mask's share; the augmentation's k-space shift is a
circular shift (:mod:`mri_mtf.augment`)."""
import os

import numpy as np
import pytest

from mri_mtf import augment, volume

pytestmark = pytest.mark.rank_independent
pytest.importorskip("nibabel")   # nibabel and nilearn: not in the tf2.12 stack's requirements
pytest.importorskip("nilearn")

NC = (24, 20, 16)
# sums of a few products of float64 weights: rounding only
RTOL = 1e-12


@pytest.fixture(scope="module")
def mni():
    import nibabel as nib

    path = volume.source_path("mni152")
    return path, np.asarray(nib.load(path).dataobj)


def test_mni152_is_the_shipped_template_and_its_box(mni):
    path, data = mni
    assert path.endswith(os.path.join("nilearn", "datasets", "data", volume.MNI152_FILE))
    assert data.shape == (197, 233, 189)
    nz = np.nonzero(data)
    assert tuple((int(i.min()), int(i.max()) + 1) for i in nz) == volume.MNI152_BOX


def test_resampling_matrix_is_a_box_filter():
    w = volume.resampling_matrix(10, (0, 40), 4.0, 40)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=RTOL)
    # output voxel i covers source voxels 4i .. 4i + 3 (centres at 4i + 0.5 ... + 3.5)
    assert np.all(w[3, :11] == 0) and np.all(w[3, 17:] == 0)


def test_slabs_equal_the_whole_and_nii_equals_gz(mni, tmp_path):
    import nibabel as nib

    src = volume.VolumeSource("mni152", NC)
    whole = src.read((0, 0, 0), NC)
    assert whole.shape == NC and whole.max() > 0
    slabs = np.zeros(NC)
    for b0 in (0, 12):
        for b1 in (0, 10):
            slabs[b0:b0 + 12, b1:b1 + 10] = src.read((b0, b1, 0), (12, 10, NC[2]))
    np.testing.assert_allclose(slabs, whole, rtol=RTOL, atol=0)
    img = nib.load(mni[0])
    nib.save(nib.Nifti1Image(mni[1], img.affine), str(tmp_path / "t1.nii"))
    plain = volume.VolumeSource(str(tmp_path / "t1.nii"), NC)
    # a path's box is the whole volume: compare through the same matrices
    plain.box, plain.h = src.box, src.h
    plain.matrices = src.matrices
    np.testing.assert_allclose(plain.read((12, 0, 0), (12, 20, 16)), whole[12:], rtol=RTOL)
    share = np.mean(whole / whole.max() > volume.BRAIN_THRESHOLD)
    assert 0.2 < share < 0.6


def test_anisotropic_voxels_keep_the_physical_aspect(tmp_path):
    """A 32 x 32 x 8 file of 1 x 1 x 3 mm voxels (32 x 32 x 24 mm) into 16^3: 2 mm output
    voxels, the 24 mm along z fill the 12 middle planes (as cubes, the 8 voxels would
    fill 4 of 16). Reference: the box filter and the linear interpolation
    reproduce a field linear in millimetres, evaluated at the output voxels' centres."""
    import nibabel as nib

    shape, zooms, nc = (32, 32, 8), (1.0, 1.0, 3.0), (16, 16, 16)
    mm = [(np.arange(n) + 0.5) * d for n, d in zip(shape, zooms)]   # voxel centres [mm]
    data = 10.0 + mm[0][:, None, None] + 0.5 * mm[1][None, :, None] + 2.0 * mm[2][None, None, :]
    path = str(tmp_path / "aniso.nii")
    nib.save(nib.Nifti1Image(data, np.diag(zooms + (1.0,))), path)
    src = volume.VolumeSource(path, nc)
    assert src.zooms == zooms and src.voxel_mm == 2.0 and src.h == (2.0, 2.0, 2.0 / 3.0)
    out = src.read((0, 0, 0), nc)
    # the 12 middle planes (24 mm / 2 mm) inside, the outer ones beyond the linear
    # interpolation's half-voxel fade (planes 1 and 14 hold only the fade)
    assert np.all(out[:, :, 2:14] > 0) and np.all(out[:, :, [0, 15]] == 0)
    assert np.all(out.any(axis=(1, 2)))                            # 32 mm / 2 mm = 16
    # output centres [mm] (box centred): x, y: 1 + 2i; z: 12 + (k + 0.5 - 8) * 2
    ox = 1.0 + 2.0 * np.arange(16)
    oz = 12.0 + (np.arange(16) + 0.5 - 8) * 2.0
    want = 10.0 + ox[:, None, None] + 0.5 * ox[None, :, None] + 2.0 * oz[None, None, :]
    # inside the source's first and last voxel centres (beyond them the interpolation
    # fades to the zero background): x, y voxels 1..14, z planes whose centre lies in
    # [1.5, 22.5] mm and whose box reaches no further than the centres
    inner = (slice(1, 15), slice(1, 15), slice(3, 13))
    np.testing.assert_allclose(out[inner], want[inner], rtol=RTOL)


def test_oblique_affine_is_refused(tmp_path):
    import nibabel as nib

    c, s = np.cos(0.3), np.sin(0.3)
    affine = np.array([[c, -s, 0, 0], [s, c, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]])
    path = str(tmp_path / "oblique.nii")
    nib.save(nib.Nifti1Image(np.ones((16, 16, 16)), affine), path)
    with pytest.raises(ValueError, match="oblique affine"):
        volume.VolumeSource(path, (8, 8, 8))
    # a permutation with a flip is axis-aligned: its voxel sizes are the header's
    perm = np.array([[0, 2.0, 0, 0], [-1.0, 0, 0, 0], [0, 0, 1.5, 0], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(np.ones((16, 16, 16)), perm), path)
    assert volume.VolumeSource(path, (8, 8, 8)).zooms == (1.0, 2.0, 1.5)


def test_augmentation_shift_is_circular():
    from flowpm_mtf import layout

    nc = (8, 6, 4)
    rng = np.random.RandomState(1)
    x = rng.randn(*nc)
    for step in range(3):
        shift, scale = augment.augmentation_sample(step, 5, nc)
        assert 0.8 <= scale <= 1.2 and all(abs(s) <= n // 4 for s, n in zip(shift, nc))
        k = layout.to_stored(np.fft.fftn(x))
        for ax, (n, s) in enumerate(zip(nc, shift)):
            f = np.fft.fftfreq(n)[layout.k_order(n)]
            ph = np.exp(-2j * np.pi * f * s).reshape([-1 if a == ax else 1 for a in range(3)])
            k = k * ph
        got = np.fft.ifftn(layout.to_natural(k)).real
        np.testing.assert_allclose(got, np.roll(x, tuple(shift), axis=(0, 1, 2)), atol=1e-12)
