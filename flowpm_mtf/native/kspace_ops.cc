// Real k-space kernels applied to a complex field in one pass, on the CPU.
//
// Ops (the Python side, gradients and TensorFlow twins included, is flowpm_mtf/kernels.py
// for the first, flowpm_mtf/ics.py for the second and flowpm_mtf/radial_filter.py for the
// third):
//
//   FlowpmInverseLaplace(field C [nx, ny, nz], kx R [nx], ky R [ny], kz R [nz]) -> C
//       out[i, j, k] = field[i, j, k] * s with kk = (kx[i] kx[i] + ky[j] ky[j]) + kz[k] kz[k]
//       and s = 1 / kk (0 where kk = 0): the products, sums and quotient of the TensorFlow
//       path (Square, AddV2, DivNoNan, Cast to complex, Mul) in the same order, each
//       rounded, no contraction. (a + ib) (s + 0i) = (a s - b 0) + i (a 0 + b s) is
//       (a s) + i (b s) to the last bit for finite values (up to the sign of a zero).
//   FlowpmRadialScale(field C [nx, ny, nz], table R [ux, uy, uz], ix int32 [nx],
//                     iy int32 [ny], iz int32 [nz]) -> C
//       out[i, j, k] = field[i, j, k] * table[ix[i], iy[j], iz[k]]: the three TensorFlow
//       gathers of a radial kernel (flowpm_mtf.physics.ics.radial_kernel), its cast to complex and
//       the product in one pass, bit for bit (the same argument).
//   FlowpmRadialScaleHalf(field C [nx, ly, h], table R [ux, uy, uz], ix int32 [nx],
//                         iy int32 [ly], iz int32 [2 h], firsts int32 [2]) -> C
//       The same product on the half spectrum of a real field (flowpm_mtf.mesh.fft.half_forward
//       without the extend, flowpm_mtf.mesh.radial_filter): kx and a ky block in mirror-pair
//       order, the representatives j of a kz block of 2 h positions (iz indexes that block:
//       slot j is position 2 j). out[i, j, k] = field[i, j, k] * table[ix[i], iy[j],
//       iz[2 k]], except in the first kz block (firsts[1]) slot 0, which packs the zero and
//       Nyquist planes as P = A + i B: there out = K0 (P + Pm) / 2 + Kn (P - Pm) / 2, with
//       Pm = conj(field[-kx, -ky, 0]) (the mirror row: FlowpmPairs' rule, firsts[0] for
//       the ky block) and K0, Kn the table at iz[0], iz[1]: i.e. K0 A + i Kn B, what
//       FlowpmPairs' extend, FlowpmRadialScale and FlowpmPairs' fold give, to the last bit.
//       In place, the packed slots of a row and its mirror are written by one thread from
//       both inputs. Its gradient with respect to the field is itself (a real symmetric
//       operator in the inner product of the full spectrum it represents).
//
// The table of the two radial ops is either the grid [ux, uy, uz] of the distinct (|kx|, |ky|,
// |kz|), indexed table[ix[i], iy[j], iz[k]], or (a cubic box) the 1-d table R [u] of the
// kernel at |k| = dk sqrt(n), indexed table[ix[i] + iy[j] + iz[k]] with the index vectors
// the squared mode numbers mx^2, my^2, mz^2 (flowpm_mtf.physics.ics._radial_numpy, summed=True):
// at 512^3 on one rank 0.79 MB built in ~5 ms instead of a 68 MB grid in ~0.1 s, every
// step of the force.
//
// The three write in the field's buffer when nothing else holds it, and never allocate a
// full-size kernel: the TensorFlow path made a real [nx, ny, nz] kernel, its complex copy
// and the product (three full-size passes and 2.5 field sizes of new memory; at 512^3 on
// one rank 0.27 + 0.54 GB, and 3.6 s of gathers in the ICs). Each is its own gradient
// with respect to the field (a real diagonal operator); the k vectors and the table are
// constants (no gradient).
//
// Threading: TensorFlow's intra-op pool over (i, j) rows; every value is computed by one
// thread from its own inputs, so the results do not depend on the thread count.
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <algorithm>
#include <complex>

#include "tf_op.h"

namespace {

using ::tensorflow::errors::InvalidArgument;

// The checks both ops share: a rank-3 field, the k-axis inputs of the given lengths.
::tensorflow::Status check_field(const char* op, const Tensor& field) {
  if (field.dims() != 3)
    return InvalidArgument(op, ": the field must be [nx, ny, nz], got ",
                           field.shape().DebugString());
  return ::tensorflow::OkStatus();
}

::tensorflow::Status check_axis(const char* op, const char* what, const Tensor& t, i64 n) {
  if (t.dims() != 1 || t.dim_size(0) != n)
    return InvalidArgument(op, ": ", what, " must be a vector of ", n, " entries, got ",
                           t.shape().DebugString());
  return ::tensorflow::OkStatus();
}

// The table (input 1) and its index vectors (inputs 2-4) of the radial ops: a rank-3 table
// and vectors of nx, ny, nz indices, every index inside the table, or a rank-1 table and
// vectors of non-negative terms whose largest sum is inside it (as in a gather; checked
// before any write).
::tensorflow::Status check_table(const char* op, OpKernelContext* ctx, i64 nx, i64 ny, i64 nz) {
  const Tensor& table = ctx->input(1);
  if (table.dims() != 3 && table.dims() != 1)
    return InvalidArgument(op, ": the table must be [ux, uy, uz] or [u] (summed indices), got ",
                           table.shape().DebugString());
  const bool summed = table.dims() == 1;
  const i64 lens[3] = {nx, ny, nz};
  const char* names[3] = {"ix", "iy", "iz"};
  i64 top = 0;
  for (int d = 0; d < 3; ++d) {
    TF_RETURN_IF_ERROR(check_axis(op, names[d], ctx->input(2 + d), lens[d]));
    const int32_t* idx = ctx->input(2 + d).flat<int32_t>().data();
    const i64 bound = table.dim_size(summed ? 0 : d);
    i64 largest = 0;
    for (i64 n = 0; n < lens[d]; ++n) {
      if (idx[n] < 0 || idx[n] >= bound)
        return InvalidArgument(op, ": index ", idx[n], " of axis ", d,
                               " is outside the table's ", bound, " entries");
      largest = std::max<i64>(largest, idx[n]);
    }
    top += largest;
  }
  if (summed && top >= table.dim_size(0))
    return InvalidArgument(op, ": summed indices reach ", top, ", outside the table's ",
                           table.dim_size(0), " entries");
  return ::tensorflow::OkStatus();
}

// The start of row (i, j) of a radial table: line(i, j)[iz[k]] is the kernel at (i, j, k),
// table[ix[i], iy[j], iz[k]] for a grid, table[ix[i] + iy[j] + iz[k]] for a 1-d table.
template <typename R>
struct TableRows {
  TableRows(OpKernelContext* ctx, const Tensor& table)
      : tab(table.flat<R>().data()),
        summed(table.dims() == 1),
        uy(summed ? 0 : table.dim_size(1)),
        uz(summed ? 0 : table.dim_size(2)),
        ix(ctx->input(2).flat<int32_t>().data()),
        iy(ctx->input(3).flat<int32_t>().data()) {}
  const R* operator()(i64 i, i64 j) const {
    return summed ? tab + (static_cast<i64>(ix[i]) + iy[j])
                  : tab + (static_cast<i64>(ix[i]) * uy + iy[j]) * uz;
  }
  const R* tab;
  bool summed;
  i64 uy, uz;
  const int32_t* ix;
  const int32_t* iy;
};

// out = field * s(i, j, k) for a real s, cell by cell, in the field's memory when nothing
// else holds it; parallel over (i, j) rows. row(i, j) returns the functor k -> s of a row.
template <typename R, typename Row>
void scale_field(OpKernelContext* ctx, const Tensor& field, i64 cost, Row row) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, field.shape(), &out));
  if (field.NumElements() == 0) return;
  const i64 ny = field.dim_size(1), nz = field.dim_size(2);
  const R* f = reinterpret_cast<const R*>(field.flat<std::complex<R>>().data());
  R* o = reinterpret_cast<R*>(out->flat<std::complex<R>>().data());
  shard(ctx, field.dim_size(0) * ny, cost * nz, [=](i64 r0, i64 r1) {
    for (i64 r = r0; r < r1; ++r) {
      const auto scale = row(r / ny, r % ny);
      const R* a = f + 2 * r * nz;  // may be b (in place): elementwise
      R* b = o + 2 * r * nz;
      for (i64 k = 0; k < nz; ++k) {
        const R v = scale(k);
        b[2 * k] = a[2 * k] * v;
        b[2 * k + 1] = a[2 * k + 1] * v;
      }
    }
  });
}

template <typename R>
class InverseLaplaceOp : public OpKernel {
 public:
  explicit InverseLaplaceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const char* op = "FlowpmInverseLaplace";
    const Tensor& field = ctx->input(0);
    OP_REQUIRES_OK(ctx, check_field(op, field));
    const i64 nx = field.dim_size(0), ny = field.dim_size(1), nz = field.dim_size(2);
    OP_REQUIRES_OK(ctx, check_axis(op, "kx", ctx->input(1), nx));
    OP_REQUIRES_OK(ctx, check_axis(op, "ky", ctx->input(2), ny));
    OP_REQUIRES_OK(ctx, check_axis(op, "kz", ctx->input(3), nz));
    const R* kx = ctx->input(1).flat<R>().data();
    const R* ky = ctx->input(2).flat<R>().data();
    const R* kz = ctx->input(3).flat<R>().data();
    scale_field<R>(ctx, field, 6, [=](i64 i, i64 j) {
      const R kxy = kx[i] * kx[i] + ky[j] * ky[j];
      return [=](i64 k) {
        const R kk = kxy + kz[k] * kz[k];
        return kk == R(0) ? R(0) : R(1) / kk;
      };
    });
  }
};

template <typename R>
class RadialScaleOp : public OpKernel {
 public:
  explicit RadialScaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const char* op = "FlowpmRadialScale";
    const Tensor& field = ctx->input(0);
    const Tensor& table = ctx->input(1);
    OP_REQUIRES_OK(ctx, check_field(op, field));
    const i64 nx = field.dim_size(0), ny = field.dim_size(1), nz = field.dim_size(2);
    OP_REQUIRES_OK(ctx, check_table(op, ctx, nx, ny, nz));
    const int32_t* iz = ctx->input(4).flat<int32_t>().data();
    const TableRows<R> rows(ctx, table);
    scale_field<R>(ctx, field, 4, [=](i64 i, i64 j) {
      const R* line = rows(i, j);
      return [=](i64 k) { return line[iz[k]]; };
    });
  }
};

// The half-spectrum product (see the header): one thread per (i, j) row; the packed slot
// of a row and of its mirror row by the thread of the smaller of the two.
template <typename R>
class RadialScaleHalfOp : public OpKernel {
 public:
  explicit RadialScaleHalfOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    typedef std::complex<R> Cx;
    const char* op = "FlowpmRadialScaleHalf";
    const Tensor& field = ctx->input(0);
    const Tensor& table = ctx->input(1);
    const Tensor& firsts = ctx->input(5);
    OP_REQUIRES_OK(ctx, check_field(op, field));
    OP_REQUIRES(ctx, firsts.NumElements() == 2,
                InvalidArgument(op, ": firsts must hold 2 values"));
    const i64 nx = field.dim_size(0), ly = field.dim_size(1), h = field.dim_size(2);
    OP_REQUIRES(ctx, nx % 2 == 0 && ly % 2 == 0,
                InvalidArgument(op, ": the kx and ky extents must be even, got ", nx, ", ", ly));
    OP_REQUIRES_OK(ctx, check_table(op, ctx, nx, ly, 2 * h));
    const int32_t* iz = ctx->input(4).flat<int32_t>().data();
    const TableRows<R> line(ctx, table);
    const auto f = firsts.flat<int32_t>();
    const bool first_y = f(0) != 0, first_z = f(1) != 0;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, field.shape(), &out));
    if (field.NumElements() == 0) return;
    const Cx* in = field.flat<Cx>().data();
    Cx* o = out->flat<Cx>().data();  // may be `in` (in place)
    auto mirror = [](i64 p, bool first) { return (first && p < 2) ? p : (p ^ 1); };
    // K0 A + i Kn B of a packed slot P with its mirror's conjugate Pm
    auto packed = [](Cx P, Cx Pm, R k0, R kn) {
      const Cx a = R(0.5) * (P + Pm), d = P - Pm;
      const Cx b = R(0.5) * Cx(d.imag(), -d.real());    // (P - Pm) / 2i
      const Cx ka(a.real() * k0, a.imag() * k0), kb(b.real() * kn, b.imag() * kn);
      return ka + Cx(-kb.imag(), kb.real());
    };
    shard(ctx, nx * ly, 4 * h + 16, [&](i64 r0, i64 r1) {
      for (i64 r = r0; r < r1; ++r) {
        const i64 i = r / ly, j = r % ly;
        const R* l = line(i, j);
        const Cx* src = in + r * h;
        Cx* dst = o + r * h;
        i64 k0 = 0;
        if (first_z) {
          k0 = 1;
          const i64 m = mirror(i, true) * ly + mirror(j, first_y);
          if (r <= m) {   // this row's thread writes both packed slots
            const Cx P = src[0], Q = in[m * h];
            const R* lm = line(m / ly, m % ly);
            const Cx out_r = packed(P, std::conj(Q), l[iz[0]], l[iz[1]]);
            const Cx out_m = packed(Q, std::conj(P), lm[iz[0]], lm[iz[1]]);
            dst[0] = out_r;
            o[m * h] = out_m;
          }
        }
        for (i64 k = k0; k < h; ++k) {
          const R v = l[iz[2 * k]];
          dst[k] = Cx(src[k].real() * v, src[k].imag() * v);
        }
      }
    });
  }
};

// The shape function of all three: the field's.
::tensorflow::Status same_as_field(InferenceContext* c) {
  ShapeHandle field;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &field));
  c->set_output(0, field);
  return ::tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("FlowpmInverseLaplace")
    .Input("field: C")
    .Input("kx: R")
    .Input("ky: R")
    .Input("kz: R")
    .Output("out: C")
    .Attr("C: {complex64, complex128}")
    .Attr("R: {float, double}")
    .SetShapeFn(same_as_field);

REGISTER_OP("FlowpmRadialScale")
    .Input("field: C")
    .Input("table: R")
    .Input("ix: int32")
    .Input("iy: int32")
    .Input("iz: int32")
    .Output("out: C")
    .Attr("C: {complex64, complex128}")
    .Attr("R: {float, double}")
    .SetShapeFn(same_as_field);

REGISTER_OP("FlowpmRadialScaleHalf")
    .Input("field: C")
    .Input("table: R")
    .Input("ix: int32")
    .Input("iy: int32")
    .Input("iz: int32")
    .Input("firsts: int32")
    .Output("out: C")
    .Attr("C: {complex64, complex128}")
    .Attr("R: {float, double}")
    .SetShapeFn(same_as_field);

#define FLOWPM_REGISTER_KSPACE(name, Kernel)                                                 \
  REGISTER_KERNEL_BUILDER(Name(name)                                                         \
                              .Device(DEVICE_CPU)                                            \
                              .TypeConstraint<::tensorflow::complex64>("C")                  \
                              .TypeConstraint<float>("R"),                                   \
                          Kernel<float>);                                                    \
  REGISTER_KERNEL_BUILDER(Name(name)                                                         \
                              .Device(DEVICE_CPU)                                            \
                              .TypeConstraint<::tensorflow::complex128>("C")                 \
                              .TypeConstraint<double>("R"),                                  \
                          Kernel<double>)

FLOWPM_REGISTER_KSPACE("FlowpmInverseLaplace", InverseLaplaceOp);
FLOWPM_REGISTER_KSPACE("FlowpmRadialScale", RadialScaleOp);
FLOWPM_REGISTER_KSPACE("FlowpmRadialScaleHalf", RadialScaleHalfOp);
