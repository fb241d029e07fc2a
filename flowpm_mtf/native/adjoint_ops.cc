// The particle arithmetic of the adjoint's reverse kick-drift-kick step, fused, on the CPU.
//
// Ops (the Python side, with the TensorFlow expressions they replace and the
// gradient, is flowpm_mtf/reverse_kdk.py; the step is flowpm_mtf/adjoint.py
// reverse_step):
//
//   FlowpmAdjointDrift(x, p, f, xb, pb [B, n, 3], ids [B, n] or [0], k1, drift)
//       -> x_new, dx, p_h, pb_h [B, n, 3], dots [B, 2]:
//         p_h = p - k1 f;  dx = -(drift p_h);  x_new = x + dx;  pb_h = pb + drift xb;
//         dots[b] = (sum w pb.f, sum w xb.p_h) over the slots of block b
//   FlowpmAdjointKick(p_h, f, pb_h, vjp, xb [B, n, 3], ids [B, n] or [0], k0, c)
//       -> p, xb_new [B, n, 3], dots [B, 2]:
//         p = p_h - k0 f;  xb_new = xb + c vjp;
//         dots[b] = (sum w pb_h.f, sum w (c pb_h).f)
//
// w is 1 for a valid slot (id >= 0) and 0 for an empty one (every slot is valid when
// ids has no element). Each elementwise result is the TensorFlow expression's,
// operation for operation (no contraction into fused multiply-adds: the CXXFLAGS
// below), so the outputs equal the TensorFlow path's bit for bit; the dot products
// are summed in double over fixed chunks of particles, then the chunks in order, so
// they do not depend on the thread count (TensorFlow sums in T: they agree to T's
// rounding).
//
// These replace ~25 TensorFlow ops per reverse step (Mul, Neg, AddV2, Cast, Sum on
// [B, n, 3] arrays: ~10 ms of a 60 ms step at 64^3 on one thread) by two passes.
// Threading: TensorFlow's intra-op pool, parallel over chunks of particles.
//
// CXXFLAGS: -ffp-contract=off
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tf_op.h"

namespace {

constexpr i64 kChunk = 4096;  // particles per partial sum of the dot products

// Checks the [B, n, 3] float inputs `first..last` against input `first`, and ids
// ([B, n], or no element) and the scalar inputs from `scalars` on.
::tensorflow::Status check_inputs(OpKernelContext* ctx, int n_fields, int ids_index,
                                  int n_scalars, const char* op) {
  const Tensor& x = ctx->input(0);
  if (x.dims() != 3 || x.dim_size(2) != 3)
    return InvalidArgument(op, ": particle fields must be [blocks, n, 3], got ",
                           x.shape().DebugString());
  for (int k = 1; k < n_fields; ++k)
    if (ctx->input(k).shape() != x.shape())
      return InvalidArgument(op, ": input ", k, " has shape ",
                             ctx->input(k).shape().DebugString(), ", input 0 ",
                             x.shape().DebugString());
  const Tensor& ids = ctx->input(ids_index);
  if (ids.NumElements() != 0 &&
      (ids.dims() != 2 || ids.dim_size(0) != x.dim_size(0) || ids.dim_size(1) != x.dim_size(1)))
    return InvalidArgument(op, ": ids must be [", x.dim_size(0), ", ", x.dim_size(1),
                           "] or empty, got ", ids.shape().DebugString());
  for (int k = ids_index + 1; k <= ids_index + n_scalars; ++k)
    if (ctx->input(k).NumElements() != 1)
      return InvalidArgument(op, ": input ", k, " must be a scalar, got ",
                             ctx->input(k).shape().DebugString());
  return ::tensorflow::OkStatus();
}

// Runs body(i, w) -> (a, b) over every particle of every block in chunks of kChunk, in
// parallel, and writes dots[b] = (sum of a, sum of b) over the block, in double, the
// chunks summed in order.
template <typename T, typename Tid, typename Body>
void chunked(OpKernelContext* ctx, i64 nb, i64 n, const Tid* ids, T* dots, Body&& body) {
  const i64 per_block = std::max<i64>(1, (n + kChunk - 1) / kChunk);
  std::vector<double> part(2 * nb * per_block, 0.0);
  auto work = [&](int64_t begin, int64_t end) {
    for (i64 c = begin; c < end; ++c) {
      const i64 b = c / per_block, lo = b * n + (c % per_block) * kChunk;
      const i64 hi = std::min(lo + kChunk, (b + 1) * n);
      double s0 = 0.0, s1 = 0.0;
      for (i64 i = lo; i < hi; ++i) {
        const T w = ids == nullptr ? T(1) : (ids[i] >= 0 ? T(1) : T(0));
        double a, bb;
        body(i, w, &a, &bb);
        s0 += a;
        s1 += bb;
      }
      part[2 * c] = s0;
      part[2 * c + 1] = s1;
    }
  };
  shard(ctx, nb * per_block, kChunk * 40, work);
  for (i64 b = 0; b < nb; ++b) {
    double s0 = 0.0, s1 = 0.0;
    for (i64 k = 0; k < per_block; ++k) {
      s0 += part[2 * (b * per_block + k)];
      s1 += part[2 * (b * per_block + k) + 1];
    }
    dots[2 * b] = static_cast<T>(s0);
    dots[2 * b + 1] = static_cast<T>(s1);
  }
}

template <typename T>
inline T scalar(OpKernelContext* ctx, int k) {
  return ctx->input(k).flat<T>()(0);
}

// ------------------------------------------------------------------ reverse drift
template <typename T, typename Tid>
class AdjointDriftOp : public OpKernel {
 public:
  explicit AdjointDriftOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, check_inputs(ctx, 5, 5, 2, "FlowpmAdjointDrift"));
    const Tensor& x = ctx->input(0);
    const i64 nb = x.dim_size(0), n = x.dim_size(1);
    Tensor *xn = nullptr, *dx = nullptr, *ph = nullptr, *pbh = nullptr, *dots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &xn));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 2, x.shape(), &ph));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({4}, 3, x.shape(), &pbh));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({nb, 2}), &dots));
    const T* X = ctx->input(0).flat<T>().data();
    const T* P = ctx->input(1).flat<T>().data();
    const T* F = ctx->input(2).flat<T>().data();
    const T* XB = ctx->input(3).flat<T>().data();
    const T* PB = ctx->input(4).flat<T>().data();
    const Tensor& ids = ctx->input(5);
    const Tid* I = ids.NumElements() ? ids.flat<Tid>().data() : nullptr;
    const T k1 = scalar<T>(ctx, 6), drift = scalar<T>(ctx, 7);
    T* XN = xn->flat<T>().data();
    T* DX = dx->flat<T>().data();
    T* PH = ph->flat<T>().data();
    T* PBH = pbh->flat<T>().data();
    // Inputs and outputs may share buffers (forwarded): every element is read before
    // its own index is written.
    chunked<T, Tid>(ctx, nb, n, I, dots->flat<T>().data(),
                    [&](i64 i, T w, double* a, double* b) {
                      T dpf = T(0), dxp = T(0);
                      for (int c = 0; c < 3; ++c) {
                        const i64 j = 3 * i + c;
                        const T f = F[j], xb = XB[j], pb = PB[j];
                        const T p_h = P[j] - f * k1;
                        const T d = -(p_h * drift);
                        dpf += pb * f;
                        dxp += xb * p_h;
                        XN[j] = X[j] + d;
                        DX[j] = d;
                        PH[j] = p_h;
                        PBH[j] = pb + xb * drift;
                      }
                      *a = static_cast<double>(w * dpf);
                      *b = static_cast<double>(w * dxp);
                    });
  }
};

// ------------------------------------------------------------------ reverse kick
template <typename T, typename Tid>
class AdjointKickOp : public OpKernel {
 public:
  explicit AdjointKickOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, check_inputs(ctx, 5, 5, 2, "FlowpmAdjointKick"));
    const Tensor& ph = ctx->input(0);
    const i64 nb = ph.dim_size(0), n = ph.dim_size(1);
    Tensor *p = nullptr, *xbn = nullptr, *dots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, ph.shape(), &p));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({4, 3}, 1, ph.shape(), &xbn));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nb, 2}), &dots));
    const T* PH = ctx->input(0).flat<T>().data();
    const T* F = ctx->input(1).flat<T>().data();
    const T* PBH = ctx->input(2).flat<T>().data();
    const T* V = ctx->input(3).flat<T>().data();
    const T* XB = ctx->input(4).flat<T>().data();
    const Tensor& ids = ctx->input(5);
    const Tid* I = ids.NumElements() ? ids.flat<Tid>().data() : nullptr;
    const T k0 = scalar<T>(ctx, 6), cf = scalar<T>(ctx, 7);
    T* PO = p->flat<T>().data();
    T* XBN = xbn->flat<T>().data();
    chunked<T, Tid>(ctx, nb, n, I, dots->flat<T>().data(),
                    [&](i64 i, T w, double* a, double* b) {
                      T dpf = T(0), dff = T(0);
                      for (int c = 0; c < 3; ++c) {
                        const i64 j = 3 * i + c;
                        const T f = F[j], pbh = PBH[j];
                        dpf += pbh * f;
                        dff += (pbh * cf) * f;
                        PO[j] = PH[j] - f * k0;
                        XBN[j] = XB[j] + cf * V[j];
                      }
                      *a = static_cast<double>(w * dpf);
                      *b = static_cast<double>(w * dff);
                    });
  }
};

::tensorflow::Status fields_and_dots(InferenceContext* c, int n_fields) {
  ShapeHandle x;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
  for (int k = 0; k < n_fields; ++k) c->set_output(k, x);
  c->set_output(n_fields, c->MakeShape({c->Dim(x, 0), 2}));
  return ::tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("FlowpmAdjointDrift")
    .Input("x: T")
    .Input("p: T")
    .Input("f: T")
    .Input("xb: T")
    .Input("pb: T")
    .Input("ids: Tid")
    .Input("k1: T")
    .Input("drift: T")
    .Output("x_new: T")
    .Output("dx: T")
    .Output("p_h: T")
    .Output("pb_h: T")
    .Output("dots: T")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) { return fields_and_dots(c, 4); });

REGISTER_OP("FlowpmAdjointKick")
    .Input("p_h: T")
    .Input("f: T")
    .Input("pb_h: T")
    .Input("vjp: T")
    .Input("xb: T")
    .Input("ids: Tid")
    .Input("k0: T")
    .Input("c: T")
    .Output("p: T")
    .Output("xb_new: T")
    .Output("dots: T")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) { return fields_and_dots(c, 2); });

#define REGISTER_ADJOINT(T, Tid)                                                             \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FlowpmAdjointDrift").Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tid>( \
          "Tid"),                                                                            \
      AdjointDriftOp<T, Tid>);                                                               \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FlowpmAdjointKick").Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tid>( \
          "Tid"),                                                                            \
      AdjointKickOp<T, Tid>);

REGISTER_ADJOINT(float, int32_t);
REGISTER_ADJOINT(float, int64_t);
REGISTER_ADJOINT(double, int32_t);
REGISTER_ADJOINT(double, int64_t);
