// The TensorFlow preamble shared by the op libraries of this folder (fft_ops.cc,
// cic_ops.cc, noise_ops.cc, particle_ops.cc, ...): the framework headers, the names
// they use unqualified, and the helpers they repeated.
//
// Each library is one translation unit; these names are declared in the unnamed
// namespace, as each source declared them before, so every library keeps its
// symbols to itself. The build stamp of a library covers this header (see
// flowpm_mtf.native.expected_stamp): editing it rebuilds every library.
#ifndef FLOWPM_MTF_NATIVE_TF_OP_H_
#define FLOWPM_MTF_NATIVE_TF_OP_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
typedef int64_t i64;

// Threads of the intra-op pool the session gives this op.
inline int pool_threads(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
}

// ::tensorflow::Shard of `total` units of `cost` each over the whole intra-op pool:
// work(begin, end) for disjoint ranges covering [0, total).
template <typename Work>
inline void shard(OpKernelContext* ctx, i64 total, i64 cost, Work&& work) {
  ::tensorflow::Shard(pool_threads(ctx), ctx->device()->tensorflow_cpu_worker_threads()->workers,
                      total, cost, work);
}

// The periodic z indices k + o (o = -2..2) of every k < nz, 5 per k: the z terms of the
// four-point difference (FlowpmGradient, FlowpmNegDivergence, FlowpmLatticeCombinePotentials).
inline std::vector<i64> z_neighbours(i64 nz) {
  std::vector<i64> zi(5 * nz);
  for (i64 k = 0; k < nz; ++k)
    for (i64 o = -2; o <= 2; ++o) zi[5 * k + o + 2] = ((k + o) % nz + nz) % nz;
  return zi;
}

// The four-point difference of one column of nz cells: o[3 k + d] = c[d] (8 (f(+1) -
// f(-1)) - (f(+2) - f(-2))) along axis d, the x neighbours' columns xs = {-2, -1, +1, +2},
// the y neighbours' ys alike, z periodic inside the column cc (zi: z_neighbours(nz)).
// FlowpmGradient (cic_ops.cc) and FlowpmLatticeCombinePotentials (lpt_ops.cc).
template <typename T>
inline void four_point_column(const T* const xs[4], const T* const ys[4], const T* cc, i64 nz,
                              const T c[3], const std::vector<i64>& zi, T* o) {
  const T *cm2 = xs[0], *cm1 = xs[1], *cp1 = xs[2], *cp2 = xs[3];
  const T *dm2 = ys[0], *dm1 = ys[1], *dp1 = ys[2], *dp2 = ys[3];
  const T c0 = c[0], c1 = c[1], c2 = c[2];
  auto cell = [&](i64 k, i64 zm2, i64 zm1, i64 zp1, i64 zp2) {
    o[3 * k] = c0 * (T(8) * (cp1[k] - cm1[k]) - (cp2[k] - cm2[k]));
    o[3 * k + 1] = c1 * (T(8) * (dp1[k] - dm1[k]) - (dp2[k] - dm2[k]));
    o[3 * k + 2] = c2 * (T(8) * (cc[zp1] - cc[zm1]) - (cc[zp2] - cc[zm2]));
  };
  if (nz < 5) {
    for (i64 k = 0; k < nz; ++k) {
      const i64* z = &zi[5 * k];
      cell(k, z[0], z[1], z[3], z[4]);
    }
    return;
  }
  for (i64 k = 0; k < 2; ++k) {
    const i64* z = &zi[5 * k];
    cell(k, z[0], z[1], z[3], z[4]);
  }
  for (i64 k = 2; k < nz - 2; ++k) cell(k, k - 2, k - 1, k + 1, k + 2);
  for (i64 k = nz - 2; k < nz; ++k) {
    const i64* z = &zi[5 * k];
    cell(k, z[0], z[1], z[3], z[4]);
  }
}

// x wrapped into [0, s) (s > 0; below: the largest value under s), as FlowpmWrap
// (particle_ops.cc) and the wrap of FlowpmLatticeCombinePotentials (lpt_ops.cc) compute it,
// operation for operation as flowpm_mtf.mesh.domain_local.wrap_tf: w = x - s floor(x / s); w += s if
// w < 0; w -= s if w >= s; min(w, below). x in (0, s) is returned as it is, without the
// division: the formula's result (x / s rounds below 1, the floor is 0, x - 0 = x); +-0
// take the formula (-0 becomes +0).
template <typename T>
inline T wrap_coordinate(T x, T s, T below) {
  if (x > T(0) && x < s) return x;
  T w = x - s * std::floor(x / s);
  if (w < T(0)) w = w + s;
  if (w >= s) w = w - s;
  return std::min(w, below);
}

}  // namespace

// The CPU kernel Kernel<float> for the op `name` when its attr T is float, and
// Kernel<double> for double.
#define FLOWPM_REGISTER_FLOAT_KERNELS(name, Kernel)                                         \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<float>("T"),       \
                          Kernel<float>);                                                   \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<double>("T"),      \
                          Kernel<double>)

#endif  // FLOWPM_MTF_NATIVE_TF_OP_H_
