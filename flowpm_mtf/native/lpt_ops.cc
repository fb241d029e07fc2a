// The second-order LPT source in real space, on the CPU.
//
// Ops (the Python side, gradient and TensorFlow twin included, is flowpm_mtf/lpt_source.py):
//
//   FlowpmLpt2Source(phi [B, ax, ay, nz], coeffs [3], margin) -> [B, ax - 2 margin,
//       ay - 2 margin, nz]: S = h_xx h_yy + h_yy h_zz + h_zz h_xx - h_xy^2 - h_xz^2 - h_yz^2
//       with h_ij = D_i D_j phi and D_d f = coeffs[d] (8 (f(+1) - f(-1)) - (f(+2) - f(-2)))
//       along axis d: the four-point difference of flowpm_mtf.physics.kernels, whose transfer
//       function is the gradient kernel i k~_d, so h_ij is the Hessian of the k-space path
//       (-k~_i k~_j) to rounding. z periodic; x and y read inside the array (margin >= 4,
//       the reach of D_i D_i: a block padded by at least 4 cells) or periodic (margin 0:
//       one block holding the whole mesh along x and y, no padded copy of it).
//   FlowpmLpt2SourceGrad(phi, sbar [B, ax - 2 margin, ay - 2 margin, nz], coeffs, margin)
//       -> phibar [B, ax, ay, nz]: the gradient of FlowpmLpt2Source,
//       phibar = sum_ij D_i D_j (sbar dS/dh_ij), the weights extended by zeros beyond the
//       output (periodically for margin 0; D_i D_j is its own transpose: D is
//       antisymmetric). Two passes: the six
//       weight fields (a temporary of 6 output fields), then the same stencil on them.
//   FlowpmLatticeCombine(inputs N x [B, sx, sy, nz, C], coeffs [M, N], tile [3],
//                        lattice_output) -> M x [B, sx sy nz, C]: the LPT state of the
//       lattice particles, output m = ((inputs[0] * coeffs[m, 0]) + (inputs[1] *
//       coeffs[m, 1])) + ..., plus the lattice site (i, j, k) along its component for
//       output `lattice_output` (C = 3; -1: none), written in the slot order of the
//       tiles (tx, ty, tz) (flowpm_mtf.layout.slot_tiles; tiles of the block's lattice,
//       row-major, cells row-major in each: (1, 1, 1) is the lattice order): the
//       products and sums of flowpm_mtf.physics.lpt's TensorFlow twin bit for bit (each rounded,
//       no contraction), one pass instead of 2-6 full-size ones. Output m < N takes the
//       buffer of input m when nothing else holds it (the permutation stays inside each
//       slab of tx x planes: the slab is copied to a scratch buffer first), so the
//       positions and momenta of the ICs need no memory beyond the displacements'.
//   FlowpmLatticeCombineGrad(dys M x [B, sx sy nz, C], coeffs [M, N], tile, block [3])
//       -> N x [B, sx, sy, nz, C]: output n = sum_m dys[m] coeffs[m, n] (m in order) in
//       lattice order (its gradient).
//   FlowpmLatticeCombinePotentials(phis N x [B, sx + 2 margins[n], sy + 2 margins[n], nz],
//       grad_coeffs [3], coeffs [M, N], tile, margins, lattice_output) -> M x [B, sx sy nz,
//       3]: FlowpmLatticeCombine of the displacements FlowpmGradient(phis[n], grad_coeffs,
//       margins[n]) (margin >= 2: inside the array; 0: periodic along x and y, the
//       potential of one block holding the whole mesh, unpadded), the same bits, without
//       making them: one pass over (block, tile row)
//       units, each unit's differences in a per-thread scratch (no 3-component field is
//       written and read back: at 512^3 the 2LPT ICs' two displacements are 3.2 GB). Its
//       gradient (flowpm_mtf/lpt.py) is FlowpmLatticeCombineGrad, then the transpose of
//       the difference. Attr wrap [3]: output lattice_output wrapped into [0, s) along
//       every axis of size s > 0 as FlowpmWrap does it (the eulerian migration's wrap
//       along the axes of one block, in the same pass; gradient the identity, as
//       FlowpmWrap's); [0, 0, 0]: none. Attr capacity: slots per block (0: the block's
//       sx sy nz sites), the slots past the lattice's zero (the eulerian decomposition's
//       padding, in the same pass). Input donors (K <= M tensors, default none): output
//       m < K takes over donor m's buffer when nothing else holds it and it has as many
//       values (e.g. a state variable's value moved out by FlowpmTakeVariable,
//       variable_ops.cc: the ICs then write no fresh pages); the donors' values are
//       not read.
//
// Threading: TensorFlow's intra-op pool over (block, x) rows; every cell is written by
// one thread, in a fixed order of terms, so the results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tf_op.h"

namespace {

// D f = sum_a W4[a] f(+O4[a]) (before coeffs), and D D f = sum_s V9[s] f(+s - 4).
constexpr int O4[4] = {-2, -1, 1, 2};
constexpr double W4[4] = {1, -8, 8, -1};
constexpr double V9[9] = {1, -16, 64, 16, -130, 16, 64, -16, 1};

// The index of position v along an axis of n cells: v mod n when `periodic` (margin 0: the
// stencils read one block holding the whole mesh along x and y), else v itself (inside the
// padded array). A table over v in [-kReach, n + kReach): no division per column read.
class Axis {
 public:
  static constexpr i64 kReach = 8;
  Axis(i64 n, bool periodic) : periodic_(periodic) {
    if (periodic)
      for (i64 v = -kReach; v < n + kReach; ++v) wrap_.push_back(((v % n) + n) % n);
  }
  i64 operator()(i64 v) const { return periodic_ ? wrap_[v + kReach] : v; }

 private:
  bool periodic_;
  std::vector<i64> wrap_;
};

// The six fields a second-difference stencil reads (the same one, phi, in the forward
// op; the six weights in its gradient) at the columns around one (x, y): xx[s] at x + s
// - 4, yy[s] at y + s - 4, zz at (x, y), xy[4 a + b] at (x + O4[a], y + O4[b]), xz[a] at
// x + O4[a], yz[a] at y + O4[a]. Each pointer is a column of nz values.
template <typename T>
struct Columns {
  const T* xx[9];
  const T* yy[9];
  const T* zz;
  const T* xy[16];
  const T* xz[4];
  const T* yz[4];
};

// col(f, x, y): column of field f (0..5: xx, yy, zz, xy, xz, yz) at input (x, y).
template <typename T, typename Col>
inline void gather_columns(Col col, i64 x, i64 y, Columns<T>* c) {
  for (int s = 0; s < 9; ++s) {
    c->xx[s] = col(0, x + s - 4, y);
    c->yy[s] = col(1, x, y + s - 4);
  }
  c->zz = col(2, x, y);
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) c->xy[4 * a + b] = col(3, x + O4[a], y + O4[b]);
    c->xz[a] = col(4, x + O4[a], y);
    c->yz[a] = col(5, x, y + O4[a]);
  }
}

// Scratch of second_differences for one column of nz heights.
template <typename T>
struct ColumnScratch {
  explicit ColumnScratch(i64 nz) : nz(nz), h(6 * nz), ext(9 * (nz + 8)) {}
  i64 nz;
  std::vector<T> h;    // the six second differences, h[f * nz + k]
  std::vector<T> ext;  // the 9 z-differenced columns (zz, xz[4], yz[4]) padded by 4 each side
};

// The column col periodic in z, 4 values of padding on each side: ext[k + 4] = col[k mod nz]
// for k = -4 .. nz + 3.
template <typename T>
inline void periodic_pad4(const T* col, i64 nz, T* ext) {
  for (i64 k = -4; k < 0; ++k) ext[k + 4] = col[(k % nz + nz) % nz];
  for (i64 k = 0; k < nz; ++k) ext[k + 4] = col[k];
  for (i64 k = nz; k < nz + 4; ++k) ext[k + 4] = col[k % nz];
}

// The six raw second differences of every height of one (x, y) column, before the
// coefficients: s.h[f * nz + k], f = {xx, yy, zz, xy, xz, yz}. One loop over k (vectorized
// over k: the stencil's terms stay in registers, the column is written once), each value
// summed in the order of the stencil's terms, from 0: xx = ((0 + V9[0] xx[0]) + V9[1]
// xx[1]) + ..., xy = sum over a of W4[a] (sum over b of W4[b] xy[4a + b]), the same for xz
// and yz along z. (It replaced one axpy pass per term over the column, 87 of them, with
// the same sums in the same order, so the same bits; FlowpmLpt2Source on a 512^3 block,
// both cores, warm: 3.2 -> 2.0 s; at 256^3 0.44 -> 0.16 s.) An AVX2 clone is chosen at
// load time (8 lanes instead of SSE's 4, the same sums lane by lane: no fused
// multiply-add, -ffp-contract=off): FlowpmLpt2Source at 384^3, both cores, warm 0.63 ->
// 0.48 s, the same bits. (The four-point column of the force field and of the 2LPT
// displacements, tf_op.h, gained nothing from one: those ops wait on memory.)
template <typename T>
__attribute__((target_clones("avx2", "default"))) void second_differences(
    const Columns<T>& c, ColumnScratch<T>* s) {
  const i64 nz = s->nz, pz = nz + 8;
  T* __restrict h = s->h.data();
  T* ext = s->ext.data();
  periodic_pad4(c.zz, nz, ext);
  for (int a = 0; a < 4; ++a) {
    periodic_pad4(c.xz[a], nz, ext + (1 + a) * pz);
    periodic_pad4(c.yz[a], nz, ext + (5 + a) * pz);
  }
  const T* __restrict zc = ext + 4;                 // zc[k + o]: zz at k + o
  const T *xzc[4], *yzc[4];
  for (int a = 0; a < 4; ++a) {
    xzc[a] = ext + (1 + a) * pz + 4;
    yzc[a] = ext + (5 + a) * pz + 4;
  }
  const T* const* X = c.xx;
  const T* const* Y = c.yy;
  const T* const* XY = c.xy;
#pragma GCC ivdep
  for (i64 k = 0; k < nz; ++k) {
    T xx = T(0), yy = T(0), zz = T(0);
    for (int q = 0; q < 9; ++q) {
      const T w = T(V9[q]);
      xx += w * X[q][k];
      yy += w * Y[q][k];
      zz += w * zc[k + q - 4];
    }
    T xy = T(0), xz = T(0), yz = T(0);
    for (int a = 0; a < 4; ++a) {
      T txy = T(0), txz = T(0), tyz = T(0);
      for (int b = 0; b < 4; ++b) {
        const T w = T(W4[b]);
        txy += w * XY[4 * a + b][k];
        txz += w * xzc[a][k + O4[b]];
        tyz += w * yzc[a][k + O4[b]];
      }
      const T wa = T(W4[a]);
      xy += wa * txy;
      xz += wa * txz;
      yz += wa * tyz;
    }
    h[k] = xx;
    h[nz + k] = yy;
    h[2 * nz + k] = zz;
    h[3 * nz + k] = xy;
    h[4 * nz + k] = xz;
    h[5 * nz + k] = yz;
  }
}

// The products of the coefficients of the six second differences: h_ij = q[..] H_ij.
template <typename T>
inline void pair_coeffs(const Tensor& cf, T q[6]) {
  const T c0 = cf.flat<T>()(0), c1 = cf.flat<T>()(1), c2 = cf.flat<T>()(2);
  q[0] = c0 * c0; q[1] = c1 * c1; q[2] = c2 * c2; q[3] = c0 * c1; q[4] = c0 * c2;
  q[5] = c1 * c2;
}

// Checks shared by both ops: phi [B, ax, ay, nz] larger than its margins, 3 coefficients.
inline ::tensorflow::Status check_inputs(const char* op, const Tensor& phi, const Tensor& cf,
                                         i64 m) {
  if (phi.dims() != 4)
    return InvalidArgument(op, ": phi must be [B, ax, ay, nz], got ", phi.shape().DebugString());
  if (cf.NumElements() != 3) return InvalidArgument(op, ": coeffs must have 3 values");
  if (phi.dim_size(1) <= 2 * m || phi.dim_size(2) <= 2 * m || phi.dim_size(3) <= 0)
    return InvalidArgument(op, ": phi ", phi.shape().DebugString(),
                           " is not larger than its margins ", m);
  return ::tensorflow::OkStatus();
}

// The source's margin: 0 (periodic) or at least the reach of D_i D_i, 4.
inline ::tensorflow::Status check_margin(const char* op, int m) {
  if (m != 0 && m < 4)
    return InvalidArgument(op, ": margin must be 0 (periodic) or >= 4 (the reach of D_i D_i), "
                           "got ", m);
  return ::tensorflow::OkStatus();
}

// column(base, h) for every output column of phi [B, ax, ay, nz] with margins m: base is
// the index of its first cell in [B, ax - 2m, ay - 2m, nz], h[f * nz + k] its six second
// differences with the coefficients applied, {xx, yy, zz, xy, xz, yz}; parallel over
// (block, x) rows.
template <typename T, typename Column>
void for_each_hessian(OpKernelContext* ctx, const Tensor& phi, i64 m, const T q[6], i64 cost,
                      Column column) {
  const i64 nb = phi.dim_size(0), ax = phi.dim_size(1), ay = phi.dim_size(2),
            nz = phi.dim_size(3), sx = ax - 2 * m, sy = ay - 2 * m;
  const T* P = phi.flat<T>().data();
  const Axis wx(ax, m == 0), wy(ay, m == 0);
  shard(ctx, nb * sx, sy * nz * cost, [&](int64_t begin, int64_t end) {
    Columns<T> c;
    ColumnScratch<T> s(nz);
    T* h = s.h.data();
    for (i64 r = begin; r < end; ++r) {
      const i64 b = r / sx, i = r % sx;
      auto col = [&](int, i64 x, i64 y) { return P + ((b * ax + wx(x)) * ay + wy(y)) * nz; };
      for (i64 j = 0; j < sy; ++j) {
        gather_columns<T>(col, i + m, j + m, &c);
        second_differences<T>(c, &s);
        for (int f = 0; f < 6; ++f)
          for (i64 k = 0; k < nz; ++k) h[f * nz + k] *= q[f];
        column(((b * sx + i) * sy + j) * nz, static_cast<const T*>(h));
      }
    }
  });
}

template <typename T>
class Lpt2SourceOp : public OpKernel {
 public:
  explicit Lpt2SourceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("margin", &margin_));
    OP_REQUIRES_OK(ctx, check_margin("FlowpmLpt2Source", margin_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& phi = ctx->input(0);
    const Tensor& cf = ctx->input(1);
    const i64 m = margin_;
    OP_REQUIRES_OK(ctx, check_inputs("FlowpmLpt2Source", phi, cf, m));
    const i64 nb = phi.dim_size(0), ax = phi.dim_size(1), ay = phi.dim_size(2),
              nz = phi.dim_size(3), sx = ax - 2 * m, sy = ay - 2 * m;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, sx, sy, nz}), &out));
    T* O = out->flat<T>().data();
    T q[6];
    pair_coeffs<T>(cf, q);
    for_each_hessian<T>(ctx, phi, m, q, 200, [O, nz](i64 base, const T* h) {
      const T *xx = h, *yy = h + nz, *zz = h + 2 * nz, *xy = h + 3 * nz, *xz = h + 4 * nz,
              *yz = h + 5 * nz;
      T* __restrict o = O + base;
      for (i64 k = 0; k < nz; ++k)
        o[k] = ((xx[k] * yy[k] + yy[k] * zz[k]) + zz[k] * xx[k]) -
               ((xy[k] * xy[k] + xz[k] * xz[k]) + yz[k] * yz[k]);
    });
  }

 private:
  int margin_;
};

template <typename T>
class Lpt2SourceGradOp : public OpKernel {
 public:
  explicit Lpt2SourceGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("margin", &margin_));
    OP_REQUIRES_OK(ctx, check_margin("FlowpmLpt2SourceGrad", margin_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& phi = ctx->input(0);
    const Tensor& sbar = ctx->input(1);
    const Tensor& cf = ctx->input(2);
    const i64 m = margin_;
    OP_REQUIRES_OK(ctx, check_inputs("FlowpmLpt2SourceGrad", phi, cf, m));
    const i64 nb = phi.dim_size(0), ax = phi.dim_size(1), ay = phi.dim_size(2),
              nz = phi.dim_size(3), sx = ax - 2 * m, sy = ay - 2 * m;
    OP_REQUIRES(ctx, sbar.shape() == TensorShape({nb, sx, sy, nz}),
                InvalidArgument("FlowpmLpt2SourceGrad: sbar must be ",
                                TensorShape({nb, sx, sy, nz}).DebugString(), ", got ",
                                sbar.shape().DebugString()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, phi.shape(), &out));
    Tensor weights;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(phi.dtype(), TensorShape({6, nb, sx, sy, nz}),
                                           &weights));
    const T* SB = sbar.flat<T>().data();
    T* Wt = weights.flat<T>().data();
    T* O = out->flat<T>().data();
    T q[6];
    pair_coeffs<T>(cf, q);
    const i64 field = nb * sx * sy * nz;
    // 1. the weights w_ij = sbar dS/dh_ij q_ij on the output cells
    for_each_hessian<T>(ctx, phi, m, q, 220, [&](i64 base, const T* h) {
      const T *xx = h, *yy = h + nz, *zz = h + 2 * nz;
      const T* __restrict g = SB + base;
      T* __restrict w = Wt + base;
      for (i64 k = 0; k < nz; ++k) {
        w[k] = g[k] * (yy[k] + zz[k]) * q[0];
        w[field + k] = g[k] * (xx[k] + zz[k]) * q[1];
        w[2 * field + k] = g[k] * (xx[k] + yy[k]) * q[2];
      }
      for (int f = 3; f < 6; ++f) {
        const T* __restrict hf = h + f * nz;
        T* __restrict wf = w + f * field;
        for (i64 k = 0; k < nz; ++k) wf[k] = T(-2) * g[k] * hf[k] * q[f];
      }
    });
    // 2. phibar = the same stencil on the weights, zero beyond the output cells (margin 0:
    // the weights periodic, the output cells are the input's)
    const std::vector<T> zeros(nz, T(0));
    const Axis wx(sx, m == 0), wy(sy, m == 0);
    shard(ctx, nb * ax, ay * nz * 200, [&](int64_t begin, int64_t end) {
      Columns<T> c;
      ColumnScratch<T> s(nz);
      const T* h = s.h.data();
      for (i64 r = begin; r < end; ++r) {
        const i64 b = r / ax, x0 = r % ax;
        auto col = [&](int f, i64 x, i64 y) -> const T* {
          const i64 i = wx(x - m), j = wy(y - m);
          if (i < 0 || i >= sx || j < 0 || j >= sy) return zeros.data();
          return Wt + f * field + ((b * sx + i) * sy + j) * nz;
        };
        for (i64 y0 = 0; y0 < ay; ++y0) {
          gather_columns<T>(col, x0, y0, &c);
          second_differences<T>(c, &s);
          T* __restrict o = O + ((b * ax + x0) * ay + y0) * nz;
          for (i64 k = 0; k < nz; ++k)
            o[k] = ((h[k] + h[nz + k]) + h[2 * nz + k]) +
                   ((h[3 * nz + k] + h[4 * nz + k]) + h[5 * nz + k]);
        }
      }
    });
  }

 private:
  int margin_;
};

// ------------------------------------------------------------------ lattice combine
// Slot of lattice cell (i, j, k) of a block of (sx, sy, nz) cells in tiles (tx, ty, tz).
// The tiles are row-major, so the tx x planes of a slab [I tx, (I + 1) tx) fill the same
// slots in either order: the permutation stays inside each slab, and an output can
// take the buffer of an input slab by slab.
struct Tiles {
  i64 sx, sy, nz, tx, ty, tz;
  i64 slot(i64 i, i64 j, i64 k) const {
    const i64 tile = ((i / tx) * (sy / ty) + j / ty) * (nz / tz) + k / tz;
    return (tile * ty * tx + (i % tx) * ty + (j % ty)) * tz + k % tz;
  }
};

::tensorflow::Status tiles_of(OpKernelConstruction* ctx, Tiles* t) {
  std::vector<int> tile;
  TF_RETURN_IF_ERROR(ctx->GetAttr("tile", &tile));
  if (tile.size() != 3 || tile[0] < 1 || tile[1] < 1 || tile[2] < 1)
    return InvalidArgument("FlowpmLatticeCombine: tile must be 3 positive sizes");
  t->tx = tile[0], t->ty = tile[1], t->tz = tile[2];
  return ::tensorflow::OkStatus();
}

::tensorflow::Status check_tiles(const char* op, const Tiles& t) {
  if (t.sx % t.tx || t.sy % t.ty || t.nz % t.tz)
    return InvalidArgument(op, ": tile (", t.tx, ", ", t.ty, ", ", t.tz,
                           ") does not divide the block (", t.sx, ", ", t.sy, ", ", t.nz, ")");
  return ::tensorflow::OkStatus();
}

::tensorflow::Status check_coeffs(const char* op, const Tensor& cf, i64 m, i64 n) {
  if (cf.dims() != 2 || cf.dim_size(0) != m || cf.dim_size(1) != n)
    return InvalidArgument(op, ": coeffs must be [", m, ", ", n, "], got ",
                           cf.shape().DebugString());
  return ::tensorflow::OkStatus();
}

// o[e] = ((in[0][at + e] w[0]) + (in[1][at + e] w[step])) + ... over count inputs, each
// product rounded (no contraction): the sums of FlowpmLatticeCombine (w a row of the
// coefficients) and of its gradient (w a column), as their TensorFlow twins compute them.
template <typename T>
inline void weighted_run(T* __restrict o, const T* const* in, i64 at, i64 len, const T* w,
                         i64 step, int count) {
  const T* __restrict a = in[0] + at;
  const T w0 = w[0];
  for (i64 e = 0; e < len; ++e) o[e] = a[e] * w0;
  for (int n = 1; n < count; ++n) {
    const T* __restrict an = in[n] + at;
    const T wn = w[n * step];
    for (i64 e = 0; e < len; ++e) {
      const T term = an[e] * wn;
      o[e] = o[e] + term;
    }
  }
}

// Output m's run of tz particles at o (weighted_run of the inputs with row m of c), plus
// the lattice sites (i, j, k0 + kk) when `lattice`: shared by FlowpmLatticeCombine and
// FlowpmLatticeCombinePotentials.
template <typename T>
inline void combine_run(T* __restrict o, const T* const* in, i64 at, i64 len, const T* c,
                        int m, int N, bool lattice, i64 i, i64 j, i64 k0, i64 tz) {
  weighted_run<T>(o, in, at, len, c + m * N, 1, N);
  if (lattice) {
    const T fi = T(i), fj = T(j);
    for (i64 kk = 0; kk < tz; ++kk) {
      o[3 * kk] += fi;
      o[3 * kk + 1] += fj;
      o[3 * kk + 2] += T(k0 + kk);
    }
  }
}

// The attributes both combine ops read: tile, M and lattice_output (-1 or an output).
::tensorflow::Status combine_attrs(OpKernelConstruction* ctx, const char* op, Tiles* t, int* m,
                                   int* lattice) {
  TF_RETURN_IF_ERROR(tiles_of(ctx, t));
  TF_RETURN_IF_ERROR(ctx->GetAttr("M", m));
  TF_RETURN_IF_ERROR(ctx->GetAttr("lattice_output", lattice));
  if (*lattice < -1 || *lattice >= *m)
    return InvalidArgument(op, ": lattice_output ", *lattice, " is not an output (-1 or 0 .. ",
                           *m - 1, ")");
  return ::tensorflow::OkStatus();
}

template <typename T>
class LatticeCombineOp : public OpKernel {
 public:
  explicit LatticeCombineOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, combine_attrs(ctx, "FlowpmLatticeCombine", &t_, &m_, &lattice_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList ins;
    OP_REQUIRES_OK(ctx, ctx->input_list("inputs", &ins));
    const int N = ins.size(), M = m_;
    const Tensor& cf = ctx->input(N);
    const Tensor& x0 = ins[0];
    OP_REQUIRES(ctx, x0.dims() == 5,
                InvalidArgument("FlowpmLatticeCombine: inputs must be [B, sx, sy, nz, C], got ",
                                x0.shape().DebugString()));
    for (int n = 1; n < N; ++n)
      OP_REQUIRES(ctx, ins[n].shape() == x0.shape(),
                  InvalidArgument("FlowpmLatticeCombine: input ", n, " has the shape ",
                                  ins[n].shape().DebugString(), ", input 0 ",
                                  x0.shape().DebugString()));
    OP_REQUIRES_OK(ctx, check_coeffs("FlowpmLatticeCombine", cf, M, N));
    Tiles t = t_;
    const i64 nb = x0.dim_size(0), C = x0.dim_size(4);
    t.sx = x0.dim_size(1), t.sy = x0.dim_size(2), t.nz = x0.dim_size(3);
    OP_REQUIRES_OK(ctx, check_tiles("FlowpmLatticeCombine", t));
    OP_REQUIRES(ctx, lattice_ < 0 || C == 3,
                InvalidArgument("FlowpmLatticeCombine: lattice needs C = 3, got ", C));
    const i64 cells = t.sx * t.sy * t.nz;
    const TensorShape shape({nb, cells, C});
    // output m takes the buffer of input m where nothing else holds it (the inputs are
    // then read slab by slab into a scratch copy before the slab is written)
    std::vector<T*> dst(M);
    bool aliased = false;
    for (int m = 0; m < M; ++m) {
      Tensor* o = nullptr;
      if (m < N) {
        OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({m}, m, shape, &o));
      } else {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(m, shape, &o));
      }
      dst[m] = o->flat<T>().data();
      for (int n = 0; n < N; ++n) aliased |= dst[m] == ins[n].flat<T>().data();
    }
    std::vector<const T*> src(N);
    for (int n = 0; n < N; ++n) src[n] = ins[n].flat<T>().data();
    std::vector<T> c(M * N);
    for (i64 e = 0; e < M * N; ++e) c[e] = cf.flat<T>()(e);
    const int lat = lattice_;
    const i64 slab = t.tx * t.sy * t.nz * C, slabs = t.sx / t.tx;
    // one unit per (block, slab of tx x planes): the slab's columns, z runs of tz cells
    // going to consecutive slots
    shard(ctx, nb * slabs, slab * 4 * N * M, [&](i64 begin, i64 end) {
      std::vector<T> scratch(aliased ? N * slab : 0);
      std::vector<const T*> in(N);
      for (i64 u = begin; u < end; ++u) {
        const i64 b = u / slabs, I = u % slabs;
        const i64 base = (b * cells + I * t.tx * t.sy * t.nz) * C;
        for (int n = 0; n < N; ++n) {
          if (aliased) {
            std::copy(src[n] + base, src[n] + base + slab, scratch.data() + n * slab);
            in[n] = scratch.data() + n * slab;
          } else {
            in[n] = src[n] + base;
          }
        }
        for (i64 ii = 0; ii < t.tx; ++ii)
          for (i64 j = 0; j < t.sy; ++j) {
            const i64 i = I * t.tx + ii, col = (ii * t.sy + j) * t.nz * C;
            for (i64 k0 = 0; k0 < t.nz; k0 += t.tz) {
              const i64 at = col + k0 * C, len = t.tz * C;
              const i64 to = (b * cells + t.slot(i, j, k0)) * C;
              for (int m = 0; m < M; ++m)
                combine_run<T>(dst[m] + to, in.data(), at, len, c.data(), m, N, m == lat, i, j,
                               k0, t.tz);
            }
          }
      }
    });
  }

 private:
  Tiles t_;
  int m_, lattice_;
};

template <typename T>
class LatticeCombineGradOp : public OpKernel {
 public:
  explicit LatticeCombineGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, tiles_of(ctx, &t_));
    std::vector<int> block;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block", &block));
    OP_REQUIRES(ctx, block.size() == 3 && block[0] > 0 && block[1] > 0 && block[2] > 0,
                InvalidArgument("FlowpmLatticeCombineGrad: block must be 3 positive sizes"));
    t_.sx = block[0], t_.sy = block[1], t_.nz = block[2];
    OP_REQUIRES_OK(ctx, check_tiles("FlowpmLatticeCombineGrad", t_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList dys;
    OP_REQUIRES_OK(ctx, ctx->input_list("dys", &dys));
    const int M = dys.size(), N = n_;
    const Tensor& cf = ctx->input(M);
    const Tiles t = t_;
    const i64 cells = t.sx * t.sy * t.nz;
    const Tensor& d0 = dys[0];
    for (int m = 0; m < M; ++m)
      OP_REQUIRES(ctx, dys[m].dims() == 3 && dys[m].dim_size(1) == cells &&
                           dys[m].shape() == d0.shape(),
                  InvalidArgument("FlowpmLatticeCombineGrad: dys must be [B, ", cells,
                                  ", C] alike, got ", dys[m].shape().DebugString()));
    OP_REQUIRES_OK(ctx, check_coeffs("FlowpmLatticeCombineGrad", cf, M, N));
    const i64 nb = d0.dim_size(0), C = d0.dim_size(2);
    ::tensorflow::OpOutputList outs;
    OP_REQUIRES_OK(ctx, ctx->output_list("outputs", &outs));
    std::vector<T*> dst(N);
    for (int n = 0; n < N; ++n) {
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, outs.allocate(n, TensorShape({nb, t.sx, t.sy, t.nz, C}), &o));
      dst[n] = o->flat<T>().data();
    }
    std::vector<const T*> src(M);
    for (int m = 0; m < M; ++m) src[m] = dys[m].flat<T>().data();
    std::vector<T> c(M * N);
    for (i64 e = 0; e < M * N; ++e) c[e] = cf.flat<T>()(e);
    // dx_n = sum_m dy_m c[m, n], terms in the order of m
    shard(ctx, nb * t.sx * t.sy, t.nz * C * 2 * N * M, [&](i64 begin, i64 end) {
      for (i64 u = begin; u < end; ++u) {
        const i64 b = u / (t.sx * t.sy), i = (u / t.sy) % t.sx, j = u % t.sy;
        const i64 out0 = ((b * t.sx + i) * t.sy + j) * t.nz * C;
        for (i64 k0 = 0; k0 < t.nz; k0 += t.tz) {
          const i64 from = (b * cells + t.slot(i, j, k0)) * C, len = t.tz * C;
          for (int n = 0; n < N; ++n)
            weighted_run<T>(dst[n] + out0 + k0 * C, src.data(), from, len, c.data() + n, N, M);
        }
      }
    });
  }

 private:
  Tiles t_;
  int n_;
};

// ------------------------------------------------------------------ lattice combine of potentials
// FlowpmLatticeCombinePotentials: FlowpmGradient of each potential, then FlowpmLatticeCombine
// of the N displacements, in one pass over (block, tile row) units: the differences of a
// unit's tx x ty columns go to a per-thread scratch (the same expression as FlowpmGradient's
// cell, the same bits), then to the unit's slots (contiguous: a tile row's tiles follow one
// another) as FlowpmLatticeCombine writes them. No displacement field is ever made.

// The four-point difference (four_point_column, tf_op.h) of column (x, y) of block b of
// phi [B, ax, ay, nz] (input indices; x, y read inside the array, or periodically),
// coefficients c[3],
// written to o[3 k + d].
template <typename T>
inline void difference_column(const T* P, i64 ax, i64 ay, i64 nz, i64 b, i64 x, i64 y,
                              const Axis& wx, const Axis& wy, const T c[3],
                              const std::vector<i64>& zi, T* o) {
  auto col = [&](i64 xx, i64 yy) { return P + ((b * ax + wx(xx)) * ay + wy(yy)) * nz; };
  const T* xs[4] = {col(x - 2, y), col(x - 1, y), col(x + 1, y), col(x + 2, y)};
  const T* ys[4] = {col(x, y - 2), col(x, y - 1), col(x, y + 1), col(x, y + 2)};
  four_point_column<T>(xs, ys, col(x, y), nz, c, zi, o);
}

// FlowpmWrap (particle_ops.cc) of n positions o[3 i + a]: wrap_coordinate (tf_op.h) along
// every axis with size s > 0.
template <typename T>
inline void wrap_positions(T* o, i64 n, const T size[3], const T below[3]) {
  for (i64 i = 0; i < n; ++i)
    for (int a = 0; a < 3; ++a)
      if (size[a] != T(0)) o[3 * i + a] = wrap_coordinate(o[3 * i + a], size[a], below[a]);
}

template <typename T>
class LatticeCombinePotentialsOp : public OpKernel {
 public:
  explicit LatticeCombinePotentialsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, combine_attrs(ctx, "FlowpmLatticeCombinePotentials", &t_, &m_,
                                      &lattice_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("margins", &margins_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &capacity_));
    OP_REQUIRES(ctx, capacity_ >= 0,
                InvalidArgument("FlowpmLatticeCombinePotentials: negative capacity"));
    std::vector<float> wrap;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wrap", &wrap));
    OP_REQUIRES(ctx, wrap.size() == 3,
                InvalidArgument("FlowpmLatticeCombinePotentials: wrap must have 3 sizes"));
    for (int a = 0; a < 3; ++a) {
      OP_REQUIRES(ctx, wrap[a] >= 0,
                  InvalidArgument("FlowpmLatticeCombinePotentials: negative wrap size"));
      size_[a] = T(wrap[a]);
      below_[a] = std::nextafter(size_[a], T(0));
    }
    OP_REQUIRES(ctx, lattice_ >= 0 || (wrap[0] == 0 && wrap[1] == 0 && wrap[2] == 0),
                InvalidArgument("FlowpmLatticeCombinePotentials: wrap needs a lattice_output"));
    for (int mg : margins_)
      OP_REQUIRES(ctx, mg >= 2 || mg == 0,
                  InvalidArgument("FlowpmLatticeCombinePotentials: margins must be >= 2 (the "
                                  "difference reads inside the array) or 0 (periodic), got ",
                                  mg));
  }

  void Compute(OpKernelContext* ctx) override {
    const char* op = "FlowpmLatticeCombinePotentials";
    ::tensorflow::OpInputList phis;
    OP_REQUIRES_OK(ctx, ctx->input_list("phis", &phis));
    const int N = phis.size(), M = m_;
    OP_REQUIRES(ctx, static_cast<int>(margins_.size()) == N,
                InvalidArgument(op, ": ", margins_.size(), " margins for ", N, " potentials"));
    const Tensor& gc = ctx->input(N);
    const Tensor& cf = ctx->input(N + 1);
    ::tensorflow::OpInputList donors;
    OP_REQUIRES_OK(ctx, ctx->input_list("donors", &donors));
    OP_REQUIRES(ctx, donors.size() <= M,
                InvalidArgument(op, ": ", donors.size(), " donors for ", M, " outputs"));
    OP_REQUIRES(ctx, gc.NumElements() == 3,
                InvalidArgument(op, ": grad_coeffs must have 3 values"));
    for (int n = 0; n < N; ++n)
      OP_REQUIRES(ctx, phis[n].dims() == 4,
                  InvalidArgument(op, ": potentials must be [B, ax, ay, nz], got ",
                                  phis[n].shape().DebugString()));
    const Tensor& p0 = phis[0];
    Tiles t = t_;
    const i64 nb = p0.dim_size(0), nz = p0.dim_size(3);
    t.sx = p0.dim_size(1) - 2 * margins_[0], t.sy = p0.dim_size(2) - 2 * margins_[0], t.nz = nz;
    OP_REQUIRES(ctx, t.sx > 0 && t.sy > 0 && nz > 0,
                InvalidArgument(op, ": potential 0 ", p0.shape().DebugString(),
                                " is not larger than its margins ", margins_[0]));
    for (int n = 1; n < N; ++n) {
      const Tensor& p = phis[n];
      const i64 mg = margins_[n];
      OP_REQUIRES(ctx, p.dim_size(0) == nb && p.dim_size(1) == t.sx + 2 * mg &&
                           p.dim_size(2) == t.sy + 2 * mg && p.dim_size(3) == nz,
                  InvalidArgument(op, ": potential ", n, " has the shape ",
                                  p.shape().DebugString(), ", not the block (", t.sx, ", ",
                                  t.sy, ", ", nz, ") with margins ", mg));
    }
    OP_REQUIRES_OK(ctx, check_tiles(op, t));
    OP_REQUIRES_OK(ctx, check_coeffs(op, cf, M, N));
    const i64 cells = t.sx * t.sy * nz, C = 3;
    const i64 cap = capacity_ > 0 ? capacity_ : cells;
    OP_REQUIRES(ctx, cap >= cells,
                InvalidArgument(op, ": capacity ", cap, " is below the ", cells,
                                " lattice sites of a block"));
    // Output m < K takes over donor m's buffer where nothing else holds it (a variable's
    // value handed over by FlowpmTakeVariable: no fresh pages), else it is allocated. Every
    // slot is written: the lattice's by the pass, the rest (up to the capacity) zeroed.
    std::vector<T*> dst(M);
    for (int m = 0; m < M; ++m) {
      Tensor* o = nullptr;
      const TensorShape shape({nb, cap, C});
      if (m < donors.size()) {
        OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({N + 2 + m}, m, shape, &o));
      } else {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(m, shape, &o));
      }
      dst[m] = o->flat<T>().data();
    }
    std::vector<const T*> src(N);
    for (int n = 0; n < N; ++n) src[n] = phis[n].flat<T>().data();
    const T g[3] = {gc.flat<T>()(0), gc.flat<T>()(1), gc.flat<T>()(2)};
    std::vector<T> c(M * N);
    for (i64 e = 0; e < M * N; ++e) c[e] = cf.flat<T>()(e);
    const std::vector<i64> zi = z_neighbours(nz);
    const std::vector<int> margins = margins_;
    std::vector<Axis> axes;   // x and y of each potential
    for (int n = 0; n < N; ++n) {
      axes.emplace_back(phis[n].dim_size(1), margins[n] == 0);
      axes.emplace_back(phis[n].dim_size(2), margins[n] == 0);
    }
    const int lat = lattice_;
    const T* size = size_;
    const T* below = below_;
    const bool wraps = size_[0] > T(0) || size_[1] > T(0) || size_[2] > T(0);
    const i64 rows_y = t.sy / t.ty, units = t.sx / t.tx * rows_y;
    const i64 unit = t.tx * t.ty * nz * C;
    // one unit per (block, row of tiles along z): its tx x ty columns
    shard(ctx, nb * units, unit * (6 * N + 2 * N * M), [&](i64 begin, i64 end) {
      std::vector<T> scratch(N * unit);
      std::vector<const T*> in(N);
      for (int n = 0; n < N; ++n) in[n] = scratch.data() + n * unit;
      for (i64 u = begin; u < end; ++u) {
        const i64 b = u / units, I = (u % units) / rows_y, J = u % rows_y;
        for (int n = 0; n < N; ++n) {
          const Tensor& p = phis[n];
          const i64 mg = margins[n];
          for (i64 ii = 0; ii < t.tx; ++ii)
            for (i64 jj = 0; jj < t.ty; ++jj)
              difference_column<T>(src[n], p.dim_size(1), p.dim_size(2), nz, b,
                                   I * t.tx + ii + mg, J * t.ty + jj + mg, axes[2 * n],
                                   axes[2 * n + 1], g, zi,
                                   scratch.data() + n * unit + (ii * t.ty + jj) * nz * C);
        }
        for (i64 ii = 0; ii < t.tx; ++ii)
          for (i64 jj = 0; jj < t.ty; ++jj) {
            const i64 i = I * t.tx + ii, j = J * t.ty + jj, col = (ii * t.ty + jj) * nz * C;
            for (i64 k0 = 0; k0 < nz; k0 += t.tz) {
              const i64 at = col + k0 * C, len = t.tz * C;
              const i64 to = (b * cap + t.slot(i, j, k0)) * C;
              for (int m = 0; m < M; ++m) {
                combine_run<T>(dst[m] + to, in.data(), at, len, c.data(), m, N, m == lat, i, j,
                               k0, t.tz);
                if (m == lat && wraps) wrap_positions(dst[m] + to, t.tz, size, below);
              }
            }
          }
      }
    });
    if (cap > cells)   // the padding slots, one unit per (output, block), on the pool too
      shard(ctx, M * nb, (cap - cells) * C, [&](i64 begin, i64 end) {
        for (i64 u = begin; u < end; ++u) {
          const i64 b = u % nb;
          std::fill(dst[u / nb] + (b * cap + cells) * C, dst[u / nb] + (b + 1) * cap * C, T(0));
        }
      });
  }

 private:
  Tiles t_;
  int m_, lattice_;
  ::tensorflow::int64 capacity_;
  std::vector<int> margins_;
  T size_[3], below_[3];
};

}  // namespace

REGISTER_OP("FlowpmLpt2Source")
    .Input("phi: T")
    .Input("coeffs: T")
    .Output("source: T")
    .Attr("T: {float, double}")
    .Attr("margin: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      int m;
      TF_RETURN_IF_ERROR(c->GetAttr("margin", &m));
      TF_RETURN_IF_ERROR(check_margin("FlowpmLpt2Source", m));
      ShapeHandle phi;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &phi));
      DimensionHandle sx, sy;
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(phi, 1), 2 * m, &sx));
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(phi, 2), 2 * m, &sy));
      c->set_output(0, c->MakeShape({c->Dim(phi, 0), sx, sy, c->Dim(phi, 3)}));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmLpt2SourceGrad")
    .Input("phi: T")
    .Input("sbar: T")
    .Input("coeffs: T")
    .Output("phibar: T")
    .Attr("T: {float, double}")
    .Attr("margin: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      int m;
      TF_RETURN_IF_ERROR(c->GetAttr("margin", &m));
      TF_RETURN_IF_ERROR(check_margin("FlowpmLpt2SourceGrad", m));
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    });

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmLpt2Source", Lpt2SourceOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmLpt2SourceGrad", Lpt2SourceGradOp);

REGISTER_OP("FlowpmLatticeCombine")
    .Input("inputs: N * T")
    .Input("coeffs: T")
    .Output("outputs: M * T")
    .Attr("N: int >= 1")
    .Attr("M: int >= 1")
    .Attr("T: {float, double}")
    .Attr("tile: list(int)")
    .Attr("lattice_output: int = -1")
    .SetShapeFn([](InferenceContext* c) {
      int m;
      TF_RETURN_IF_ERROR(c->GetAttr("M", &m));
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 5, &x));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(x, 1), c->Dim(x, 2), &n));
      TF_RETURN_IF_ERROR(c->Multiply(n, c->Dim(x, 3), &n));
      for (int i = 0; i < m; ++i)
        c->set_output(i, c->MakeShape({c->Dim(x, 0), n, c->Dim(x, 4)}));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmLatticeCombineGrad")
    .Input("dys: M * T")
    .Input("coeffs: T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("M: int >= 1")
    .Attr("T: {float, double}")
    .Attr("tile: list(int)")
    .Attr("block: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int> block;
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("block", &block));
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      if (block.size() != 3)
        return InvalidArgument("FlowpmLatticeCombineGrad: block must be 3 sizes");
      ShapeHandle dy;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &dy));
      for (int i = 0; i < n; ++i)
        c->set_output(i, c->MakeShape({c->Dim(dy, 0), block[0], block[1], block[2],
                                       c->Dim(dy, 2)}));
      return ::tensorflow::OkStatus();
    });

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmLatticeCombine", LatticeCombineOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmLatticeCombineGrad", LatticeCombineGradOp);

REGISTER_OP("FlowpmLatticeCombinePotentials")
    .Input("phis: N * T")
    .Input("grad_coeffs: T")
    .Input("coeffs: T")
    .Input("donors: K * T")
    .Output("outputs: M * T")
    .Attr("N: int >= 1")
    .Attr("M: int >= 1")
    .Attr("K: int >= 0 = 0")
    .Attr("T: {float, double}")
    .Attr("tile: list(int)")
    .Attr("margins: list(int)")
    .Attr("lattice_output: int = -1")
    .Attr("wrap: list(float) = [0, 0, 0]")
    .Attr("capacity: int = 0")
    .SetShapeFn([](InferenceContext* c) {
      int m;
      ::tensorflow::int64 capacity;
      std::vector<int> margins;
      TF_RETURN_IF_ERROR(c->GetAttr("M", &m));
      TF_RETURN_IF_ERROR(c->GetAttr("capacity", &capacity));
      TF_RETURN_IF_ERROR(c->GetAttr("margins", &margins));
      if (margins.empty()) return InvalidArgument("FlowpmLatticeCombinePotentials: no margins");
      ShapeHandle p;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &p));
      DimensionHandle sx, sy, n;
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(p, 1), 2 * margins[0], &sx));
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(p, 2), 2 * margins[0], &sy));
      TF_RETURN_IF_ERROR(c->Multiply(sx, sy, &n));
      TF_RETURN_IF_ERROR(c->Multiply(n, c->Dim(p, 3), &n));
      if (capacity > 0) n = c->MakeDim(capacity);
      for (int i = 0; i < m; ++i) c->set_output(i, c->MakeShape({c->Dim(p, 0), n, 3}));
      return ::tensorflow::OkStatus();
    });

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmLatticeCombinePotentials", LatticeCombinePotentialsOp);
