// Fused cloud-in-cell (CIC) paint and readout on padded blocks, on the CPU.
//
// Ops (the Python side, gradients included, is flowpm_mtf/painting.py; for
// FlowpmInterleave, flowpm_mtf/kernels.py):
//
//   FlowpmCicPaint(positions [B, n, 3], weights [B, n, C] or [0], halo, px, py, nz,
//                  components) -> field [B, px, py, nz, C]
//       field[b, c] = sum_p w[b, p] K_c(pos[b, p])   (w = 1 when weights is empty)
//   FlowpmCicReadout(field [B, px, py, nz, C], positions [B, n, 3], halo)
//       -> values [B, n, C]:  values[b, p] = sum_c K_c(pos[b, p]) field[b, c]
//   FlowpmCicReadoutInto(field, positions, donor [B, n, C], halo)
//       FlowpmCicReadout written into the donor's buffer when nothing else holds it (e.g.
//       a state variable's old value, flowpm_mtf.mesh.donate.take: the job's first PM force
//       into the forces' zeros, no fresh output); the donor's values are not read.
//   FlowpmCicReadoutGradPos(field [B, px, py, nz, C], positions [B, n, 3],
//                           dvalues [B, n, C] or [0], halo) -> dpos [B, n, 3]
//       dpos[b, p, a] = sum_C dv[b, p, C] sum_c dK_c/dx_a(pos[b, p]) field[b, c, C]
//       (dv = 1 when dvalues is empty): the gradient of the readout with respect
//       to the positions, and (field = upstream gradient, dv = weights) of the paint.
//   FlowpmCicReadoutGrad(field [B, px, py, nz, C], positions [B, n, 3],
//                        dvalues [B, n, C], halo) -> (dfield, dpos): both gradients of
//       the readout in one pass (= FlowpmCicPaint of dvalues and
//       FlowpmCicReadoutGradPos, bit for bit; the stencil computed once).
//   FlowpmCicReadoutVjp(field [B, px, py, nz, C], positions [B, n, 3],
//                       cotangents [B, n, C], weights [B, n] or [0], scale [])
//       -> (values, dfield, dpos): the readout scaled, values = (R(field) * scale) * w,
//       and both gradients of it for the cotangents, d = (cot * w) * scale:
//       dfield = FlowpmCicPaint of d, dpos = FlowpmCicReadoutGradPos(field, d), in
//       one pass (the PM force and its VJP in the adjoint's reverse step: the
//       values equal FlowpmCicReadout times scale times w, the gradients
//       FlowpmCicReadoutGrad of d, bit for bit; w = 1 when weights is empty).
//   FlowpmCicReadoutScaledGrad(field, positions, cotangents, weights, scale,
//                              density_bar [B, px, py, nz, 1] or [0]) -> (values, dpos):
//       FlowpmCicReadoutVjp without its paint, parallel over the particles (bit for
//       bit its values and dpos), plus FlowpmCicReadoutGradPos(density_bar, positions,
//       weights) added to dpos when density_bar is given (the paint's position
//       gradient in the adjoint's force VJP).
//   FlowpmCicPaintPair(positions [B, n, 3], cotangents [B, n, C], weights [B, n] or
//                      [0], scale [], halo, px, py, nz) -> (density [B, px, py, nz, 1],
//       dfield [B, px, py, nz, C]): the density paint (FlowpmCicPaint with the weights)
//       and FlowpmCicReadoutVjp's paint of d = (cot * w) * scale, in one slab scan,
//       bit for bit. With FlowpmCicReadoutScaledGrad, the adjoint's reverse step:
//       the cotangents are known before the force, so their paint joins the density's.
//   FlowpmNegDivergence(g [B, ax, ay, nz, 3], coeffs [3], margin) -> [B, ax - 2 margin,
//       ay - 2 margin, nz]: sum_d coeffs[d] (8 (g_d(+1) - g_d(-1)) - (g_d(+2) - g_d(-2)))
//       along axis d (the four-point finite difference of flowpm_mtf.physics.kernels, times
//       12 c_d^2 coeffs[d] / c_d^2 ...: the caller's scale), z periodic; x and y read
//       inside the array (margin >= 2), periodic (margin 0), or the array extended by
//       zeros (margin -2: output [B, ax + 4, ay + 4, nz], the stencil's whole reach).
//       The PM force VJP's divergence in real space (flowpm_mtf.physics.gravity.pm_forces_vjp).
//   FlowpmGradient(phi [B, ax, ay, nz], coeffs [3], margin) -> [B, ax - 2 margin,
//       ay - 2 margin, nz, 3]: component d = coeffs[d] (8 (phi(+1) - phi(-1)) - (phi(+2) -
//       phi(-2))) along axis d, z periodic; x and y read inside the array (margin >= 2:
//       the potential of a padded block) or periodic with output margins -margin (margin
//       <= 0: one block holding the whole mesh, the padded force field written directly):
//       the PM force field from the potential (flowpm_mtf.physics.gravity). Its gradient is
//       FlowpmNegDivergence(dy, -coeffs, margin -2), padded by margin - 2 cells (inside)
//       or folded periodically (margin <= 0).
//   FlowpmCicEscaped(positions [B, n, 3], halo, sx, sy) -> int32 [B]
//       particles per block whose stencil leaves the padded block (or non-finite).
//   FlowpmInterleave(inputs N x [a, b, ..., w_i], picks, wrap) -> [a + 2 wrap,
//       b + 2 wrap, ..., K]: out[i, j, ..., k] = inputs[picks[2k]][(i - wrap) mod a,
//       (j - wrap) mod b, ..., picks[2k + 1]] (one pass; e.g. the (x, y) pair and z
//       of the force read from two packed inverse FFTs into [x, y, z, xyz], which
//       tf.stack / tf.concat copy one element at a time along a short last axis;
//       with wrap = h, directly the padded block with periodic margins of a
//       one-block mesh).
//   FlowpmInterleaveGrad(dy [a + 2 wrap, b + 2 wrap, ..., K], picks, wrap, widths)
//       -> N x [a, b, ..., widths[i]]: the gradient of FlowpmInterleave (each
//       column of dy added to the column it was picked from, margins added back
//       into the cells they copy; unpicked columns 0), in one pass.
//
// The particle ops of flowpm_mtf.mesh.domain's migration (FlowpmParticleStats,
// FlowpmSelectRows, FlowpmMaskRows, FlowpmWrap) are in particle_ops.cc; the
// positions checks and the escape test both use are in cic_block.h.
//
// The stencil is that of the TensorFlow path (flowpm_mtf.physics.painting._stencil): a
// particle at block-local (x, y, z) [cells] touches the padded cells
// clip(floor(x) + h + {0, 1}, 0, px - 1) along x (same along y) and
// (floor(z) + {0, 1}) mod nz along z, with the weights (1 - f, f), f = x - floor(x),
// multiplied as (wx * wy) * wz and then by the particle's weight, corners in the
// order x, y, z (z fastest): every cell receives its terms in the same order as
// the TensorFlow path's unsorted_segment_sum (particle order), so the paint is the
// same to the last bit, whatever the number of threads.
//
// A particle with a non-finite coordinate is skipped (paints nothing, reads 0,
// gets a zero gradient): masked slots of fixed-capacity particle buffers are
// harmless whatever they hold. Such particles are counted as escaped, so a
// non-finite *valid* particle is still reported by the escape check.
//
// Threading: TensorFlow's intra-op pool (the threads the session gives this
// process). The readout and the gradient are parallel over particles. The
// paint is parallel over slabs of the padded x axis: each thread scans all
// particles and deposits only into its own rows, so there are no atomics, no
// per-thread copies of the field, and the sums do not depend on the thread
// count; the scans cost n * threads reads, so the slab count is capped.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cic_block.h"
#include "tf_op.h"

namespace {

// Most slabs the paint uses (each scans every particle).
constexpr int kMaxPaintSlabs = 8;

// The CIC stencil of one particle along one axis: two cell indices and weights.
template <typename T>
struct Axis {
  i64 i[2];
  T w[2];
  T f;  // fractional part (d w[1] / dx = 1, d w[0] / dx = -1)
};

template <typename T>
inline bool finite3(const T* p) {
  return std::isfinite(p[0]) && std::isfinite(p[1]) && std::isfinite(p[2]);
}

// Cell index of floor(x) (x finite), clamped far outside any block so that the
// conversion is defined; the clip that follows maps it to the border.
template <typename T>
inline i64 floor_index(T fl) {
  const T big = T(1 << 30);
  return static_cast<i64>(std::min(std::max(fl, -big), big));
}

template <typename T>
inline void clipped_axis(T x, i64 h, i64 p, Axis<T>* a) {
  T fl = std::floor(x);
  a->f = x - fl;
  a->w[0] = T(1) - a->f;
  a->w[1] = a->f;
  i64 c = floor_index(fl) + h;
  a->i[0] = std::min(std::max<i64>(c, 0), p - 1);
  a->i[1] = std::min(std::max<i64>(c + 1, 0), p - 1);
}

template <typename T>
inline void periodic_axis(T x, i64 n, Axis<T>* a) {
  T fl = std::floor(x);
  a->f = x - fl;
  a->w[0] = T(1) - a->f;
  a->w[1] = a->f;
  i64 c = floor_index(fl);
  if (c < 0 || c >= n) {  // rare: an integer division only for a particle to wrap
    c %= n;
    if (c < 0) c += n;
  }
  a->i[0] = c;
  a->i[1] = (c + 1 == n) ? 0 : c + 1;
}

struct Geometry {
  i64 px, py, nz, comps;
  i64 halo;
};

template <typename T>
inline void stencil(const T* p, const Geometry& g, Axis<T>* ax, Axis<T>* ay, Axis<T>* az) {
  clipped_axis(p[0], g.halo, g.px, ax);
  clipped_axis(p[1], g.halo, g.py, ay);
  periodic_axis(p[2], g.nz, az);
}

// ------------------------------------------------------------------ shapes

::tensorflow::Status paint_shape(InferenceContext* c) {
  int px, py, nz, comps;
  TF_RETURN_IF_ERROR(c->GetAttr("px", &px));
  TF_RETURN_IF_ERROR(c->GetAttr("py", &py));
  TF_RETURN_IF_ERROR(c->GetAttr("nz", &nz));
  TF_RETURN_IF_ERROR(c->GetAttr("components", &comps));
  ShapeHandle pos;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &pos));
  c->set_output(0, c->MakeShape({c->Dim(pos, 0), px, py, nz, comps}));
  return ::tensorflow::OkStatus();
}

::tensorflow::Status readout_shape(InferenceContext* c) {
  ShapeHandle field, pos;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 5, &field));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &pos));
  c->set_output(0, c->MakeShape({c->Dim(pos, 0), c->Dim(pos, 1), c->Dim(field, 4)}));
  return ::tensorflow::OkStatus();
}

::tensorflow::Status grad_pos_shape(InferenceContext* c) {
  c->set_output(0, c->input(1));
  return ::tensorflow::OkStatus();
}

::tensorflow::Status escaped_shape(InferenceContext* c) {
  ShapeHandle pos;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &pos));
  c->set_output(0, c->MakeShape({c->Dim(pos, 0)}));
  return ::tensorflow::OkStatus();
}

::tensorflow::Status check_field(const Tensor& f, const Tensor& pos, i64 halo) {
  if (f.dims() != 5 || f.dim_size(0) != pos.dim_size(0))
    return InvalidArgument("CIC: field must be [blocks, px, py, nz, components] with ",
                           pos.dim_size(0), " blocks, got ", f.shape().DebugString());
  if (halo < 0 || f.dim_size(1) < 1 || f.dim_size(2) < 1 || f.dim_size(3) < 1)
    return InvalidArgument("CIC: empty field or negative halo");
  return ::tensorflow::OkStatus();
}

// ------------------------------------------------------------------ paint
// Deposits of the n particles of one block into the padded x rows [r0, r1) of its
// field fb; KC = C known at compile time (1: density, 3: the transposed force
// readout) or 0 for any C, HasW: with
// per-particle weights wb. The terms and their order are those of the generic
// loop (corners x, y, z; kern = (wx * wy) * wz, then times the weight).
// One particle's deposits into the x rows of its stencil that the slab holds
// (in0, in1: rows ax.i[0], ax.i[1]); w: its C weights (HasW) or unit weights.
template <typename T, int KC, bool HasW>
inline void deposit(const Axis<T>& ax, const Axis<T>& ay, const Axis<T>& az, bool in0,
                    bool in1, const T* __restrict__ w, T* __restrict__ fb, const Geometry& g) {
  const i64 C = KC ? KC : g.comps;
  const i64 zrow = g.nz * C;
  const i64 z0 = az.i[0] * C, z1 = az.i[1] * C;
  for (int i = 0; i < 2; ++i) {
    if (!(i ? in1 : in0)) continue;
    for (int j = 0; j < 2; ++j) {
      const T wxy = ax.w[i] * ay.w[j];
      T* cell = fb + (ax.i[i] * g.py + ay.i[j]) * zrow;
      const T k0 = wxy * az.w[0], k1 = wxy * az.w[1];
      for (i64 c = 0; c < C; ++c) cell[z0 + c] += HasW ? k0 * w[c] : k0;
      for (i64 c = 0; c < C; ++c) cell[z1 + c] += HasW ? k1 * w[c] : k1;
    }
  }
}

// Runs slab(b, r0, r1) for every slab [r0, r1) of the px padded x rows of each of
// the nb blocks (n particles each): the parallel structure of the paint-like ops
// (one unit per shard: a unit is a whole slab's scan of its block's particles).
template <typename Slab>
void for_slabs(OpKernelContext* ctx, i64 nb, i64 n, i64 px, Slab&& slab) {
  i64 slabs = std::min<i64>({pool_threads(ctx), kMaxPaintSlabs, px});
  if (n * nb < (1 << 14)) slabs = 1;
  auto work = [&](i64 begin, i64 end) {
    for (i64 u = begin; u < end; ++u) {
      const i64 b = u / slabs, sl = u % slabs;
      slab(b, px * sl / slabs, px * (sl + 1) / slabs);
    }
  };
  if (slabs * nb == 1) {
    work(0, 1);
  } else {
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    ::tensorflow::Shard(slabs, workers, slabs * nb, 1LL << 30, work);
  }
}

template <typename T, int KC, bool HasW>
void paint_slab(const T* __restrict__ pb, const T* __restrict__ wb, T* __restrict__ fb,
                const Geometry& g, i64 n, i64 r0, i64 r1) {
  const i64 C = KC ? KC : g.comps;
  for (i64 p = 0; p < n; ++p) {
    const T* q = pb + 3 * p;
    if (!finite3(q)) continue;
    Axis<T> ax, ay, az;
    clipped_axis(q[0], g.halo, g.px, &ax);
    const bool in0 = ax.i[0] >= r0 && ax.i[0] < r1, in1 = ax.i[1] >= r0 && ax.i[1] < r1;
    if (!in0 && !in1) continue;
    clipped_axis(q[1], g.halo, g.py, &ay);
    periodic_axis(q[2], g.nz, &az);
    deposit<T, KC, HasW>(ax, ay, az, in0, in1, HasW ? wb + p * C : nullptr, fb, g);
  }
}

template <typename T>
class CicPaintOp : public OpKernel {
 public:
  explicit CicPaintOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("halo", &v));
    g_.halo = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("px", &v));
    g_.px = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("py", &v));
    g_.py = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("nz", &v));
    g_.nz = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("components", &v));
    g_.comps = v;
    OP_REQUIRES(ctx, g_.px > 0 && g_.py > 0 && g_.nz > 0 && g_.comps > 0 && g_.halo >= 0,
                InvalidArgument("CIC paint: px, py, nz, components must be positive"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& pos = ctx->input(0);
    const Tensor& wts = ctx->input(1);
    OP_REQUIRES_OK(ctx, check_positions(pos));
    OP_REQUIRES_OK(ctx, check_per_particle(wts, pos, g_.comps, "weights"));
    const i64 nb = pos.dim_size(0), n = pos.dim_size(1), C = g_.comps;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, g_.px, g_.py, g_.nz, C}),
                                             &out));
    const T* P = pos.flat<T>().data();
    const T* W = wts.NumElements() ? wts.flat<T>().data() : nullptr;
    T* F = out->flat<T>().data();
    const i64 row = g_.py * g_.nz * C;  // values per padded x row
    std::memset(F, 0, sizeof(T) * nb * g_.px * row);
    const Geometry g = g_;
    for_slabs(ctx, nb, n, g.px, [&](i64 b, i64 r0, i64 r1) {
      const T* pb = P + b * n * 3;
      const T* wb = W ? W + b * n * C : nullptr;
      T* fb = F + b * g.px * row;
      if (C == 1 && wb)
        paint_slab<T, 1, true>(pb, wb, fb, g, n, r0, r1);
      else if (C == 1)
        paint_slab<T, 1, false>(pb, wb, fb, g, n, r0, r1);
      else if (C == 3 && wb)  // the readout's gradient w.r.t. the force mesh
        paint_slab<T, 3, true>(pb, wb, fb, g, n, r0, r1);
      else if (wb)
        paint_slab<T, 0, true>(pb, wb, fb, g, n, r0, r1);
      else
        paint_slab<T, 0, false>(pb, wb, fb, g, n, r0, r1);
    });
  }

 private:
  Geometry g_;
};

// Readout of particles [begin, end) (flat over blocks); KC = C known at compile
// time (1, 3) or 0 for any C.
template <typename T, int KC>
void read_range(const T* __restrict__ P, const T* __restrict__ F, T* __restrict__ V,
                const Geometry& g, i64 n, i64 block, i64 begin,
                i64 end) {
  const i64 C = KC ? KC : g.comps;
  i64 b = begin / n, next = (b + 1) * n;  // block of particle u, without a division each
  for (i64 u = begin; u < end; ++u) {
    if (u == next) ++b, next += n;
    const T* q = P + 3 * u;
    T* v = V + u * C;
    for (i64 c = 0; c < C; ++c) v[c] = T(0);
    if (!finite3(q)) continue;
    Axis<T> ax, ay, az;
    stencil(q, g, &ax, &ay, &az);
    const T* fb = F + b * block;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const T wxy = ax.w[i] * ay.w[j];
        const T* cell = fb + (ax.i[i] * g.py + ay.i[j]) * g.nz * C;
        for (int k = 0; k < 2; ++k) {
          const T kern = wxy * az.w[k];
          const T* src = cell + az.i[k] * C;
          for (i64 c = 0; c < C; ++c) v[c] += kern * src[c];
        }
      }
  }
}

// ------------------------------------------------------------------ readout
template <typename T>
class CicReadoutOp : public OpKernel {
 public:
  explicit CicReadoutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("halo", &v));
    halo_ = v;
    into_ = def().op() == "FlowpmCicReadoutInto";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& field = ctx->input(0);
    const Tensor& pos = ctx->input(1);
    OP_REQUIRES_OK(ctx, check_positions(pos));
    OP_REQUIRES_OK(ctx, check_field(field, pos, halo_));
    const i64 nb = pos.dim_size(0), n = pos.dim_size(1), C = field.dim_size(4);
    Geometry g{field.dim_size(1), field.dim_size(2), field.dim_size(3), C, halo_};
    Tensor* out = nullptr;
    const TensorShape shape({nb, n, C});
    if (into_) {   // FlowpmCicReadoutInto: the values in the donor's buffer if it is free
      const Tensor& donor = ctx->input(2);
      OP_REQUIRES(ctx, donor.shape() == shape,
                  InvalidArgument("FlowpmCicReadoutInto: the donor must be ",
                                  shape.DebugString(), ", got ", donor.shape().DebugString()));
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({2}, 0, shape, &out));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    }
    const T* P = pos.flat<T>().data();
    const T* F = field.flat<T>().data();
    T* V = out->flat<T>().data();
    const i64 block = g.px * g.py * g.nz * C;
    auto work = [&](i64 begin, i64 end) {
      if (C == 1) {
        read_range<T, 1>(P, F, V, g, n, block, begin, end);
      } else if (C == 3) {
        read_range<T, 3>(P, F, V, g, n, block, begin, end);
      } else {
        read_range<T, 0>(P, F, V, g, n, block, begin, end);
      }
    };
    shard(ctx, nb * n, 40 * C, work);
  }

 private:
  i64 halo_;
  bool into_;
};

// The position gradient of one particle (stencil ax, ay, az) from its block's field fb:
// gp[a] = sum_C d[C] sum_c dK_c/dx_a field[c, C] (d = nullptr: unit dvalues); KC as in
// read_range. With s_ijk = sum_C d[C] field[corner ijk, C] and the weights (w0, w1) =
// (1 - f, f) per axis (d w0 / dx = -1, d w1 / dx = 1):
//   gx = sum_ij (wy_j [+-]_i) (wz . s_ij),  gy = sum_ij (wx_i [+-]_j) (wz . s_ij),
//   gz = sum_ij wx_i wy_j (s_ij1 - s_ij0),
// the z sums shared by gx and gy: 40 multiply-adds per particle instead of 80.
template <typename T, int KC>
inline void position_gradient(const Axis<T>& ax, const Axis<T>& ay, const Axis<T>& az,
                              const T* __restrict__ fb, const T* __restrict__ d,
                              const Geometry& g, T* __restrict__ gp) {
  const i64 C = KC ? KC : g.comps;
  T zs[2][2], zd[2][2];  // per (i, j): wz . s_ij and s_ij1 - s_ij0
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const T* cell = fb + (ax.i[i] * g.py + ay.i[j]) * g.nz * C;
      T sk[2];
      for (int k = 0; k < 2; ++k) {
        const T* src = cell + az.i[k] * C;
        T acc = 0;
        if (d) {
          for (i64 c = 0; c < C; ++c) acc += d[c] * src[c];
        } else {
          for (i64 c = 0; c < C; ++c) acc += src[c];
        }
        sk[k] = acc;
      }
      zs[i][j] = az.w[0] * sk[0] + az.w[1] * sk[1];
      zd[i][j] = sk[1] - sk[0];
    }
  gp[0] = (ay.w[0] * zs[1][0] + ay.w[1] * zs[1][1]) - (ay.w[0] * zs[0][0] + ay.w[1] * zs[0][1]);
  gp[1] = ax.w[0] * (zs[0][1] - zs[0][0]) + ax.w[1] * (zs[1][1] - zs[1][0]);
  gp[2] = ax.w[0] * (ay.w[0] * zd[0][0] + ay.w[1] * zd[0][1]) +
          ax.w[1] * (ay.w[0] * zd[1][0] + ay.w[1] * zd[1][1]);
}

// d readout / d positions of particles [begin, end) (position_gradient).
template <typename T, int KC>
void grad_pos_range(const T* __restrict__ P, const T* __restrict__ F, const T* __restrict__ D,
                    T* __restrict__ G, const Geometry& g, i64 n, i64 block, i64 begin,
                    i64 end) {
  const i64 C = KC ? KC : g.comps;
  i64 b = begin / n, next = (b + 1) * n;  // as in read_range
  for (i64 u = begin; u < end; ++u) {
    if (u == next) ++b, next += n;
    const T* q = P + 3 * u;
    T* gp = G + 3 * u;
    gp[0] = gp[1] = gp[2] = T(0);
    if (!finite3(q)) continue;
    Axis<T> ax, ay, az;
    stencil(q, g, &ax, &ay, &az);
    position_gradient<T, KC>(ax, ay, az, F + b * block, D ? D + u * C : nullptr, g, gp);
  }
}

// ------------------------------------------------------------------ d readout / d positions
template <typename T>
class CicReadoutGradPosOp : public OpKernel {
 public:
  explicit CicReadoutGradPosOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("halo", &v));
    halo_ = v;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& field = ctx->input(0);
    const Tensor& pos = ctx->input(1);
    const Tensor& dv = ctx->input(2);
    OP_REQUIRES_OK(ctx, check_positions(pos));
    OP_REQUIRES_OK(ctx, check_field(field, pos, halo_));
    const i64 nb = pos.dim_size(0), n = pos.dim_size(1), C = field.dim_size(4);
    OP_REQUIRES_OK(ctx, check_per_particle(dv, pos, C, "dvalues"));
    Geometry g{field.dim_size(1), field.dim_size(2), field.dim_size(3), C, halo_};
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, pos.shape(), &out));
    const T* P = pos.flat<T>().data();
    const T* F = field.flat<T>().data();
    const T* D = dv.NumElements() ? dv.flat<T>().data() : nullptr;
    T* G = out->flat<T>().data();
    const i64 block = g.px * g.py * g.nz * C;
    auto work = [&](i64 begin, i64 end) {
      if (C == 1) {
        grad_pos_range<T, 1>(P, F, D, G, g, n, block, begin, end);
      } else if (C == 3) {
        grad_pos_range<T, 3>(P, F, D, G, g, n, block, begin, end);
      } else {
        grad_pos_range<T, 0>(P, F, D, G, g, n, block, begin, end);
      }
    };
    shard(ctx, nb * n, 60 * C, work);
  }

 private:
  i64 halo_;
};

// ------------------------------------------------------------------ readout gradient, fused
// Both gradients of FlowpmCicReadout in one pass over the particles: the field's
// (the paint of the dvalues, exactly paint_slab<T, KC, true>'s terms in its order)
// and the positions' (exactly grad_pos_range's), sharing each particle's stencil.
// Parallel over slabs of the padded x rows as the paint; a particle's position
// gradient is computed by the slab that holds its first x row ax.i[0].
template <typename T, int KC>
void readout_grad_slab(const T* __restrict__ pb, const T* __restrict__ db,
                       const T* __restrict__ fb, T* __restrict__ dfb, T* __restrict__ gpb,
                       const Geometry& g, i64 n, i64 r0, i64 r1) {
  const i64 C = KC ? KC : g.comps;
  for (i64 p = 0; p < n; ++p) {
    const T* q = pb + 3 * p;
    T* gp = gpb + 3 * p;
    if (!finite3(q)) {
      if (r0 == 0) gp[0] = gp[1] = gp[2] = T(0);
      continue;
    }
    Axis<T> ax, ay, az;
    clipped_axis(q[0], g.halo, g.px, &ax);
    const bool in0 = ax.i[0] >= r0 && ax.i[0] < r1, in1 = ax.i[1] >= r0 && ax.i[1] < r1;
    if (!in0 && !in1) continue;
    clipped_axis(q[1], g.halo, g.py, &ay);
    periodic_axis(q[2], g.nz, &az);
    const T* d = db + p * C;
    deposit<T, KC, true>(ax, ay, az, in0, in1, d, dfb, g);
    if (!in0) continue;  // the position gradient: the owner of ax.i[0] only
    position_gradient<T, KC>(ax, ay, az, fb, d, g, gp);
  }
}

template <typename T>
class CicReadoutGradOp : public OpKernel {
 public:
  explicit CicReadoutGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("halo", &v));
    halo_ = v;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& field = ctx->input(0);
    const Tensor& pos = ctx->input(1);
    const Tensor& dv = ctx->input(2);
    OP_REQUIRES_OK(ctx, check_positions(pos));
    OP_REQUIRES_OK(ctx, check_field(field, pos, halo_));
    const i64 nb = pos.dim_size(0), n = pos.dim_size(1), C = field.dim_size(4);
    OP_REQUIRES(ctx, dv.NumElements() > 0 || nb * n == 0,
                InvalidArgument("CIC readout gradient: dvalues must not be empty"));
    OP_REQUIRES_OK(ctx, check_per_particle(dv, pos, C, "dvalues"));
    const Geometry g{field.dim_size(1), field.dim_size(2), field.dim_size(3), C, halo_};
    Tensor* dfield = nullptr;
    Tensor* dpos = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, field.shape(), &dfield));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, pos.shape(), &dpos));
    const T* P = pos.flat<T>().data();
    const T* F = field.flat<T>().data();
    const T* D = dv.NumElements() ? dv.flat<T>().data() : nullptr;
    T* DF = dfield->flat<T>().data();
    T* G = dpos->flat<T>().data();
    const i64 row = g.py * g.nz * C;
    std::memset(DF, 0, sizeof(T) * nb * g.px * row);
    if (nb * n == 0) return;
    for_slabs(ctx, nb, n, g.px, [&](i64 b, i64 r0, i64 r1) {
      const i64 off = b * g.px * row;
      if (C == 3)
        readout_grad_slab<T, 3>(P + b * n * 3, D + b * n * C, F + off, DF + off,
                                G + b * n * 3, g, n, r0, r1);
      else
        readout_grad_slab<T, 0>(P + b * n * 3, D + b * n * C, F + off, DF + off,
                                G + b * n * 3, g, n, r0, r1);
    });
  }

 private:
  i64 halo_;
};

// ------------------------------------------------------------------ scaled readout and its VJP
// Most components FlowpmCicReadoutVjp handles (the cotangents' products live on the stack).
constexpr i64 kMaxVjpComps = 8;

// The inputs of the ops that take scaled cotangents (FlowpmCicReadoutVjp,
// FlowpmCicReadoutScaledGrad, FlowpmCicPaintPair): cotangents [B, n, C], weights
// [B, n] or empty, a scalar scale.
::tensorflow::Status check_vjp_inputs(const Tensor& pos, const Tensor& cot, const Tensor& w,
                                      const Tensor& scale, i64 C) {
  const i64 nb = pos.dim_size(0), n = pos.dim_size(1);
  if (C > kMaxVjpComps)
    return InvalidArgument("CIC VJP: at most ", kMaxVjpComps, " components, got ", C);
  if (cot.NumElements() == 0 && nb * n > 0)
    return InvalidArgument("CIC VJP: cotangents must not be empty");
  TF_RETURN_IF_ERROR(check_per_particle(cot, pos, C, "cotangents"));
  if (w.NumElements() != 0 && !(w.dims() == 2 && w.dim_size(0) == nb && w.dim_size(1) == n))
    return InvalidArgument("CIC VJP: weights must be [", nb, ", ", n, "] or empty, got ",
                           w.shape().DebugString());
  if (scale.NumElements() != 1)
    return InvalidArgument("CIC VJP: scale must be a scalar, got ", scale.shape().DebugString());
  return ::tensorflow::OkStatus();
}

// The first five inputs of FlowpmCicReadoutVjp and FlowpmCicReadoutScaledGrad (field,
// positions, cotangents, weights, scale), checked, with the attr halo.
template <typename T>
class ScaledReadoutKernel : public OpKernel {
 public:
  explicit ScaledReadoutKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("halo", &v));
    halo_ = v;
  }

 protected:
  struct Inputs {
    const Tensor *field, *pos;
    const T *P, *F, *D, *W;  // D, W: nullptr when empty
    T s;
    i64 nb, n, C;
    Geometry g;
  };

  ::tensorflow::Status read(OpKernelContext* ctx, Inputs* in) const {
    const Tensor& field = ctx->input(0);
    const Tensor& pos = ctx->input(1);
    const Tensor& cot = ctx->input(2);
    const Tensor& w = ctx->input(3);
    const Tensor& scale = ctx->input(4);
    TF_RETURN_IF_ERROR(check_positions(pos));
    TF_RETURN_IF_ERROR(check_field(field, pos, halo_));
    in->nb = pos.dim_size(0);
    in->n = pos.dim_size(1);
    in->C = field.dim_size(4);
    TF_RETURN_IF_ERROR(check_vjp_inputs(pos, cot, w, scale, in->C));
    in->field = &field;
    in->pos = &pos;
    in->g = Geometry{field.dim_size(1), field.dim_size(2), field.dim_size(3), in->C, halo_};
    in->P = pos.flat<T>().data();
    in->F = field.flat<T>().data();
    in->D = cot.NumElements() ? cot.flat<T>().data() : nullptr;
    in->W = w.NumElements() ? w.flat<T>().data() : nullptr;
    in->s = scale.flat<T>()(0);
    return ::tensorflow::OkStatus();
  }

  i64 halo_;
};

// The readout of one particle from its block's field fb, exactly read_range's sum.
template <typename T, int KC>
inline void read_one(const Axis<T>& ax, const Axis<T>& ay, const Axis<T>& az,
                     const T* __restrict__ fb, const Geometry& g, T* __restrict__ v) {
  const i64 C = KC ? KC : g.comps;
  for (i64 c = 0; c < C; ++c) v[c] = T(0);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const T wxy = ax.w[i] * ay.w[j];
      const T* cell = fb + (ax.i[i] * g.py + ay.i[j]) * g.nz * C;
      for (int k = 0; k < 2; ++k) {
        const T kern = wxy * az.w[k];
        const T* src = cell + az.i[k] * C;
        for (i64 c = 0; c < C; ++c) v[c] += kern * src[c];
      }
    }
}

// The readout's cotangents as FlowpmCicReadoutVjp scales them, in the order of the
// Mesh TF graph: d = (cot * w) * scale.
template <typename T, int KC>
inline void scaled_cotangents(const T* __restrict__ ct, const T* __restrict__ wb, i64 p, T s,
                              const Geometry& g, T* __restrict__ d) {
  const i64 C = KC ? KC : g.comps;
  for (i64 c = 0; c < C; ++c) d[c] = wb ? (ct[c] * wb[p]) * s : ct[c] * s;
}

// One particle's scaled readout v = (R * scale) * w and position gradient for the
// scaled cotangents d (FlowpmCicReadoutVjp and FlowpmCicReadoutScaledGrad).
template <typename T, int KC>
inline void values_and_gradient(const Axis<T>& ax, const Axis<T>& ay, const Axis<T>& az,
                                const T* __restrict__ fb, const T* __restrict__ d,
                                const T* __restrict__ wb, i64 p, T s, const Geometry& g,
                                T* __restrict__ v, T* __restrict__ gp) {
  const i64 C = KC ? KC : g.comps;
  position_gradient<T, KC>(ax, ay, az, fb, d, g, gp);
  read_one<T, KC>(ax, ay, az, fb, g, v);
  for (i64 c = 0; c < C; ++c) v[c] = wb ? (v[c] * s) * wb[p] : v[c] * s;
}

// One slab of FlowpmCicReadoutVjp (as readout_grad_slab: the paint of d into the
// slab's rows; the values and the position gradient by the owner of ax.i[0]).
template <typename T, int KC>
void readout_vjp_slab(const T* __restrict__ pb, const T* __restrict__ cb,
                      const T* __restrict__ wb, T s, const T* __restrict__ fb,
                      T* __restrict__ dfb, T* __restrict__ gpb, T* __restrict__ vb,
                      const Geometry& g, i64 n, i64 r0, i64 r1) {
  const i64 C = KC ? KC : g.comps;
  T d[kMaxVjpComps];
  for (i64 p = 0; p < n; ++p) {
    const T* q = pb + 3 * p;
    T* gp = gpb + 3 * p;
    T* v = vb + p * C;
    if (!finite3(q)) {
      if (r0 == 0) {
        gp[0] = gp[1] = gp[2] = T(0);
        for (i64 c = 0; c < C; ++c) v[c] = T(0);
      }
      continue;
    }
    Axis<T> ax, ay, az;
    clipped_axis(q[0], g.halo, g.px, &ax);
    const bool in0 = ax.i[0] >= r0 && ax.i[0] < r1, in1 = ax.i[1] >= r0 && ax.i[1] < r1;
    if (!in0 && !in1) continue;
    clipped_axis(q[1], g.halo, g.py, &ay);
    periodic_axis(q[2], g.nz, &az);
    scaled_cotangents<T, KC>(cb + p * C, wb, p, s, g, d);
    deposit<T, KC, true>(ax, ay, az, in0, in1, d, dfb, g);
    if (!in0) continue;
    values_and_gradient<T, KC>(ax, ay, az, fb, d, wb, p, s, g, v, gp);
  }
}

template <typename T>
class CicReadoutVjpOp : public ScaledReadoutKernel<T> {
 public:
  using ScaledReadoutKernel<T>::ScaledReadoutKernel;

  void Compute(OpKernelContext* ctx) override {
    typename ScaledReadoutKernel<T>::Inputs in;
    OP_REQUIRES_OK(ctx, this->read(ctx, &in));
    const i64 nb = in.nb, n = in.n, C = in.C;
    const Geometry& g = in.g;
    Tensor* values = nullptr;
    Tensor* dfield = nullptr;
    Tensor* dpos = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, n, C}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, in.field->shape(), &dfield));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, in.pos->shape(), &dpos));
    const T *P = in.P, *F = in.F, *D = in.D, *W = in.W;
    const T s = in.s;
    T* V = values->flat<T>().data();
    T* DF = dfield->flat<T>().data();
    T* G = dpos->flat<T>().data();
    const i64 row = g.py * g.nz * C;
    std::memset(DF, 0, sizeof(T) * nb * g.px * row);
    if (nb * n == 0) return;
    for_slabs(ctx, nb, n, g.px, [&](i64 b, i64 r0, i64 r1) {
      const i64 off = b * g.px * row;
      const T* wb = W ? W + b * n : nullptr;
      if (C == 3)
        readout_vjp_slab<T, 3>(P + b * n * 3, D + b * n * C, wb, s, F + off, DF + off,
                               G + b * n * 3, V + b * n * C, g, n, r0, r1);
      else
        readout_vjp_slab<T, 0>(P + b * n * 3, D + b * n * C, wb, s, F + off, DF + off,
                               G + b * n * 3, V + b * n * C, g, n, r0, r1);
    });
  }
};

// ------------------------------------------------------------------ the VJP split in two passes
// FlowpmCicReadoutScaledGrad: FlowpmCicReadoutVjp's values and position gradient
// without its paint, parallel over particles (no slab scans): the same terms in the
// same order per particle, so bit for bit its values and dpositions. With a density
// cotangent rb (the padded blocks of the paint's upstream gradient, margins
// filled), the paint's position gradient FlowpmCicReadoutGradPos(rb, positions, w)
// is added to dpositions, from the same stencil (each term bit for bit that op's).
template <typename T, int KC>
void scaled_grad_range(const T* __restrict__ P, const T* __restrict__ F, const T* __restrict__ D,
                       const T* __restrict__ W, T s, const T* __restrict__ RB,
                       T* __restrict__ V, T* __restrict__ G, const Geometry& g, i64 n,
                       i64 begin, i64 end) {
  const i64 C = KC ? KC : g.comps;
  const i64 cells = g.px * g.py * g.nz;
  Geometry g1 = g;
  g1.comps = 1;
  T d[kMaxVjpComps];
  i64 b = begin / n, next = (b + 1) * n;  // as in read_range
  for (i64 u = begin; u < end; ++u) {
    if (u == next) ++b, next += n;
    const T* q = P + 3 * u;
    T* gp = G + 3 * u;
    T* v = V + u * C;
    if (!finite3(q)) {
      gp[0] = gp[1] = gp[2] = T(0);
      for (i64 c = 0; c < C; ++c) v[c] = T(0);
      continue;
    }
    Axis<T> ax, ay, az;
    stencil(q, g, &ax, &ay, &az);
    scaled_cotangents<T, KC>(D + u * C, W, u, s, g, d);  // W is [B, n]: slot u
    values_and_gradient<T, KC>(ax, ay, az, F + b * cells * C, d, W, u, s, g, v, gp);
    if (RB) {
      T gr[3];
      position_gradient<T, 1>(ax, ay, az, RB + b * cells, W ? W + u : nullptr, g1, gr);
      for (int a = 0; a < 3; ++a) gp[a] = gp[a] + gr[a];
    }
  }
}

template <typename T>
class CicReadoutScaledGradOp : public ScaledReadoutKernel<T> {
 public:
  using ScaledReadoutKernel<T>::ScaledReadoutKernel;

  void Compute(OpKernelContext* ctx) override {
    typename ScaledReadoutKernel<T>::Inputs in;
    OP_REQUIRES_OK(ctx, this->read(ctx, &in));
    const Tensor& rbar = ctx->input(5);
    const i64 nb = in.nb, n = in.n, C = in.C;
    const Geometry& g = in.g;
    const Tensor& field = *in.field;
    OP_REQUIRES(ctx, rbar.NumElements() == 0 ||
                (rbar.dims() == 5 && rbar.dim_size(0) == nb &&
                 rbar.dim_size(1) == field.dim_size(1) && rbar.dim_size(2) == field.dim_size(2) &&
                 rbar.dim_size(3) == field.dim_size(3) && rbar.dim_size(4) == 1),
                InvalidArgument("CIC readout scaled gradient: density_bar must be [", nb, ", ",
                                field.dim_size(1), ", ", field.dim_size(2), ", ",
                                field.dim_size(3), ", 1] or empty, got ",
                                rbar.shape().DebugString()));
    Tensor* values = nullptr;
    Tensor* dpos = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, n, C}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, in.pos->shape(), &dpos));
    if (nb * n == 0) return;
    const T *P = in.P, *F = in.F, *D = in.D, *W = in.W;
    const T* RB = rbar.NumElements() ? rbar.flat<T>().data() : nullptr;
    const T s = in.s;
    T* V = values->flat<T>().data();
    T* G = dpos->flat<T>().data();
    shard(ctx, nb * n, 100 * C, [&](i64 begin, i64 end) {
      if (C == 3)
        scaled_grad_range<T, 3>(P, F, D, W, s, RB, V, G, g, n, begin, end);
      else
        scaled_grad_range<T, 0>(P, F, D, W, s, RB, V, G, g, n, begin, end);
    });
  }
};

// FlowpmCicPaintPair: FlowpmCicReadoutVjp's paint of the scaled cotangents d, known
// before the force (the adjoint's reverse step), together with the density paint
// of the same particles (FlowpmCicPaint with the weights w): one slab scan for both,
// each field's terms exactly those of the op it replaces, in the same order.
template <typename T, int KC>
void paint_pair_slab(const T* __restrict__ pb, const T* __restrict__ cb,
                     const T* __restrict__ wb, T s, T* __restrict__ rhob, T* __restrict__ dfb,
                     const Geometry& g, i64 n, i64 r0, i64 r1) {
  const i64 C = KC ? KC : g.comps;
  T d[kMaxVjpComps];
  for (i64 p = 0; p < n; ++p) {
    const T* q = pb + 3 * p;
    if (!finite3(q)) continue;
    Axis<T> ax, ay, az;
    clipped_axis(q[0], g.halo, g.px, &ax);
    const bool in0 = ax.i[0] >= r0 && ax.i[0] < r1, in1 = ax.i[1] >= r0 && ax.i[1] < r1;
    if (!in0 && !in1) continue;
    clipped_axis(q[1], g.halo, g.py, &ay);
    periodic_axis(q[2], g.nz, &az);
    if (wb)
      deposit<T, 1, true>(ax, ay, az, in0, in1, wb + p, rhob, g);
    else
      deposit<T, 1, false>(ax, ay, az, in0, in1, nullptr, rhob, g);
    scaled_cotangents<T, KC>(cb + p * C, wb, p, s, g, d);
    deposit<T, KC, true>(ax, ay, az, in0, in1, d, dfb, g);
  }
}

template <typename T>
class CicPaintPairOp : public OpKernel {
 public:
  explicit CicPaintPairOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("halo", &v));
    g_.halo = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("px", &v));
    g_.px = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("py", &v));
    g_.py = v;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("nz", &v));
    g_.nz = v;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& pos = ctx->input(0);
    const Tensor& cot = ctx->input(1);
    const Tensor& w = ctx->input(2);
    const Tensor& scale = ctx->input(3);
    OP_REQUIRES_OK(ctx, check_positions(pos));
    OP_REQUIRES(ctx, cot.dims() == 3,
                InvalidArgument("CIC paint pair: cotangents must be [blocks, n, components], got ",
                                cot.shape().DebugString()));
    const i64 nb = pos.dim_size(0), n = pos.dim_size(1), C = cot.dim_size(2);
    OP_REQUIRES(ctx, C >= 1, InvalidArgument("CIC paint pair: no cotangent components"));
    OP_REQUIRES_OK(ctx, check_vjp_inputs(pos, cot, w, scale, C));
    Geometry g = g_;
    g.comps = C;
    Tensor* rho = nullptr;
    Tensor* dfield = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, g.px, g.py, g.nz, 1}), &rho));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nb, g.px, g.py, g.nz, C}), &dfield));
    const i64 cells = g.px * g.py * g.nz;
    T* R = rho->flat<T>().data();
    T* DF = dfield->flat<T>().data();
    std::memset(R, 0, sizeof(T) * nb * cells);
    std::memset(DF, 0, sizeof(T) * nb * cells * C);
    if (nb * n == 0) return;
    const T* P = pos.flat<T>().data();
    const T* D = cot.flat<T>().data();
    const T* W = w.NumElements() ? w.flat<T>().data() : nullptr;
    const T s = scale.flat<T>()(0);
    for_slabs(ctx, nb, n, g.px, [&](i64 b, i64 r0, i64 r1) {
      const T* wb = W ? W + b * n : nullptr;
      if (C == 3)
        paint_pair_slab<T, 3>(P + b * n * 3, D + b * n * C, wb, s, R + b * cells,
                              DF + b * cells * C, g, n, r0, r1);
      else
        paint_pair_slab<T, 0>(P + b * n * 3, D + b * n * C, wb, s, R + b * cells,
                              DF + b * cells * C, g, n, r0, r1);
    });
  }

 private:
  Geometry g_{};
};

// ------------------------------------------------------------------ escape count
template <typename T>
class CicEscapedOp : public OpKernel {
 public:
  explicit CicEscapedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, read_block_box(ctx, &box_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& pos = ctx->input(0);
    OP_REQUIRES_OK(ctx, check_positions(pos));
    const i64 nb = pos.dim_size(0), n = pos.dim_size(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb}), &out));
    const T* P = pos.flat<T>().data();
    auto O = out->flat<int32_t>();
    const StencilFits<T> fits(box_);
    std::vector<std::atomic<int64_t>> counts(nb);
    for (auto& c : counts) c = 0;
    // Block by block within [begin, end): no integer division per particle (it
    // cost 12 ns a particle on one thread at 512^3, ten times the test itself).
    auto work = [&](int64_t begin, int64_t end) {
      if (begin >= end) return;  // (no particles: n may be 0)
      for (i64 b = begin / n, i = begin; i < end; ++b) {
        const i64 stop = std::min<i64>(end, (b + 1) * n);
        int64_t count = 0;
        for (; i < stop; ++i) count += !fits(P + 3 * i);
        counts[b] += count;
      }
    };
    shard(ctx, nb * n, 12, work);
    for (i64 b = 0; b < nb; ++b)
      O(b) = static_cast<int32_t>(std::min<int64_t>(counts[b].load(), INT32_MAX));
  }

 private:
  BlockBox box_;
};

// ------------------------------------------------------------------ interleave
// FlowpmInterleave(inputs: N tensors [..., w_i] with the same leading shape, picks:
// 2K ints (input, column), wrap >= 0) -> [..., K], the first two axes padded
// periodically by `wrap` on both sides; parallel over output rows.
template <typename T>
class InterleaveOp : public OpKernel {
 public:
  explicit InterleaveOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("picks", &picks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wrap", &wrap_));
    OP_REQUIRES(ctx, !picks_.empty() && picks_.size() % 2 == 0,
                InvalidArgument("FlowpmInterleave: picks must hold (input, column) pairs"));
    OP_REQUIRES(ctx, wrap_ >= 0, InvalidArgument("FlowpmInterleave: wrap must be >= 0"));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList ins;
    OP_REQUIRES_OK(ctx, ctx->input_list("inputs", &ins));
    const int n_in = ins.size();
    const TensorShape& s0 = ins[0].shape();
    const int lead = wrap_ > 0 ? 2 : 0;  // the wrapped axes
    OP_REQUIRES(ctx, s0.dims() >= 1 + lead,
                InvalidArgument("FlowpmInterleave: inputs need rank >= ", 1 + lead));
    const i64 rows = s0.num_elements() / std::max<i64>(1, s0.dim_size(s0.dims() - 1));
    std::vector<const T*> src(n_in);
    std::vector<i64> width(n_in);
    for (int i = 0; i < n_in; ++i) {
      const TensorShape& s = ins[i].shape();
      bool same = s.dims() == s0.dims();
      for (int d = 0; same && d + 1 < s.dims(); ++d) same = s.dim_size(d) == s0.dim_size(d);
      OP_REQUIRES(ctx, same, InvalidArgument("FlowpmInterleave: inputs ", i, " and 0 differ "
                                             "before the last axis: ", s.DebugString(), " vs ",
                                             s0.DebugString()));
      src[i] = ins[i].flat<T>().data();
      width[i] = s.dim_size(s.dims() - 1);
    }
    const i64 K = picks_.size() / 2;
    std::vector<const T*> col(K);
    std::vector<i64> stride(K);
    for (i64 j = 0; j < K; ++j) {
      const int a = picks_[2 * j], c = picks_[2 * j + 1];
      OP_REQUIRES(ctx, a >= 0 && a < n_in && c >= 0 && c < width[a],
                  InvalidArgument("FlowpmInterleave: pick (", a, ", ", c, ") out of range"));
      col[j] = src[a] + c;
      stride[j] = width[a];
    }
    TensorShape os = s0;
    os.set_dim(os.dims() - 1, K);
    i64 a = 1, b = 1;
    if (lead) {
      a = s0.dim_size(0);
      b = s0.dim_size(1);
      OP_REQUIRES(ctx, a > 0 && b > 0, InvalidArgument("FlowpmInterleave: empty wrapped axis"));
      os.set_dim(0, a + 2 * wrap_);
      os.set_dim(1, b + 2 * wrap_);
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, os, &out));
    T* O = out->flat<T>().data();
    // rows of the output = (i, j) pairs of the wrapped axes x `inner` rows each
    const i64 inner = rows / (a * b);
    const i64 pa = a + 2 * wrap_, pb = b + 2 * wrap_;
    auto work = [&](int64_t begin, int64_t end) {
      for (i64 ij = begin; ij < end; ++ij) {
        const i64 i = ij / pb, j = ij % pb;
        const i64 si = ((i - wrap_) % a + a) % a, sj = ((j - wrap_) % b + b) % b;
        const i64 r0 = (si * b + sj) * inner;
        T* o = O + ij * inner * K;
        for (i64 r = 0; r < inner; ++r)
          for (i64 k = 0; k < K; ++k) o[r * K + k] = col[k][(r0 + r) * stride[k]];
      }
    };
    shard(ctx, pa * pb, 2 * K * inner, work);
  }

 private:
  std::vector<int> picks_;
  int wrap_;
};

// The gradient of FlowpmInterleave: out_i[s, t, r, c] = sum over the picks (i, c) = k
// and over the padded rows (s', t') that copy (s, t) of dy[s', t', r, k] (every
// image of the periodic margins, t' outer, s' inner, ascending).
template <typename T>
class InterleaveGradOp : public OpKernel {
 public:
  explicit InterleaveGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("picks", &picks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wrap", &wrap_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("widths", &widths_));
    OP_REQUIRES(ctx, !picks_.empty() && picks_.size() % 2 == 0,
                InvalidArgument("FlowpmInterleaveGrad: picks must hold (input, column) pairs"));
    OP_REQUIRES(ctx, wrap_ >= 0, InvalidArgument("FlowpmInterleaveGrad: wrap must be >= 0"));
    for (size_t k = 0; k < picks_.size(); k += 2)
      OP_REQUIRES(ctx, picks_[k] >= 0 && picks_[k] < static_cast<int>(widths_.size()) &&
                  picks_[k + 1] >= 0 && picks_[k + 1] < widths_[picks_[k]],
                  InvalidArgument("FlowpmInterleaveGrad: pick (", picks_[k], ", ",
                                  picks_[k + 1], ") out of range"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const i64 K = picks_.size() / 2;
    const int lead = wrap_ > 0 ? 2 : 0;
    OP_REQUIRES(ctx, dy.dims() >= 1 + lead && dy.dim_size(dy.dims() - 1) == K,
                InvalidArgument("FlowpmInterleaveGrad: dy must be [..., ", K, "] of rank >= ",
                                1 + lead, ", got ", dy.shape().DebugString()));
    i64 pa = 1, pb = 1, a = 1, b = 1;
    if (lead) {
      pa = dy.dim_size(0);
      pb = dy.dim_size(1);
      a = pa - 2 * wrap_;
      b = pb - 2 * wrap_;
      OP_REQUIRES(ctx, a > 0 && b > 0,
                  InvalidArgument("FlowpmInterleaveGrad: dy smaller than its margins"));
    }
    const i64 inner = dy.NumElements() / std::max<i64>(1, pa * pb * K);
    const int n_out = widths_.size();
    std::vector<T*> out(n_out);
    for (int i = 0; i < n_out; ++i) {
      TensorShape os = dy.shape();
      os.set_dim(os.dims() - 1, widths_[i]);
      if (lead) {
        os.set_dim(0, a);
        os.set_dim(1, b);
      }
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, os, &t));
      out[i] = t->flat<T>().data();
    }
    const T* Y = dy.flat<T>().data();
    auto images = [&](i64 s, i64 n, i64 p, i64* idx) {
      int m = 0;
      for (i64 q = (s + wrap_) % n; q < p; q += n) idx[m++] = q;  // s + wrap - k n >= 0
      return m;
    };
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<i64> ia(pa + 1), ib(pb + 1);
      for (i64 st = begin; st < end; ++st) {
        const i64 s = st / b, t = st % b;
        int ma = 1, mb = 1;
        ia[0] = s;
        ib[0] = t;
        if (lead) {
          ma = images(s, a, pa, ia.data());
          mb = images(t, b, pb, ib.data());
        }
        for (int i = 0; i < n_out; ++i)
          std::fill(out[i] + st * inner * widths_[i], out[i] + (st + 1) * inner * widths_[i], T(0));
        for (int jb = 0; jb < mb; ++jb)
          for (int ja = 0; ja < ma; ++ja) {
            const T* src = Y + (ia[ja] * pb + ib[jb]) * inner * K;
            for (i64 k = 0; k < K; ++k) {
              const int i = picks_[2 * k], c = picks_[2 * k + 1];
              const i64 w = widths_[i];
              T* o = out[i] + st * inner * w + c;
              for (i64 r = 0; r < inner; ++r) o[r * w] += src[r * K + k];
            }
          }
      }
    };
    shard(ctx, a * b, 2 * K * inner, work);
  }

 private:
  std::vector<int> picks_;
  std::vector<int> widths_;
  int wrap_;
};

// ------------------------------------------------------------------ four-point stencils
// z_neighbours (tf_op.h): the periodic z terms of FlowpmNegDivergence and FlowpmGradient.

// ------------------------------------------------------------------ divergence
// FlowpmNegDivergence (see the header): one pass, parallel over (block, x) rows; per cell
// the x, then y, then z terms, each (8 (g(+1) - g(-1)) - (g(+2) - g(-2))) * coeff.
template <typename T>
class NegDivergenceOp : public OpKernel {
 public:
  explicit NegDivergenceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("margin", &margin_));
    OP_REQUIRES(ctx, margin_ == 0 || margin_ >= 2 || margin_ == -2,
                InvalidArgument("FlowpmNegDivergence: margin must be 0 (periodic), >= 2 "
                                "(inside) or -2 (extended by zeros)"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& cf = ctx->input(1);
    OP_REQUIRES(ctx, g.dims() == 5 && g.dim_size(4) == 3,
                InvalidArgument("FlowpmNegDivergence: g must be [B, ax, ay, nz, 3], got ",
                                g.shape().DebugString()));
    OP_REQUIRES(ctx, cf.NumElements() == 3,
                InvalidArgument("FlowpmNegDivergence: coeffs must have 3 values"));
    const i64 nb = g.dim_size(0), ax = g.dim_size(1), ay = g.dim_size(2), nz = g.dim_size(3);
    const i64 m = margin_, sx = ax - 2 * m, sy = ay - 2 * m;
    OP_REQUIRES(ctx, sx > 0 && sy > 0 && nz > 0,
                InvalidArgument("FlowpmNegDivergence: g ", g.shape().DebugString(),
                                " is not larger than its margins ", m));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, sx, sy, nz}), &out));
    const T* G = g.flat<T>().data();
    T* O = out->flat<T>().data();
    const T c0 = cf.flat<T>()(0), c1 = cf.flat<T>()(1), c2 = cf.flat<T>()(2);
    // the index of cell i + o (o in -2..2) along an axis of n output cells (outside
    // the array with margin -2: -1, a column of zeros)
    auto nbr = [m](i64 i, i64 o, i64 n) {
      if (!m) return ((i + o) % n + n) % n;
      const i64 x = i + m + o;
      return (x < 0 || x >= n + 2 * m) ? i64(-1) : x;
    };
    const std::vector<T> zeros(m < 0 ? 3 * nz : 0, T(0));
    const std::vector<i64> zi = z_neighbours(nz);
    auto work = [&](int64_t begin, int64_t end) {
      for (i64 r = begin; r < end; ++r) {
        const i64 b = r / sx, i = r % sx;
        i64 xs[5];
        for (i64 o = -2; o <= 2; ++o) xs[o + 2] = nbr(i, o, sx);
        for (i64 j = 0; j < sy; ++j) {
          i64 ys[5];
          for (i64 o = -2; o <= 2; ++o) ys[o + 2] = nbr(j, o, sy);
          auto col = [&](i64 x, i64 y) {
            return (x < 0 || y < 0) ? zeros.data() : G + ((b * ax + x) * ay + y) * nz * 3;
          };
          const T *cm2 = col(xs[0], ys[2]), *cm1 = col(xs[1], ys[2]), *cp1 = col(xs[3], ys[2]),
                  *cp2 = col(xs[4], ys[2]);
          const T *dm2 = col(xs[2], ys[0]), *dm1 = col(xs[2], ys[1]), *dp1 = col(xs[2], ys[3]),
                  *dp2 = col(xs[2], ys[4]);
          const T* c0c = col(xs[2], ys[2]);
          T* o = O + ((b * sx + i) * sy + j) * nz;
          for (i64 k = 0; k < nz; ++k) {
            const i64* z = &zi[5 * k];
            const i64 k3 = 3 * k;
            const T tx = T(8) * (cp1[k3] - cm1[k3]) - (cp2[k3] - cm2[k3]);
            const T ty = T(8) * (dp1[k3 + 1] - dm1[k3 + 1]) - (dp2[k3 + 1] - dm2[k3 + 1]);
            const T tz = T(8) * (c0c[3 * z[3] + 2] - c0c[3 * z[1] + 2]) -
                         (c0c[3 * z[4] + 2] - c0c[3 * z[0] + 2]);
            o[k] = (c0 * tx + c1 * ty) + c2 * tz;
          }
        }
      }
    };
    shard(ctx, nb * sx, sy * nz * 40, work);
  }

 private:
  int margin_;
};

// ------------------------------------------------------------------ gradient
// FlowpmGradient (see the header): one pass, parallel over (block, x) rows; per cell the
// x, y and z components, each coeff * (8 (phi(+1) - phi(-1)) - (phi(+2) - phi(-2))),
// written interleaved ([..., nz, 3]) as the readout reads them.
template <typename T>
class GradientOp : public OpKernel {
 public:
  explicit GradientOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("margin", &margin_));
    OP_REQUIRES(ctx, margin_ >= 2 || margin_ <= 0,
                InvalidArgument("FlowpmGradient: margin must be >= 2 (inside the array) or "
                                "<= 0 (periodic, output margins -margin)"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& phi = ctx->input(0);
    const Tensor& cf = ctx->input(1);
    OP_REQUIRES(ctx, phi.dims() == 4,
                InvalidArgument("FlowpmGradient: phi must be [B, ax, ay, nz], got ",
                                phi.shape().DebugString()));
    OP_REQUIRES(ctx, cf.NumElements() == 3,
                InvalidArgument("FlowpmGradient: coeffs must have 3 values"));
    const i64 nb = phi.dim_size(0), ax = phi.dim_size(1), ay = phi.dim_size(2),
              nz = phi.dim_size(3);
    const i64 m = margin_, sx = ax - 2 * m, sy = ay - 2 * m;
    OP_REQUIRES(ctx, sx > 0 && sy > 0 && nz > 0,
                InvalidArgument("FlowpmGradient: phi ", phi.shape().DebugString(),
                                " is not larger than its margins ", m));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, sx, sy, nz, 3}), &out));
    const T* P = phi.flat<T>().data();
    T* O = out->flat<T>().data();
    const T cf3[3] = {cf.flat<T>()(0), cf.flat<T>()(1), cf.flat<T>()(2)};
    const std::vector<i64> zi = z_neighbours(nz);
    auto work = [&](int64_t begin, int64_t end) {
      for (i64 r = begin; r < end; ++r) {
        const i64 b = r / sx, i = r % sx;
        auto col = [&](i64 x, i64 y) { return P + ((b * ax + x) * ay + y) * nz; };
        // input index of output index i + o along an axis of n input cells (periodic: mod n)
        auto at = [m](i64 i, i64 o, i64 n) {
          const i64 x = i + m + o;
          return m > 0 ? x : (x % n + n) % n;
        };
        i64 xs[5];
        for (i64 o = -2; o <= 2; ++o) xs[o + 2] = at(i, o, ax);
        for (i64 j = 0; j < sy; ++j) {
          i64 ys[5];
          for (i64 o = -2; o <= 2; ++o) ys[o + 2] = at(j, o, ay);
          const T* xc[4] = {col(xs[0], ys[2]), col(xs[1], ys[2]), col(xs[3], ys[2]),
                            col(xs[4], ys[2])};
          const T* yc[4] = {col(xs[2], ys[0]), col(xs[2], ys[1]), col(xs[2], ys[3]),
                            col(xs[2], ys[4])};
          four_point_column<T>(xc, yc, col(xs[2], ys[2]), nz, cf3, zi,
                               O + ((b * sx + i) * sy + j) * nz * 3);
        }
      }
    };
    shard(ctx, nb * sx, sy * nz * 30, work);
  }

 private:
  int margin_;
};

// Dimensions 1 and 2 of s less margins m on either side (m < 0: more) for the shape
// functions of FlowpmGradient and FlowpmNegDivergence.
::tensorflow::Status without_margins(InferenceContext* c, ShapeHandle s, int m,
                                     DimensionHandle* sx, DimensionHandle* sy) {
  if (m >= 0) {
    TF_RETURN_IF_ERROR(c->Subtract(c->Dim(s, 1), 2 * m, sx));
    return c->Subtract(c->Dim(s, 2), 2 * m, sy);
  }
  TF_RETURN_IF_ERROR(c->Add(c->Dim(s, 1), -2 * m, sx));
  return c->Add(c->Dim(s, 2), -2 * m, sy);
}

}  // namespace


REGISTER_OP("FlowpmGradient")
    .Input("phi: T")
    .Input("coeffs: T")
    .Output("out: T")
    .Attr("T: {float, double}")
    .Attr("margin: int")
    .SetShapeFn([](InferenceContext* c) {
      int m;
      TF_RETURN_IF_ERROR(c->GetAttr("margin", &m));
      if (m == 1) return ::tensorflow::errors::InvalidArgument("FlowpmGradient: margin 1");
      ShapeHandle phi;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &phi));
      DimensionHandle sx, sy;
      TF_RETURN_IF_ERROR(without_margins(c, phi, m, &sx, &sy));
      c->set_output(0, c->MakeShape({c->Dim(phi, 0), sx, sy, c->Dim(phi, 3), c->MakeDim(3)}));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmNegDivergence")
    .Input("g: T")
    .Input("coeffs: T")
    .Output("out: T")
    .Attr("T: {float, double}")
    .Attr("margin: int >= -2")
    .SetShapeFn([](InferenceContext* c) {
      int m;
      TF_RETURN_IF_ERROR(c->GetAttr("margin", &m));
      ShapeHandle g;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 5, &g));
      DimensionHandle sx, sy;
      TF_RETURN_IF_ERROR(without_margins(c, g, m, &sx, &sy));
      c->set_output(0, c->MakeShape({c->Dim(g, 0), sx, sy, c->Dim(g, 3)}));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmInterleave")
    .Input("inputs: N * T")
    .Output("output: T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("picks: list(int)")
    .Attr("wrap: int = 0")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int> picks;
      int wrap;
      TF_RETURN_IF_ERROR(c->GetAttr("picks", &picks));
      TF_RETURN_IF_ERROR(c->GetAttr("wrap", &wrap));
      ShapeHandle s0 = c->input(0), out;
      if (!c->RankKnown(s0)) {
        c->set_output(0, c->UnknownShape());
        return ::tensorflow::OkStatus();
      }
      TF_RETURN_IF_ERROR(c->ReplaceDim(s0, -1, c->MakeDim(static_cast<int64_t>(picks.size() / 2)),
                                       &out));
      for (int d = 0; d < 2 && wrap > 0 && d + 1 < c->Rank(s0); ++d) {
        DimensionHandle padded;
        TF_RETURN_IF_ERROR(c->Add(c->Dim(s0, d), 2 * wrap, &padded));
        TF_RETURN_IF_ERROR(c->ReplaceDim(out, d, padded, &out));
      }
      c->set_output(0, out);
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmCicPaint")
    .Input("positions: T")
    .Input("weights: T")
    .Output("field: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .Attr("px: int >= 1")
    .Attr("py: int >= 1")
    .Attr("nz: int >= 1")
    .Attr("components: int >= 1 = 1")
    .SetShapeFn(paint_shape);

REGISTER_OP("FlowpmCicReadout")
    .Input("field: T")
    .Input("positions: T")
    .Output("values: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .SetShapeFn(readout_shape);

REGISTER_OP("FlowpmCicReadoutInto")
    .Input("field: T")
    .Input("positions: T")
    .Input("donor: T")
    .Output("values: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .SetShapeFn(readout_shape);

REGISTER_OP("FlowpmCicReadoutGradPos")
    .Input("field: T")
    .Input("positions: T")
    .Input("dvalues: T")
    .Output("dpositions: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .SetShapeFn(grad_pos_shape);

REGISTER_OP("FlowpmCicReadoutGrad")
    .Input("field: T")
    .Input("positions: T")
    .Input("dvalues: T")
    .Output("dfield: T")
    .Output("dpositions: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(1));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmInterleaveGrad")
    .Input("dy: T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("picks: list(int)")
    .Attr("wrap: int = 0")
    .Attr("widths: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int> widths;
      int wrap;
      TF_RETURN_IF_ERROR(c->GetAttr("widths", &widths));
      TF_RETURN_IF_ERROR(c->GetAttr("wrap", &wrap));
      ShapeHandle s0 = c->input(0);
      for (size_t i = 0; i < widths.size(); ++i) {
        if (!c->RankKnown(s0)) {
          c->set_output(i, c->UnknownShape());
          continue;
        }
        ShapeHandle out;
        TF_RETURN_IF_ERROR(c->ReplaceDim(s0, -1, c->MakeDim(static_cast<int64_t>(widths[i])),
                                         &out));
        for (int d = 0; d < 2 && wrap > 0 && d + 1 < c->Rank(s0); ++d) {
          DimensionHandle inner;
          TF_RETURN_IF_ERROR(c->Subtract(c->Dim(s0, d), 2 * wrap, &inner));
          TF_RETURN_IF_ERROR(c->ReplaceDim(out, d, inner, &out));
        }
        c->set_output(i, out);
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmCicReadoutVjp")
    .Input("field: T")
    .Input("positions: T")
    .Input("cotangents: T")
    .Input("weights: T")
    .Input("scale: T")
    .Output("values: T")
    .Output("dfield: T")
    .Output("dpositions: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle field, pos;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 5, &field));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &pos));
      c->set_output(0, c->MakeShape({c->Dim(pos, 0), c->Dim(pos, 1), c->Dim(field, 4)}));
      c->set_output(1, c->input(0));
      c->set_output(2, c->input(1));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmCicReadoutScaledGrad")
    .Input("field: T")
    .Input("positions: T")
    .Input("cotangents: T")
    .Input("weights: T")
    .Input("scale: T")
    .Input("density_bar: T")
    .Output("values: T")
    .Output("dpositions: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle field, pos;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 5, &field));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &pos));
      c->set_output(0, c->MakeShape({c->Dim(pos, 0), c->Dim(pos, 1), c->Dim(field, 4)}));
      c->set_output(1, c->input(1));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmCicPaintPair")
    .Input("positions: T")
    .Input("cotangents: T")
    .Input("weights: T")
    .Input("scale: T")
    .Output("density: T")
    .Output("dfield: T")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .Attr("px: int >= 1")
    .Attr("py: int >= 1")
    .Attr("nz: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int px, py, nz;
      TF_RETURN_IF_ERROR(c->GetAttr("px", &px));
      TF_RETURN_IF_ERROR(c->GetAttr("py", &py));
      TF_RETURN_IF_ERROR(c->GetAttr("nz", &nz));
      ShapeHandle pos, cot;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &pos));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &cot));
      c->set_output(0, c->MakeShape({c->Dim(pos, 0), px, py, nz, 1}));
      c->set_output(1, c->MakeShape({c->Dim(pos, 0), px, py, nz, c->Dim(cot, 2)}));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("FlowpmCicEscaped")
    .Input("positions: T")
    .Output("count: int32")
    .Attr("T: {float, double}")
    .Attr("halo: int >= 0")
    .Attr("sx: int >= 1")
    .Attr("sy: int >= 1")
    .SetShapeFn(escaped_shape);

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicPaint", CicPaintOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicReadout", CicReadoutOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicReadoutInto", CicReadoutOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicReadoutGradPos", CicReadoutGradPosOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicReadoutGrad", CicReadoutGradOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicEscaped", CicEscapedOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmInterleave", InterleaveOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmInterleaveGrad", InterleaveGradOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicReadoutVjp", CicReadoutVjpOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmNegDivergence", NegDivergenceOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmGradient", GradientOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicReadoutScaledGrad", CicReadoutScaledGradOp);
FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmCicPaintPair", CicPaintPairOp);
