"""Distributed friends-of-friends (FoF) halo finding on particles outside the graph.

numpy, scipy and the comm object (mpi4py lower-case API, or
:class:`flowpm_mtf.backend.SerialComm` in one process); no TensorFlow, no Horovod.
The ghost-particle and smallest-id approach of FastPM's ``libfastpm/fof.c`` and
nbodykit's ``FOF``, written anew:

1. **Domain.** Every particle goes to the rank whose block of the run's 2D
   decomposition holds it (x split over the ``P`` rows of the grid, y over its ``Q``
   columns, z local; block ``(bx, by)`` on rank ``bx * Q + by``, the mesh's processor
   numbering), one ``alltoall``. The input may be distributed in any way.
2. **Ghosts.** A particle within the linking length of a block edge is copied to the
   neighbouring blocks across that edge (and across the corner where it is near two
   edges: 8 neighbours on 2x2 and wider grids, periodic). An axis of one block needs
   no copy: the local search is periodic over the whole box.
3. **Local FoF.** ``scipy.spatial.cKDTree`` (periodic ``boxsize``) finds the pairs
   within the linking length among the block's particles and ghosts;
   ``scipy.sparse.csgraph.connected_components`` the local groups.
4. **Joining across blocks.** Each particle's label is the smallest id of its local
   group. Ghosts send their labels to their owners and owners theirs to their ghosts,
   each side keeping the smaller and reducing over its local groups again, until an
   allreduce says that no label changed: then every particle carries the smallest id
   of its whole group.
5. **Properties.** Each rank sums its own members per label (count, positions
   unwrapped around one member, mean velocity and squared deviations); the partial
   sums travel to rank ``label % size``, which combines them (a group's periodic
   centre of mass unwraps the partials around the first one: a group spans less than
   half the box). No rank gathers the particle set.

Units: positions [Mpc/h] in a periodic box, velocities [km/s], masses [M_sun/h].
The velocity dispersion is the 1D one, ``sqrt(sum |v - <v>|^2 / (3 n))`` (the mean of
the three axes' variances, population normalisation).
"""
import dataclasses
import logging
import numbers

import numpy as np

from ..errors import ConfigError
from ..logs import rank0_only

__all__ = ["FofConfig", "FofResult", "RHO_CRIT", "CATALOGUE_FIELDS", "particle_mass",
           "mean_separation", "find_halos"]

log = rank0_only(logging.getLogger(__name__))

#: Critical density today, ``3 H0^2 / (8 pi G)`` [(M_sun/h) / (Mpc/h)^3].
RHO_CRIT = 2.77536627e11

#: The catalogue's columns: name -> (description, units).
CATALOGUE_FIELDS = {
    "n": ("number of members", "particles"),
    "mass": ("members x particle mass", "M_sun/h"),
    "position": ("periodic centre of mass, in [0, box)", "Mpc/h"),
    "velocity": ("mean velocity of the members (peculiar)", "km/s"),
    "sigma_v": ("1D velocity dispersion, sqrt(sum |v - <v>|^2 / (3 n))", "km/s"),
    "min_id": ("smallest member id (the halo's label)", "particle id"),
}


@dataclasses.dataclass(frozen=True)
class FofConfig:
    """Parameters of the friends-of-friends halo finder.

    Parameters
    ----------
    b : float
        Linking length as a fraction of the mean particle separation
        ``(V / N)^(1/3)`` [dimensionless]; > 0.
    min_members : int
        Smallest number of members [particles] of a halo in the catalogue; >= 1.
    """

    b: float = 0.2
    min_members: int = 20

    def __post_init__(self):
        b = self.b
        if (isinstance(b, bool) or not isinstance(b, numbers.Real) or not np.isfinite(b)
                or b <= 0):
            raise ConfigError("the FoF linking length b must be a positive fraction of the "
                              "mean particle separation (e.g. 0.2), got %r" % (b,))
        m = self.min_members
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ConfigError("the FoF minimum number of members must be an integer >= 1 "
                              "(e.g. 20), got %r" % (m,))
        object.__setattr__(self, "b", float(b))
        object.__setattr__(self, "min_members", int(m))


@dataclasses.dataclass
class FofResult:
    """What :func:`find_halos` returns on each rank.

    Attributes
    ----------
    catalogue : dict of ndarray
        This rank's halos (those whose label it owns), sorted by ``min_id``: the
        columns of :data:`CATALOGUE_FIELDS`, and with ``member_ids`` also
        ``member_id``: the members' ids, halo after halo in catalogue order, each
        halo's ids sorted (halo ``i``'s are ``member_id[o_i:o_i + n_i]``,
        ``o = cumsum(n) - n``).
    ids, labels : ndarray
        int64 ids of the particles this rank holds after the domain step, and the
        smallest id of each one's group (its own id if it has no friend; groups
        below ``min_members`` included).
    linking_length : float
        [Mpc/h].
    iterations : int
        Rounds of the label exchange.
    n_halos : int
        Halos in the whole catalogue (all ranks).
    n_ghosts : int
        Ghost copies this rank received.
    """

    catalogue: dict
    ids: np.ndarray
    labels: np.ndarray
    linking_length: float
    iterations: int
    n_halos: int
    n_ghosts: int


def particle_mass(omega_m, box, n_particles):
    """Mass of one particle [M_sun/h]: ``RHO_CRIT Omega_m V / N``.

    Parameters
    ----------
    omega_m : float
        Matter density today [dimensionless].
    box : float or 3 floats
        Box side(s) [Mpc/h].
    n_particles : int
    """
    volume = float(np.prod(np.broadcast_to(np.asarray(box, np.float64), (3,))))
    return RHO_CRIT * float(omega_m) * volume / int(n_particles)


def mean_separation(box, n_particles):
    """Mean particle separation ``(V / N)^(1/3)`` [Mpc/h]."""
    volume = float(np.prod(np.broadcast_to(np.asarray(box, np.float64), (3,))))
    return (volume / int(n_particles)) ** (1.0 / 3.0)


# ----------------------------------------------------------------------------- helpers
def _alltoall(comm, items):
    """``comm.alltoall`` (one process: the list itself)."""
    if comm.size == 1:
        return list(items)
    return comm.alltoall(list(items))


def _wrap(x, box):
    """Positions into ``[0, box)`` (a value rounding up to ``box`` becomes 0)."""
    x = np.mod(x, box)
    return np.where(x >= box, x - box, x)


def _min_image(d, box):
    """Separations ``d`` [Mpc/h] to their periodic minimum image."""
    return d - box * np.round(d / box)


def _rank_of(pos, box, grid):
    p, q = grid
    bx = np.minimum((pos[:, 0] * (p / box[0])).astype(np.int64), p - 1)
    by = np.minimum((pos[:, 1] * (q / box[1])).astype(np.int64), q - 1)
    return bx * q + by


def _split(order, counts):
    """Index arrays of ``order`` per destination (``counts`` rows each)."""
    return np.split(order, np.cumsum(counts)[:-1])


def _component_min(comp, n_comp, values):
    """Every element's value replaced by the minimum over its component."""
    low = np.full(n_comp, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(low, comp, values)
    return low[comp]


def _group_sums(inv, n_groups, values):
    """Column sums of ``values`` [n, k] per group index ``inv`` (float64)."""
    return np.stack([np.bincount(inv, weights=values[:, c], minlength=n_groups)
                     for c in range(values.shape[1])], axis=1)


# ----------------------------------------------------------------------------- the finder
def find_halos(positions, velocities, ids, box, grid, comm, *, b=0.2, min_members=20,
               particle_mass=1.0, n_particles=None, member_ids=False):
    """Friends-of-friends halos of particles distributed over ``comm`` (collective).

    Parameters
    ----------
    positions : array_like
        ``[n, 3]`` this rank's particle positions [Mpc/h] (wrapped into the box).
    velocities : array_like
        ``[n, 3]`` their velocities [km/s].
    ids : array_like
        ``[n]`` their unique ids (int64).
    box : float or 3 floats
        Periodic box side(s) [Mpc/h].
    grid : (int, int)
        The 2D decomposition ``(P, Q)`` of x and y; ``P * Q == comm.size``.
    comm : object
        mpi4py-like communicator (``rank``, ``size``, ``alltoall``, ``allreduce``).
    b : float
        Linking length in units of the mean particle separation.
    min_members : int
        Smallest halo [particles].
    particle_mass : float
        Mass of one particle [M_sun/h] (:func:`particle_mass`).
    n_particles : int, optional
        Particles in the whole box (default: the sum over the ranks), for the
        mean separation.
    member_ids : bool
        Also return each halo's member ids (``catalogue["member_id"]``).

    Returns
    -------
    FofResult

    Raises
    ------
    ConfigError
        On every rank, before any exchange: ``b <= 0``, ``min_members < 1``, a grid
        that is not the communicator's, or a linking length not below a split
        axis's block width (or half the box).
    ValueError
        Inconsistent array shapes on this rank.
    """
    conf = FofConfig(b, min_members)
    box = np.broadcast_to(np.asarray(box, np.float64), (3,)).copy()
    grid = tuple(int(g) for g in grid)
    size, rank = int(comm.size), int(comm.rank)
    if len(grid) != 2 or grid[0] * grid[1] != size or min(grid) < 1:
        raise ConfigError("FoF grid %s does not match the %d ranks of the communicator"
                          % ("x".join(map(str, grid)), size))
    pos = np.asarray(positions, np.float64).reshape(-1, 3)
    vel = np.asarray(velocities, np.float64).reshape(-1, 3)
    pid = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
    if not (len(pos) == len(vel) == len(pid)):
        raise ValueError("find_halos: %d positions, %d velocities and %d ids differ"
                         % (len(pos), len(vel), len(pid)))
    total = int(comm.allreduce(len(pid))) if n_particles is None else int(n_particles)
    if total < 1:
        raise ConfigError("FoF needs at least one particle, got none")
    ll = conf.b * mean_separation(box, total)
    widths = box[:2] / np.asarray(grid, np.float64)
    for axis, (g, w) in enumerate(zip(grid, widths)):
        if g > 1 and ll >= w:
            raise ConfigError("FoF linking length %.4g Mpc/h is not below the block width "
                              "%.4g Mpc/h along %s: use fewer ranks along that axis or a "
                              "smaller b" % (ll, w, "xy"[axis]))
    if ll >= 0.5 * box.min():
        raise ConfigError("FoF linking length %.4g Mpc/h is not below half the box %.4g "
                          "Mpc/h: use a smaller b" % (ll, box.min()))

    # 1. domain: every particle to the rank of its block
    pos = _wrap(pos, box)
    dest = _rank_of(pos, box, grid)
    order = np.argsort(dest, kind="stable")
    sel = _split(order, np.bincount(dest, minlength=size))
    got = _alltoall(comm, [(pos[i], vel[i], pid[i]) for i in sel])
    pos = np.concatenate([g[0] for g in got]).reshape(-1, 3)
    vel = np.concatenate([g[1] for g in got]).reshape(-1, 3)
    pid = np.concatenate([g[2] for g in got]).astype(np.int64, copy=False)
    del got, sel, order, dest
    n_own = len(pid)

    # 2. ghosts: particles near an edge to the neighbours across it
    p, q = grid
    bx, by = divmod(rank, q)
    lo = np.array([bx, by]) * widths
    hi = lo + widths
    near = {}
    for axis, g in enumerate(grid):
        near[axis] = ({-1: pos[:, axis] - lo[axis] < ll, 1: hi[axis] - pos[:, axis] < ll}
                      if g > 1 else {})
    to = [[] for _ in range(size)]
    for dx in ((-1, 0, 1) if p > 1 else (0,)):
        for dy in ((-1, 0, 1) if q > 1 else (0,)):
            r = ((bx + dx) % p) * q + (by + dy) % q
            if r == rank:
                continue
            mask = np.ones(n_own, bool)
            if dx:
                mask &= near[0][dx]
            if dy:
                mask &= near[1][dy]
            to[r].append(np.flatnonzero(mask))
    sent = [np.unique(np.concatenate(t)) if t else np.zeros(0, np.int64) for t in to]
    got = _alltoall(comm, [(pos[i], pid[i]) for i in sent])
    ghost_from = np.cumsum([0] + [len(g[1]) for g in got]) + n_own  # rows of each source
    all_pos = np.concatenate([pos] + [g[0].reshape(-1, 3) for g in got])
    all_ids = np.concatenate([pid] + [g[1] for g in got]).astype(np.int64, copy=False)
    del got
    n_ghosts = len(all_ids) - n_own

    # 3. local FoF
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    n_all = len(all_ids)
    if n_all:
        pairs = cKDTree(all_pos, boxsize=box).query_pairs(ll, output_type="ndarray")
    else:
        pairs = np.zeros((0, 2), np.int64)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])),
                       shape=(n_all, n_all))
    n_comp, comp = connected_components(graph, directed=False)
    del pairs, graph, all_pos
    label = _component_min(comp, n_comp, all_ids)

    # 4. labels exchanged between ghosts and owners until none changes
    iterations = 0
    while True:
        iterations += 1
        before = label.copy()
        back = _alltoall(comm, [label[ghost_from[r]:ghost_from[r + 1]] for r in range(size)])
        for r in range(size):
            np.minimum.at(label, sent[r], back[r])
        label = _component_min(comp, n_comp, label)
        out = _alltoall(comm, [label[sent[r]] for r in range(size)])
        for r in range(size):
            s = slice(ghost_from[r], ghost_from[r + 1])
            label[s] = np.minimum(label[s], out[r])
        label = _component_min(comp, n_comp, label)
        if int(comm.allreduce(int(np.any(label != before)))) == 0:
            break
    comp_size = np.bincount(comp, minlength=n_comp)
    own_label = label[:n_own]
    lonely = comp_size[comp[:n_own]] == 1   # no friend anywhere: a group of one
    del label, before

    # 5. properties: partial sums per label to the rank label % size
    grouped = np.flatnonzero(~lonely)
    labels, first, inv = np.unique(own_label[grouped], return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    ng = len(labels)
    gpos, gvel = pos[grouped], vel[grouped]
    count = np.bincount(inv, minlength=ng).astype(np.int64)
    ref = gpos[first]
    spos = _group_sums(inv, ng, _min_image(gpos - ref[inv], box))
    vmean = _group_sums(inv, ng, gvel) / np.maximum(count, 1)[:, None]
    m2 = _group_sums(inv, ng, (gvel - vmean[inv]) ** 2)
    owner = labels % size
    parts = []
    for r in range(size):
        i = np.flatnonzero(owner == r)
        part = {"label": labels[i], "n": count[i], "ref": ref[i], "spos": spos[i],
                "vmean": vmean[i], "m2": m2[i]}
        if member_ids:
            m = np.flatnonzero(owner[inv] == r)
            part["member_label"], part["member_id"] = own_label[grouped[m]], pid[grouped[m]]
        parts.append(part)
    got = _alltoall(comm, parts)
    del parts, gpos, gvel

    def cat(name, shape=()):
        arrays = [g[name] for g in got]
        return (np.concatenate(arrays) if arrays else np.zeros((0,) + shape))

    plabel = cat("label").astype(np.int64)
    hl, hfirst, hinv = np.unique(plabel, return_index=True, return_inverse=True)
    hinv = hinv.reshape(-1)
    nh = len(hl)
    pn = cat("n").astype(np.int64)
    pref, pspos = cat("ref", (3,)).reshape(-1, 3), cat("spos", (3,)).reshape(-1, 3)
    pvmean, pm2 = cat("vmean", (3,)).reshape(-1, 3), cat("m2", (3,)).reshape(-1, 3)
    n_h = np.bincount(hinv, weights=pn, minlength=nh).astype(np.int64)
    ref0 = pref[hfirst]
    shift = _min_image(pref - ref0[hinv], box)
    com = ref0 + _group_sums(hinv, nh, pn[:, None] * shift + pspos) / np.maximum(n_h, 1)[:, None]
    v_h = _group_sums(hinv, nh, pn[:, None] * pvmean) / np.maximum(n_h, 1)[:, None]
    m2_h = (_group_sums(hinv, nh, pm2)
            + _group_sums(hinv, nh, pn[:, None] * (pvmean - v_h[hinv]) ** 2))
    sigma = np.sqrt(m2_h.sum(axis=1) / (3.0 * np.maximum(n_h, 1)))
    halos = {"n": n_h, "position": _wrap(com, box), "velocity": v_h, "sigma_v": sigma,
             "min_id": hl}
    if conf.min_members == 1:   # groups of one: on the rank holding the particle
        i = np.flatnonzero(lonely)
        halos = {"n": np.concatenate([halos["n"], np.ones(len(i), np.int64)]),
                 "position": np.concatenate([halos["position"], pos[i]]),
                 "velocity": np.concatenate([halos["velocity"], vel[i]]),
                 "sigma_v": np.concatenate([halos["sigma_v"], np.zeros(len(i))]),
                 "min_id": np.concatenate([halos["min_id"], pid[i]])}
    keep = np.flatnonzero(halos["n"] >= conf.min_members)
    keep = keep[np.argsort(halos["min_id"][keep], kind="stable")]
    catalogue = {k: v[keep] for k, v in halos.items()}
    catalogue["mass"] = catalogue["n"] * float(particle_mass)
    if member_ids:
        ml, mid = cat("member_label").astype(np.int64), cat("member_id").astype(np.int64)
        if conf.min_members == 1:
            i = np.flatnonzero(lonely)
            ml, mid = np.concatenate([ml, pid[i]]), np.concatenate([mid, pid[i]])
        wanted = np.isin(ml, catalogue["min_id"])
        ml, mid = ml[wanted], mid[wanted]
        o = np.lexsort((mid, ml))
        catalogue["member_id"] = mid[o]
    del got
    n_halos = int(comm.allreduce(len(catalogue["n"])))
    log.info("FoF: %d halos of >= %d members (b = %g, linking length %.4g Mpc/h), %d "
             "label rounds", n_halos, conf.min_members, conf.b, ll, iterations)
    return FofResult(catalogue=catalogue, ids=pid, labels=own_label.copy(),
                     linking_length=ll, iterations=iterations, n_halos=n_halos,
                     n_ghosts=n_ghosts)
