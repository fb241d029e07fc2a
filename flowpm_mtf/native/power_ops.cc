// The shell sums of the binned power spectrum, on the CPU.
//
// Op (the Python side, gradient included, is flowpm_mtf/power.py):
//
//   FlowpmShellSums(values [lx, ly, lz] T, kx [lx], ky [ly], kz [lz], edges [nb + 1])
//       -> (modes [nb], ksum [nb], vsum [nb]), all float64 but vsum (T):
//       with |k| = sqrt((kx[i]^2 + ky[j]^2) + kz[l]^2) (float64, the expression of
//       flowpm_mtf.power._knorm64) and b = searchsorted(edges, |k|, side="right") - 1
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
// Threading: TensorFlow's intra-op pool, parallel over the x planes.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <vector>

#include "tf_op.h"

namespace {

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
          i64 b = 0;  // the previous cell's shell: along z, mostly the same one
          for (i64 l = 0; l < lz; ++l) {
            const double k = std::sqrt(kxy + kz2[l]);
            if (k >= E[nb] || k < E[0]) continue;  // outside every shell
            if (!(E[b] <= k && k < E[b + 1])) b = (std::upper_bound(E, E + nb + 1, k) - E) - 1;
            if (k == 0.0) continue;
            s[b] += 1.0;
            s[nb + b] += k;
            s[2 * nb + b] += static_cast<double>(row[l]);
          }
        }
      }
    });
    double* M = modes->flat<double>().data();
    double* K = ksum->flat<double>().data();
    T* P = vsum->flat<T>().data();
    std::vector<double> p(nb, 0.0);
    std::fill(M, M + nb, 0.0);
    std::fill(K, K + nb, 0.0);
    for (i64 i = 0; i < lx; ++i) {  // x order: independent of the thread count
      const double* s = planes.data() + i * 3 * nb;
      for (i64 b = 0; b < nb; ++b) {
        M[b] += s[b];
        K[b] += s[nb + b];
        p[b] += s[2 * nb + b];
      }
    }
    for (i64 b = 0; b < nb; ++b) P[b] = static_cast<T>(p[b]);
  }
};

}  // namespace

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
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle v, e;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &v));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &e));
      DimensionHandle nb;
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(e, 0), 1, &nb));
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(nb));
      return ::tensorflow::OkStatus();
    });

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmShellSums", ShellSumsOp);
