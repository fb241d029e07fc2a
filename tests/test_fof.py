"""Distributed friends-of-friends (flowpm_mtf.analysis.fof) against a serial reference.

The same particles on every grid of the world size (1x1; 2x1, 1x2; 2x2, 4x1), dealt to
the ranks at random: every particle's group (its smallest member id) equals the serial
reference's (cKDTree pairs + union-find on the whole test-sized set), and the catalogue
(sorted by smallest member id) equals the reference's groups, with their properties
computed by numpy. Constructed groups cross the periodic corner of the box, the corner of
four blocks, and three blocks in a row (a filament).
"""
import numpy as np
import pytest
from scipy.spatial import cKDTree

from flowpm_mtf.analysis import fof
from flowpm_mtf.errors import ConfigError

GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}
BOX = 40.0                 # [Mpc/h]
N_BACKGROUND = 3000        # uniform particles
MIN_MEMBERS = 8
# float64 sums of at most a few hundred terms, in another order: round-off only
POS_ATOL = 1e-9            # [Mpc/h], positions ~ 1e1
VEL_RTOL = 1e-10           # velocities ~ 1e2..1e3 km/s
VEL_ATOL = 1e-9            # [km/s], for mean velocities near 0
MASS = 1.5e10              # [M_sun/h] per particle


def world_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def grids():
    return GRIDS[world_comm().size]


# ----------------------------------------------------------------------------- the reference
def reference_labels(pos, ids, box, ll):
    """Serial FoF: cKDTree pairs within ``ll`` + union-find; each particle's smallest group id."""
    parent = np.arange(len(pos))

    def find(i):
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    for i, j in cKDTree(pos, boxsize=box).query_pairs(ll, output_type="ndarray"):
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    roots = np.array([find(i) for i in range(len(pos))])
    low = {}
    for r, i in zip(roots, ids):
        low[r] = min(low.get(r, i), i)
    return np.array([low[r] for r in roots], np.int64)


def reference_catalogue(pos, vel, ids, labels, box, min_members):
    """The halos of ``labels`` by numpy, sorted by smallest member id."""
    out = {k: [] for k in ("n", "position", "velocity", "sigma_v", "min_id", "members")}
    for lab in np.unique(labels):
        m = labels == lab
        if m.sum() < min_members:
            continue
        x = pos[m]
        d = x - x[0]
        d -= box * np.round(d / box)
        out["n"].append(m.sum())
        out["position"].append(np.mod(x[0] + d.mean(axis=0), box))
        out["velocity"].append(vel[m].mean(axis=0))
        out["sigma_v"].append(np.sqrt(vel[m].var(axis=0).mean()))
        out["min_id"].append(ids[m].min())
        out["members"].append(np.sort(ids[m]))
    return {k: (v if k == "members" else np.array(v)) for k, v in out.items()}


# ----------------------------------------------------------------------------- the particles
def blob(rng, centre, n, sigma):
    return centre + rng.normal(0.0, sigma, (n, 3))


def particles():
    """Clustered test particles: background, blobs, and the constructed groups.

    Returns (pos, vel, ids, special): ``special`` maps a name to the index range of
    one constructed group.
    """
    rng = np.random.default_rng(60)
    h = BOX / 2
    parts = [rng.uniform(0, BOX, (N_BACKGROUND, 3))]
    for c in rng.uniform(0, BOX, (12, 3)):
        parts.append(blob(rng, c, int(rng.integers(5, 60)), 0.3))
    special, start = {}, sum(len(p) for p in parts)
    # a filament along x across three blocks of 4x1 (x from 0.2 to 0.65 of the box: under
    # half the box, so that its periodic centre of mass is defined), spacing 0.1 Mpc/h
    chain = np.zeros((180, 3))
    chain[:, 0] = 0.2 * BOX + 0.1 * np.arange(len(chain))
    chain[:, 1], chain[:, 2] = 0.37 * BOX, 0.61 * BOX
    constructed = {
        "box corner": blob(rng, [0.0, 0.0, 0.3 * BOX], 40, 0.25),       # 8 periodic images
        "block corner": blob(rng, [h, h, 0.8 * BOX], 40, 0.25),         # 4 blocks on 2x2
        "filament x": chain,                                            # 3 blocks along x
        "filament y": chain[:, [1, 0, 2]] + [0.4 * BOX, 0.0, 0.1 * BOX],  # 2 along y
    }
    for name, p in constructed.items():
        special[name] = np.arange(start, start + len(p))
        start += len(p)
        parts.append(p)
    pos = np.mod(np.concatenate(parts), BOX)
    n = len(pos)
    vel = rng.normal(0.0, 300.0, (n, 3))
    ids = rng.permutation(n).astype(np.int64) * 7 + 3      # unique, not the row order
    return pos, vel, ids, special


PARTICLES = particles()
N_TOTAL = len(PARTICLES[0])
LL = 0.2 * fof.mean_separation(BOX, N_TOTAL)
REF_LABELS = reference_labels(PARTICLES[0], PARTICLES[2], BOX, LL)


def run(grid, *, min_members=MIN_MEMBERS, member_ids=False, seed=0):
    """FoF of the test particles dealt to the ranks at random; the gathered results."""
    comm = world_comm()
    pos, vel, ids, _ = PARTICLES
    share = np.random.default_rng(seed).integers(0, comm.size, len(pos)) == comm.rank
    res = fof.find_halos(pos[share], vel[share], ids[share], BOX, grid, comm,
                         min_members=min_members, particle_mass=MASS, member_ids=member_ids)
    gathered = comm.allgather((res.ids, res.labels, res.catalogue))
    gids = np.concatenate([g[0] for g in gathered])
    glab = np.concatenate([g[1] for g in gathered])
    cats = [g[2] for g in gathered]
    cat = {k: np.concatenate([c[k] for c in cats]) for k in cats[0]}
    order = np.argsort(cat["min_id"], kind="stable")
    if member_ids:   # halo after halo on each rank: split by n before reordering
        members = np.split(cat["member_id"], np.cumsum(cat["n"])[:-1])
        cat["members"] = [members[i] for i in order]
        del cat["member_id"]
    cat = {k: (v if k == "members" else v[order]) for k, v in cat.items()}
    by_id = np.argsort(gids)
    return res, gids[by_id], glab[by_id], cat


def reference_by_id():
    pos, vel, ids, _ = PARTICLES
    o = np.argsort(ids)
    return ids[o], REF_LABELS[o]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("grid", grids(), ids=lambda g: "%dx%d" % g)
def test_groups_equal_the_serial_reference(grid):
    """Every particle's group (smallest member id) equals the serial FoF's; none lost."""
    res, gids, glab, _ = run(grid)
    ref_ids, ref_labels = reference_by_id()
    np.testing.assert_array_equal(gids, ref_ids)
    np.testing.assert_array_equal(glab, ref_labels)
    if grid != (1, 1):   # groups cross blocks: labels travel more than one round
        assert res.iterations > 1 and res.n_ghosts > 0, (res.iterations, res.n_ghosts, grid)


@pytest.mark.parametrize("grid", grids(), ids=lambda g: "%dx%d" % g)
def test_catalogue_equals_numpy_on_the_reference_groups(grid):
    """Halo for halo (sorted by smallest id): members, mass, periodic centre of mass, mean
    velocity, 1D dispersion, member ids."""
    pos, vel, ids, _ = PARTICLES
    res, _, _, cat = run(grid, member_ids=True, seed=1)
    ref = reference_catalogue(pos, vel, ids, REF_LABELS, BOX, MIN_MEMBERS)
    assert len(ref["n"]) > 10 and res.n_halos == len(ref["n"])
    np.testing.assert_array_equal(cat["min_id"], ref["min_id"])
    np.testing.assert_array_equal(cat["n"], ref["n"])
    np.testing.assert_array_equal(cat["mass"], ref["n"] * MASS)
    d = cat["position"] - ref["position"]
    d -= BOX * np.round(d / BOX)
    assert np.abs(d).max() < POS_ATOL
    assert np.all((cat["position"] >= 0) & (cat["position"] < BOX))
    np.testing.assert_allclose(cat["velocity"], ref["velocity"], rtol=VEL_RTOL, atol=VEL_ATOL)
    np.testing.assert_allclose(cat["sigma_v"], ref["sigma_v"], rtol=VEL_RTOL)
    assert len(cat["members"]) == len(ref["members"])
    for a, b in zip(cat["members"], ref["members"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("grid", grids(), ids=lambda g: "%dx%d" % g)
def test_constructed_groups_across_the_periodic_corner_and_four_blocks(grid):
    """The blob on the box's corner (split over 8 periodic images), the one on the corner of
    four blocks, and the filament across three blocks are each one halo with exactly their members."""
    pos, _, ids, special = PARTICLES
    _, _, _, cat = run(grid, member_ids=True, seed=2)
    ref = reference_catalogue(pos, PARTICLES[1], ids, REF_LABELS, BOX, MIN_MEMBERS)
    for name, rows in special.items():
        mine = ids[rows]
        k = np.flatnonzero(cat["min_id"] == REF_LABELS[rows[0]])
        assert len(k) == 1, name
        members = cat["members"][k[0]]
        assert np.all(np.isin(mine, members)), name      # the whole construct in one halo
        assert len(members) <= len(mine) + 3, name       # a stray background friend at most
        np.testing.assert_array_equal(members, ref["members"][k[0]])
    corner = cat["position"][cat["min_id"] == REF_LABELS[special["box corner"][0]]][0]
    d = np.minimum(corner[:2], BOX - corner[:2])
    assert np.all(d < 0.5), corner     # the periodic centre, not the box's middle


def test_groups_of_one_with_min_members_one():
    """``min_members=1``: every particle is in exactly one halo; the sizes add up to N."""
    grid = grids()[0]
    _, gids, glab, cat = run(grid, min_members=1, seed=3)
    assert cat["n"].sum() == N_TOTAL
    assert len(cat["n"]) == len(np.unique(REF_LABELS))
    np.testing.assert_array_equal(cat["min_id"], np.unique(REF_LABELS))
    lonely = cat["n"] == 1
    assert np.all(cat["sigma_v"][lonely] == 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"b": 0.0}, "linking length b must be a positive"),
    ({"b": -0.2}, "linking length b must be a positive"),
    ({"b": float("nan")}, "linking length b must be a positive"),
    ({"min_members": 0}, "minimum number of members must be an integer >= 1"),
    ({"min_members": 2.5}, "minimum number of members must be an integer >= 1"),
    ({"b": 0.55 * N_TOTAL ** (1 / 3)}, "not below"),   # over half the box
])
def test_bad_input_is_one_line_on_every_rank(kwargs, match):
    """Refused on every rank before any exchange (no rank waits in an alltoall)."""
    comm = world_comm()
    pos, vel, ids, _ = PARTICLES
    with pytest.raises(ConfigError, match=match) as err:
        fof.find_halos(pos[:10], vel[:10], ids[:10], BOX, grids()[0], comm,
                       n_particles=N_TOTAL, **kwargs)
    assert "\n" not in str(err.value)
    comm.barrier()


def test_grid_not_matching_the_ranks_is_refused():
    comm = world_comm()
    with pytest.raises(ConfigError, match="does not match the %d ranks" % comm.size):
        fof.find_halos(np.zeros((1, 3)), np.zeros((1, 3)), [0], BOX,
                       (comm.size + 1, 1), comm)


# ----------------------------------------------------------------------------- an N-body state
NBODY_NC, NBODY_BOX, NBODY_MIN = 16, 16.0, 5


@pytest.fixture(scope="module")
def nbody_state():
    """A tiny N-body final state (16^3 particles in 16 Mpc/h, 3 steps, float64) on this
    world's grid, each rank its own slices in Mpc/h and km/s (``jobs.halos.local_particles``,
    what ``simulate --fof`` gives the finder)."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    import flowpm_mtf.api as fpm
    from flowpm_mtf.jobs import halos
    from flowpm_mtf.runs import h5dist

    tf.disable_eager_execution()
    conf = fpm.SimConfig(nc=NBODY_NC, box_size=NBODY_BOX, n_steps=3, dtype="float64", seed=3,
                         grid=fpm.process_grid(world_comm().size))
    with tf.Graph().as_default():
        be = fpm.backend_for(conf)
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        final = fpm.nbody(conf, fpm.lpt_init(conf, fpm.linear_field(conf, mesh), forces=False))
        lowering = mtf.Lowering(graph, {mesh: be.mesh_impl})
        sl = [h5dist.local_slices(lowering, t) for t in (final.positions, final.momenta,
                                                         final.ids)]
        with tf.Session(config=be.session_config) as sess:
            vals = sess.run([[t for _, t, _ in s] for s in sl])
    state = {p: ((b[0], b[1]), x, m, None, i)
             for (p, _, b), x, m, i in zip(sl[0], *vals)}
    return conf, halos.local_particles(conf, state, conf.a_end)


# 1 and 2 ranks: on 4 ranks the particles of every test above are dealt at random to
# 2x2 and 4x1 grids (any particle on any rank, groups across the corner of four blocks);
# what this test adds, real clustered particles where the run's ranks hold them and
# their units (jobs.halos.local_particles), does not depend on the grid.
@pytest.mark.skipif(world_comm().size > 2, reason="grid-independent check: 1 and 2 ranks")
def test_nbody_state_equals_the_serial_reference(nbody_state):
    """Real clustered particles, where the run's ranks hold them: groups and catalogue."""
    conf, (pos, vel, ids) = nbody_state
    comm = world_comm()
    res = fof.find_halos(pos, vel, ids, conf.box_size, conf.grid, comm,
                         min_members=NBODY_MIN, particle_mass=MASS, member_ids=True)
    every = comm.allgather((pos, vel, ids, res.ids, res.labels, res.catalogue))
    apos, avel, aids = (np.concatenate([e[i] for e in every]) for i in range(3))
    assert len(aids) == NBODY_NC**3
    apos = np.mod(apos, NBODY_BOX)
    ll = 0.2 * fof.mean_separation(NBODY_BOX, NBODY_NC**3)
    ref_labels = reference_labels(apos, aids, NBODY_BOX, ll)
    gids, glab = (np.concatenate([e[i] for e in every]) for i in (3, 4))
    np.testing.assert_array_equal(glab[np.argsort(gids)], ref_labels[np.argsort(aids)])
    ref = reference_catalogue(apos, avel, aids, ref_labels, NBODY_BOX, NBODY_MIN)
    assert len(ref["n"]) >= 3, "too little clustering to test: %d halos" % len(ref["n"])
    cats = [e[5] for e in every]
    cat = {k: np.concatenate([c[k] for c in cats]) for k in cats[0]}
    order = np.argsort(cat["min_id"])
    members = np.split(cat["member_id"], np.cumsum(cat["n"])[:-1])
    np.testing.assert_array_equal(cat["min_id"][order], ref["min_id"])
    np.testing.assert_array_equal(cat["n"][order], ref["n"])
    for i, m in zip(order, ref["members"]):
        np.testing.assert_array_equal(members[i], m)
    d = cat["position"][order] - ref["position"]
    d -= NBODY_BOX * np.round(d / NBODY_BOX)
    assert np.abs(d).max() < POS_ATOL
    np.testing.assert_allclose(cat["velocity"][order], ref["velocity"], rtol=VEL_RTOL,
                               atol=VEL_ATOL)
