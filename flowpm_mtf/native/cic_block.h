// Particle positions and the padded block of the CIC stencil, shared by cic_ops.cc
// (FlowpmCicPaint, FlowpmCicReadout, FlowpmCicReadoutGradPos, FlowpmCicEscaped) and
// particle_ops.cc (FlowpmParticleStats): one definition of the argument checks and
// of the escape test, so the migration's count of particles outside the padded
// block is, by construction, FlowpmCicEscaped's (masked by the ids).
#ifndef FLOWPM_MTF_NATIVE_CIC_BLOCK_H_
#define FLOWPM_MTF_NATIVE_CIC_BLOCK_H_

#include <cmath>

#include "tf_op.h"

namespace {

// Checks shared by the kernels: positions [B, n, 3]; an optional per-particle
// tensor [B, n, C] (or empty).
::tensorflow::Status check_positions(const Tensor& pos) {
  if (pos.dims() != 3 || pos.dim_size(2) != 3)
    return InvalidArgument("CIC: positions must be [blocks, n, 3], got ",
                           pos.shape().DebugString());
  return ::tensorflow::OkStatus();
}

::tensorflow::Status check_per_particle(const Tensor& t, const Tensor& pos, i64 comps,
                                        const char* what) {
  if (t.NumElements() == 0) return ::tensorflow::OkStatus();
  if (t.dims() != 3 || t.dim_size(0) != pos.dim_size(0) || t.dim_size(1) != pos.dim_size(1) ||
      t.dim_size(2) != comps)
    return InvalidArgument("CIC: ", what, " must be [", pos.dim_size(0), ", ", pos.dim_size(1),
                           ", ", comps, "] or empty, got ", t.shape().DebugString());
  return ::tensorflow::OkStatus();
}

// The padded block of FlowpmCicEscaped and FlowpmParticleStats: attrs halo, sx, sy.
struct BlockBox {
  i64 halo, sx, sy;
};

::tensorflow::Status read_block_box(OpKernelConstruction* ctx, BlockBox* box) {
  int h, sx, sy;
  TF_RETURN_IF_ERROR(ctx->GetAttr("halo", &h));
  TF_RETURN_IF_ERROR(ctx->GetAttr("sx", &sx));
  TF_RETURN_IF_ERROR(ctx->GetAttr("sy", &sy));
  *box = BlockBox{h, sx, sy};
  return ::tensorflow::OkStatus();
}

// Whether a particle's CIC stencil fits its padded block:
// floor(x) in [-h, s + h - 2]  <=>  x in [-h, s + h - 1) (integer bounds) along x and y;
// NaN and +-inf fail a comparison, a non-finite z is tested on its own.
template <typename T>
struct StencilFits {
  T lox, hix, loy, hiy;
  explicit StencilFits(const BlockBox& b)
      : lox(T(-b.halo)), hix(T(b.sx + b.halo - 1)), loy(T(-b.halo)), hiy(T(b.sy + b.halo - 1)) {}
  bool operator()(const T* q) const {
    return q[0] >= lox && q[0] < hix && q[1] >= loy && q[1] < hiy && std::isfinite(q[2]);
  }
};

}  // namespace

#endif  // FLOWPM_MTF_NATIVE_CIC_BLOCK_H_
