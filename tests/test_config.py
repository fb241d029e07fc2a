"""SimConfig / Cosmology: defaults, derived values, serialisation and validation."""
import dataclasses
import json

import numpy as np
import pytest

from flowpm_mtf import config as cfg
from flowpm_mtf.config import Cosmology, SimConfig


def test_defaults_and_expansion():
    c = SimConfig()
    assert c.nc == (64, 64, 64) and c.box_size == (200.0, 200.0, 200.0)
    assert c.grid == (1, 1) and c.lpt_order == 2 and c.dtype == "float32" and c.seed == 42
    c = SimConfig(nc=16, box_size=100, grid=(2, 2), halo_size=2)
    assert c.nc == (16, 16, 16) and c.box_size == (100.0, 100.0, 100.0)
    assert isinstance(c.nc[0], int) and isinstance(c.box_size[0], float)


def test_derived_properties_non_cubic():
    c = SimConfig(nc=(8, 12, 16), box_size=(80.0, 60.0, 40.0), grid=(2, 4), halo_size=1,
                  dtype="float64")
    assert c.cell_size == (10.0, 5.0, 2.5)
    assert c.block_shape == (4, 3, 16)
    assert c.padded_block_shape == (6, 5, 16)
    assert c.n_ranks == 8 and c.n_cells == 8 * 12 * 16
    assert c.mesh_shape == [("row", 2), ("col", 4)]
    assert c.np_dtype == np.float64 and c.np_complex_dtype == np.complex128
    import tensorflow.compat.v1 as tf
    assert c.tf_dtype == tf.float64 and c.tf_complex_dtype == tf.complex128
    rules = dict(c.layout_rules)
    assert rules == {cfg.X: "row", cfg.Y: "col", cfg.KY: "row", cfg.KZ: "col",
                     cfg.BX: "row", cfg.BY: "col"}
    # every dimension named in the package is either in the rules or local
    local = {cfg.Z, cfg.KX, cfg.SX, cfg.SY, cfg.PX, cfg.PY, cfg.NPART, cfg.XYZ}
    assert not local & set(rules)


def test_frozen_replace_and_json_round_trip():
    c = SimConfig(nc=(8, 8, 4), grid=(2, 1), halo_size=2, cosmology=Cosmology(sigma8=0.7))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nc = (4, 4, 4)
    d = c.to_dict()
    s = json.dumps(d)  # JSON-able
    assert SimConfig.from_dict(json.loads(s)) == c
    assert SimConfig.from_json(c.to_json()) == c
    c2 = c.replace(n_steps=3)
    assert c2.n_steps == 3 and c2.nc == c.nc and c.n_steps == 10
    with pytest.raises(ValueError, match="halo_size=5"):
        c.replace(halo_size=5)
    with pytest.raises(ValueError, match="unknown SimConfig fields"):
        SimConfig.from_dict(dict(d, bogus=1))


def test_cosmology_matches_flowpm_planck15():
    """Defaults equal single-device FlowPM's Planck 2015 parameters (FlowPM 0.1.1)."""
    from flowpm import tfbackground
    ref = tfbackground.cosmo
    c = Cosmology()
    d = c.to_flowpm_dict()
    for key in ("Omega0_c", "Omega0_b", "h", "n_s", "sigma8", "w0", "wa", "Omega0_k"):
        assert d[key] == pytest.approx(ref[key], abs=0), key
    # FlowPM rounds Omega0_m and Omega0_de to 4 digits
    assert d["Omega0_m"] == pytest.approx(ref["Omega0_m"], abs=1e-4)
    assert d["Omega0_de"] == pytest.approx(ref["Omega0_de"], abs=1e-4)
    assert Cosmology.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("kw, match", [
    (dict(nc=(10, 8, 8), grid=(4, 1)), r"nc\[0\].*10.*4"),
    (dict(nc=(8, 10, 8), grid=(1, 4)), r"nc\[1\].*10.*4"),
    (dict(nc=(8, 6, 8), grid=(4, 2), halo_size=1), r"nc\[1\].*ky.*6.*4"),
    (dict(nc=(8, 8, 6), grid=(1, 4), halo_size=1), r"nc\[2\].*kz.*6.*4"),
    (dict(nc=8, grid=(0, 1)), r"grid entries.*\(0, 1\)"),
    (dict(nc=8, grid=(2,)), r"grid must be a pair"),
    (dict(nc=16, grid=(2, 2), halo_size=8), r"halo_size=8.*block size"),
    (dict(nc=16, grid=(2, 2), halo_size=-1), r"halo_size \(--halo\) must be >= 1 cell.*-1"),
    (dict(nc=16, grid=(2, 2), halo_size=0), r"halo_size \(--halo\) must be >= 1 cell.*got 0"),
    (dict(nc=(2, 16, 16), grid=(2, 1)), r"blocks of \(1, 16\) cells.*halo of >= 1"),
    (dict(nc="thirty-two"), r"nc must be an integer or 3 integers, got 'thirty-two'"),
    (dict(nc=None), r"nc must be an integer or 3 integers, got None"),
    (dict(nc=(8, "8", 8)), r"nc must be a scalar or have 3 entries"),
    (dict(box_size=float("inf")), r"box_size must be positive and finite.*inf"),
    (dict(grid="2x1"), r"grid must be a pair of integers.*'2x1'"),
    (dict(a_end=float("inf")), r"a_end must be a finite number, got inf"),
    (dict(a_start=float("nan")), r"a_start must be a finite number, got nan"),
    (dict(dtype=["float32"]), r"dtype must be one of float32, float64, got \['float32'\]"),
    (dict(decomposition=None), r"decomposition must be one of eulerian, lagrangian, got None"),
    (dict(cosmology={"Omega_cc": 0.3}), r"unknown cosmology key 'Omega_cc' "
                                         r"\(did you mean 'Omega_c'\?\)"),
    (dict(cosmology=None), r"cosmology must be a dict of Cosmology fields"),
    (dict(nc=16, halo_size=1.5), r"halo_size must be an int.*1.5"),
    (dict(a_start=0.5, a_end=0.5), r"a_start=0.5, a_end=0.5"),
    (dict(a_start=0.0), r"a_start=0.0"),
    (dict(n_steps=0), r"n_steps must be >= 1, got 0"),
    (dict(lpt_order=3), r"lpt_order must be 1 or 2, got 3"),
    (dict(dtype="float16"), r"dtype.*float16"),
    (dict(nc=(8, 0, 8)), r"nc must be positive.*\(8, 0, 8\)"),
    (dict(nc=(8, 8)), r"nc must be a scalar or have 3 entries"),
    (dict(nc=8.5), r"nc must hold integers"),
    # beyond 64 bits: numpy's isfinite cannot take the int (it raised its ufunc TypeError)
    (dict(nc=99999999999999999999999), r"nc must hold 64-bit integers.*9{23}"),
    (dict(nc=(16, 16, -2**63 - 1)), r"nc must hold 64-bit integers"),
    (dict(box_size=10**400), r"box_size must hold finite numbers"),
    (dict(n_steps=10**23), r"n_steps must be a 64-bit integer.*10{23}"),
    (dict(box_size=(100.0, -1.0, 100.0)), r"box_size must be positive.*-1.0"),
    (dict(seed=-3), r"seed must be in.*-3"),
    (dict(cosmology=Cosmology(h=0.7).to_dict() | {"h": -0.1}), r"Cosmology.h must be positive"),
])
def test_validation_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**kw)


def test_cosmology_validation():
    with pytest.raises(ValueError, match="Omega_c must be positive"):
        Cosmology(Omega_c=0.0)
    with pytest.raises(ValueError, match="sigma8 must be finite"):
        Cosmology(sigma8=float("nan"))
    assert Cosmology().Omega_m == pytest.approx(0.2589 + 0.0486)


def test_decomposition_halo_and_capacity():
    """Eulerian (default): automatic halo 2; lagrangian: min(8, block - 1); capacities
    are validated against the lattice count of a block."""
    c = SimConfig(nc=16, grid=(2, 2))
    assert c.decomposition == "eulerian" and c.halo_size == 2
    assert c.capacity is None and c.send_capacity is None and c.particles_per_block == 1024
    assert SimConfig(nc=16, grid=(2, 2), decomposition="lagrangian").halo_size == 7
    assert SimConfig(nc=64, decomposition="lagrangian").halo_size == 8
    assert SimConfig(nc=16, grid=(2, 2), halo_size=3).halo_size == 3      # expert override
    assert SimConfig(nc=16, grid=(2, 2), capacity=2000).capacity == 2000
    with pytest.raises(ValueError, match="decomposition must be one of"):
        SimConfig(decomposition="bogus")
    with pytest.raises(ValueError, match="capacity=100 is smaller than the 1024"):
        SimConfig(nc=16, grid=(2, 2), capacity=100)
    with pytest.raises(ValueError, match="lagrangian decomposition holds exactly"):
        SimConfig(nc=16, grid=(2, 2), capacity=2000, decomposition="lagrangian")
    with pytest.raises(ValueError, match="send_capacity must be a positive int"):
        SimConfig(send_capacity=0)
