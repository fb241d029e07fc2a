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

}  // namespace

// The CPU kernel Kernel<float> for the op `name` when its attr T is float, and
// Kernel<double> for double.
#define FLOWPM_REGISTER_FLOAT_KERNELS(name, Kernel)                                         \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<float>("T"),       \
                          Kernel<float>);                                                   \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<double>("T"),      \
                          Kernel<double>)

#endif  // FLOWPM_MTF_NATIVE_TF_OP_H_
