// The shell sums of the binned power spectrum, on the CPU.
//
// Op (the Python side, gradient included, is flowpm_mtf/power.py):
//
//   FlowpmShellSums(values [lx, ly, lz] T, kx [lx], ky [ly], kz [lz], edges [nb + 1])
//       -> (modes [nb], ksum [nb], vsum [nb]), all float64 but vsum (T):
//       with |k| = sqrt((kx[i]^2 + ky[j]^2) + kz[l]^2) (float64, the expression of
//       flowpm_mtf.physics.power._knorm64) and b = searchsorted(edges, |k|, side="right") - 1
//       (the shell edges[b] <= |k| < edges[b + 1]), every cell with 0 <= b < nb and
//       |k| != 0 adds 1 to modes[b], |k| to ksum[b] and values[i, j, l] to vsum[b].
//
// One pass over one k-space slice, instead of the TensorFlow path's |k| field, its
// bin indices (searchsorted) and three unsorted_segment_sums over float64 copies (9 s
// of the 12 s final fetch of a 512^3 job on one rank). The bins are those of the
// TensorFlow path (same float64 |k|, same comparisons); the sums are accumulated in
// float64 (vsum rounded once to T at the end, where unsorted_segment_sum adds in T),
// per x plane of the slice, and the planes' sums added in x order: the result does
// not depend on the thread count. Along z, a cell's shell is tried first as its
// predecessor's (edges[b] <= |k| < edges[b + 1] gives the same b as the search).
//
//   FlowpmShellSumsHalf(field [lx, ly, h] C, kx [lx], ky [ly], kz [2 h], edges [nb + 1],
//                       firsts int32 [2]) -> (modes [nb], ksum [nb], vsum [nb] T)
//       The same sums of |F|^2 over the full spectrum of a real field, from its half
//       spectrum (flowpm_mtf.mesh.fft.half_forward without the extend: kx and a ky block in
//       mirror-pair order, the representatives l of a kz block of 2 h positions, kz[2 l]
//       the wave number of slot l). A representative stands for itself and its mirror -k
//       (the same |k|, the same |F|^2): weight 2. In the first kz block (firsts[1]) slot 0
//       packs the zero and Nyquist planes as P = A + i B; A = (P + Pm) / 2 and B = (P - Pm)
//       / 2i with Pm = conj(field[-kx, -ky, 0]) (FlowpmPairs' mirror rule, firsts[0] for the
//       ky block), each of weight 1 at kz[0] and kz[1]. |F|^2 is summed in float64 from the
//       field's values; no full spectrum, no |F|^2 field (flowpm_mtf.physics.power.power_spectrum).
//
// Threading: TensorFlow's intra-op pool, parallel over the x planes.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <complex>
#include <vector>

#include "tf_op.h"

namespace {

// The shell of |k| among the edges E[0..nb], starting from the guess b (the previous
// cell's; along z mostly the same one): -1 outside every shell or at k = 0.
inline i64 shell_of(const double* E, i64 nb, double k, i64* b) {
  if (k >= E[nb] || k < E[0]) return -1;
  if (!(E[*b] <= k && k < E[*b + 1])) *b = (std::upper_bound(E, E + nb + 1, k) - E) - 1;
  return k == 0.0 ? -1 : *b;
}

// The outputs from the per x plane sums (modes, ksum, vsum of each shell: 3 nb doubles per
// plane), the planes added in x order: independent of the thread count.
template <typename T>
void sum_planes(const std::vector<double>& planes, i64 lx, i64 nb, Tensor* modes, Tensor* ksum,
                Tensor* vsum) {
  double* M = modes->flat<double>().data();
  double* K = ksum->flat<double>().data();
  T* P = vsum->flat<T>().data();
  std::vector<double> p(nb, 0.0);
  std::fill(M, M + nb, 0.0);
  std::fill(K, K + nb, 0.0);
  for (i64 i = 0; i < lx; ++i) {
    const double* s = planes.data() + i * 3 * nb;
    for (i64 b = 0; b < nb; ++b) {
      M[b] += s[b];
      K[b] += s[nb + b];
      p[b] += s[2 * nb + b];
    }
  }
  for (i64 b = 0; b < nb; ++b) P[b] = static_cast<T>(p[b]);
}

template <typename T>
class ShellSumsOp : public OpKernel {
 public:
  explicit ShellSumsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& edges = ctx->input(4);
    OP_REQUIRES(ctx, values.dims() == 3,
                InvalidArgument("FlowpmShellSums: values must be [lx, ly, lz], got ",
                                values.shape().DebugString()));
    for (int a = 0; a < 3; ++a) {
      const Tensor& k = ctx->input(1 + a);
      OP_REQUIRES(ctx, k.dims() == 1 && k.dim_size(0) == values.dim_size(a),
                  InvalidArgument("FlowpmShellSums: k vector ", a, " must be [",
                                  values.dim_size(a), "], got ", k.shape().DebugString()));
    }
    OP_REQUIRES(ctx, edges.dims() == 1 && edges.dim_size(0) >= 2,
                InvalidArgument("FlowpmShellSums: edges must be [n_bins + 1 >= 2], got ",
                                edges.shape().DebugString()));
    const i64 lx = values.dim_size(0), ly = values.dim_size(1), lz = values.dim_size(2);
    const i64 nb = edges.dim_size(0) - 1;
    Tensor *modes = nullptr, *ksum = nullptr, *vsum = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb}), &modes));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nb}), &ksum));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nb}), &vsum));
    const T* V = values.flat<T>().data();
    const double* KX = ctx->input(1).flat<double>().data();
    const double* KY = ctx->input(2).flat<double>().data();
    const double* KZ = ctx->input(3).flat<double>().data();
    const double* E = edges.flat<double>().data();
    // Per x plane: modes, ksum, vsum of each shell (3 * nb doubles).
    std::vector<double> planes(lx * 3 * nb, 0.0);
    shard(ctx, lx, 20 * ly * lz, [&](i64 begin, i64 end) {
      std::vector<double> kz2(lz);
      for (i64 l = 0; l < lz; ++l) kz2[l] = KZ[l] * KZ[l];
      for (i64 i = begin; i < end; ++i) {
        double* s = planes.data() + i * 3 * nb;
        const double kx2 = KX[i] * KX[i];
        for (i64 j = 0; j < ly; ++j) {
          const double kxy = kx2 + KY[j] * KY[j];
          const T* row = V + (i * ly + j) * lz;
          i64 b = 0;
          for (i64 l = 0; l < lz; ++l) {
            const double k = std::sqrt(kxy + kz2[l]);
            const i64 sb = shell_of(E, nb, k, &b);
            if (sb < 0) continue;
            s[sb] += 1.0;
            s[nb + sb] += k;
            s[2 * nb + sb] += static_cast<double>(row[l]);
          }
        }
      }
    });
    sum_planes<T>(planes, lx, nb, modes, ksum, vsum);
  }
};

template <typename R>
class ShellSumsHalfOp : public OpKernel {
 public:
  explicit ShellSumsHalfOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    typedef std::complex<R> Cx;
    const char* op = "FlowpmShellSumsHalf";
    const Tensor& field = ctx->input(0);
    const Tensor& edges = ctx->input(4);
    const Tensor& firsts = ctx->input(5);
    OP_REQUIRES(ctx, field.dims() == 3,
                InvalidArgument(op, ": the field must be [lx, ly, h], got ",
                                field.shape().DebugString()));
    const i64 lx = field.dim_size(0), ly = field.dim_size(1), h = field.dim_size(2);
    const i64 lens[3] = {lx, ly, 2 * h};
    for (int a = 0; a < 3; ++a) {
      const Tensor& k = ctx->input(1 + a);
      OP_REQUIRES(ctx, k.dims() == 1 && k.dim_size(0) == lens[a],
                  InvalidArgument(op, ": k vector ", a, " must be [", lens[a], "], got ",
                                  k.shape().DebugString()));
    }
    OP_REQUIRES(ctx, lx % 2 == 0 && ly % 2 == 0,
                InvalidArgument(op, ": the kx and ky extents must be even, got ", lx, ", ", ly));
    OP_REQUIRES(ctx, edges.dims() == 1 && edges.dim_size(0) >= 2,
                InvalidArgument(op, ": edges must be [n_bins + 1 >= 2], got ",
                                edges.shape().DebugString()));
    OP_REQUIRES(ctx, firsts.NumElements() == 2,
                InvalidArgument(op, ": firsts must hold 2 values"));
    const auto f = firsts.flat<int32_t>();
    const bool first_y = f(0) != 0, first_z = f(1) != 0;
    const i64 nb = edges.dim_size(0) - 1;
    Tensor *modes = nullptr, *ksum = nullptr, *vsum = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb}), &modes));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nb}), &ksum));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nb}), &vsum));
    const Cx* F = field.flat<Cx>().data();
    const double* KX = ctx->input(1).flat<double>().data();
    const double* KY = ctx->input(2).flat<double>().data();
    const double* KZ = ctx->input(3).flat<double>().data();
    const double* E = edges.flat<double>().data();
    auto mirror = [](i64 p, bool first) { return (first && p < 2) ? p : (p ^ 1); };
    auto abs2 = [](Cx z) {
      const double a = z.real(), b = z.imag();
      return a * a + b * b;
    };
    std::vector<double> planes(lx * 3 * nb, 0.0);
    shard(ctx, lx, 20 * ly * h, [&](i64 begin, i64 end) {
      std::vector<double> kz2(2 * h);
      for (i64 l = 0; l < 2 * h; ++l) kz2[l] = KZ[l] * KZ[l];
      for (i64 i = begin; i < end; ++i) {
        double* s = planes.data() + i * 3 * nb;
        auto add = [&](i64 b, double w, double k, double v) {
          if (b < 0) return;
          s[b] += w;
          s[nb + b] += w * k;
          s[2 * nb + b] += w * v;
        };
        const double kx2 = KX[i] * KX[i];
        for (i64 j = 0; j < ly; ++j) {
          const double kxy = kx2 + KY[j] * KY[j];
          const Cx* row = F + (i * ly + j) * h;
          i64 b = 0, l0 = 0;
          if (first_z) {
            l0 = 1;
            const Cx P = row[0], Pm = std::conj(F[(mirror(i, true) * ly + mirror(j, first_y)) * h]);
            const Cx a = R(0.5) * (P + Pm), d = P - Pm;
            const Cx bb = R(0.5) * Cx(d.imag(), -d.real());
            const double k0 = std::sqrt(kxy + kz2[0]), kn = std::sqrt(kxy + kz2[1]);
            add(shell_of(E, nb, k0, &b), 1.0, k0, abs2(a));
            add(shell_of(E, nb, kn, &b), 1.0, kn, abs2(bb));
          }
          for (i64 l = l0; l < h; ++l) {
            const double k = std::sqrt(kxy + kz2[2 * l]);
            add(shell_of(E, nb, k, &b), 2.0, k, abs2(row[l]));
          }
        }
      }
    });
    sum_planes<R>(planes, lx, nb, modes, ksum, vsum);
  }
};

// The shape function of both shell-sum ops: a rank-3 field, edges [nb + 1] (input 4) ->
// three vectors [nb].
::tensorflow::Status shell_sums_shape(InferenceContext* c) {
  ShapeHandle v, e;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &v));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &e));
  DimensionHandle nb;
  TF_RETURN_IF_ERROR(c->Subtract(c->Dim(e, 0), 1, &nb));
  for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(nb));
  return ::tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("FlowpmShellSumsHalf")
    .Input("field: C")
    .Input("kx: float64")
    .Input("ky: float64")
    .Input("kz: float64")
    .Input("edges: float64")
    .Input("firsts: int32")
    .Output("modes: float64")
    .Output("ksum: float64")
    .Output("vsum: T")
    .Attr("C: {complex64, complex128}")
    .Attr("T: {float, double}")
    .SetShapeFn(shell_sums_shape);

REGISTER_KERNEL_BUILDER(Name("FlowpmShellSumsHalf")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<::tensorflow::complex64>("C")
                            .TypeConstraint<float>("T"),
                        ShellSumsHalfOp<float>);
REGISTER_KERNEL_BUILDER(Name("FlowpmShellSumsHalf")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<::tensorflow::complex128>("C")
                            .TypeConstraint<double>("T"),
                        ShellSumsHalfOp<double>);

REGISTER_OP("FlowpmShellSums")
    .Input("values: T")
    .Input("kx: float64")
    .Input("ky: float64")
    .Input("kz: float64")
    .Input("edges: float64")
    .Output("modes: float64")
    .Output("ksum: float64")
    .Output("vsum: T")
    .Attr("T: {float, double}")
    .SetShapeFn(shell_sums_shape);

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmShellSums", ShellSumsOp);
