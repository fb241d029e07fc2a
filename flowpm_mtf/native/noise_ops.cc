// Decomposition-independent Gaussian white noise, on the CPU.
//
// Op (the Python side is flowpm_mtf/noise.py, which documents the algorithm):
//
//   FlowpmWhiteNoise(begin int64 [ndim], global_shape, slice_shape, key) -> T slice_shape
//       out[i] = normal(flat global row-major index of begin + i), with the stream key
//       `key` (the uint64 mix64(seed + gamma), passed as its int64 bit pattern).
//
// Bit for bit the numbers of flowpm_mtf.mesh.noise.white_noise_numpy and of the TensorFlow
// path: the same SplitMix64 integer arithmetic (exact modulo 2^64), and the same
// sequence of correctly rounded IEEE double operations for ln and cos (argument
// reduction and polynomials with +, -, *, /, sqrt only, evaluated in the order of
// the Python expressions). Contraction into fused multiply-adds would change the
// rounding, so it is switched off for this file (the pragma below; the default x86-64
// target and the AVX2 clone of `normals` have no FMA instructions, its x86-64-v4 clone
// has them and must not use them). Values are
// rounded once to T.
//
// Vectorisation: the loop of `normals` is compiled with vector instructions, which
// give the same correctly rounded results lane by lane. It needs the two flags below:
// without -fno-math-errno a sqrt may set errno (control flow), without
// -fno-trapping-math the compiler does not evaluate both arms of a select (they could
// raise floating-point exceptions, which nothing here reads). Neither changes a value.
// CXXFLAGS: -fno-math-errno -fno-trapping-math
//
// Threading: TensorFlow's intra-op pool (each cell is independent, so the result
// does not depend on the thread count).
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tf_op.h"

namespace {

typedef uint64_t u64;

constexpr u64 kGamma = 0x9E3779B97F4A7C15ULL;
constexpr u64 kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr u64 kM2 = 0x94D049BB133111EBULL;
constexpr double kLn2 = 0.6931471805599453;
constexpr double kSqrt2 = 1.4142135623730951;
constexpr double kTwoPi = 6.283185307179586;

// The coefficient lists of noise.py (_LOG_COEFFS, _COS_COEFFS, _SIN_COEFFS), in the
// same double values: 1/(2k+1), (-1)^k/(2k)!, (-1)^k/(2k+1)! (each a correctly rounded
// quotient, as Python computes them).
struct Coeffs {
  double log_c[12], cos_c[10], sin_c[10];
  Coeffs() {
    for (int k = 0; k < 12; ++k) log_c[k] = 1.0 / static_cast<double>(2 * k + 1);
    double fact = 1.0;  // (2k)! then (2k+1)!, exact in double up to 19! (< 2^53 * 2^10)
    for (int k = 0; k < 10; ++k) {
      if (k > 0) fact *= static_cast<double>((2 * k - 1) * (2 * k));
      double sign = (k % 2 == 0) ? 1.0 : -1.0;
      cos_c[k] = sign / fact;
      sin_c[k] = sign / (fact * static_cast<double>(2 * k + 1));
    }
  }
};

inline u64 mix64(u64 z) {
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// Integer to double without the scalar conversion instruction (x86 before AVX-512 has
// no vector one for 64-bit integers), exactly: for v < 2^52, the double whose bits are
// 2^52's with v in the mantissa is 2^52 + v.
inline double small_to_double(u64 v) {
  u64 b = v | 0x4330000000000000ULL;
  double d;
  std::memcpy(&d, &b, 8);
  return d - 4503599627370496.0;
}

// (x >> 11) as a double, exactly (< 2^53: the high 27 and low 26 bits separately).
inline double top53_to_double(u64 x) {
  u64 v = x >> 11;
  return small_to_double(v >> 26) * 67108864.0 + small_to_double(v & 0x3FFFFFFULL);
}

inline double uniform(u64 counter, u64 key) {
  u64 x = mix64(key + (counter + 1) * kGamma);
  return (top53_to_double(x) + 0.5) * 0x1p-53;
}

template <int N>
inline double horner(double x, const double (&c)[N]) {
  double acc = c[N - 1];
  for (int k = N - 2; k >= 0; --k) acc = acc * x + c[k];
  return acc;
}

// Written without branches (selects), so that a loop of them vectorises; every
// operation and its order are those of flowpm_mtf/noise.py.
inline double log_basic(double u, const Coeffs& c) {
  u64 bits;
  std::memcpy(&bits, &u, 8);
  double e = small_to_double(bits >> 52) - 1023.0;
  u64 mb = (bits & 0x000FFFFFFFFFFFFFULL) | 0x3FF0000000000000ULL;
  double m;
  std::memcpy(&m, &mb, 8);
  bool big = m > kSqrt2;
  m = big ? m * 0.5 : m;
  e = big ? e + 1.0 : e;
  double s = (m - 1.0) / (m + 1.0);
  double log_m = 2.0 * s * horner(s * s, c.log_c);
  return e * kLn2 + log_m;
}

inline double cos_2pi(double u, const Coeffs& c) {
  double t = u > 0.5 ? 1.0 - u : u;
  bool neg = t > 0.25;
  t = neg ? 0.5 - t : t;
  bool use_sin = t > 0.125;
  double r = use_sin ? 0.25 - t : t;
  double x = kTwoPi * r;
  double x2 = x * x;
  double vs = x * horner(x2, c.sin_c);
  double vc = horner(x2, c.cos_c);
  double v = use_sin ? vs : vc;
  return neg ? -v : v;
}

inline double normal(u64 n, u64 key, const Coeffs& c) {
  u64 c1 = n * 2;
  double u1 = uniform(c1, key);
  double u2 = uniform(c1 + 1, key);
  return std::sqrt(-2.0 * log_basic(u1, c)) * cos_2pi(u2, c);
}

// out[k] = normal(first + k) for k < n. A plain loop of the inline functions above, so
// the compiler vectorises it; at load time a clone for the CPU is chosen: x86-64-v4
// (AVX-512 with 64-bit integer products: 8 doubles a vector), AVX2 (4) or the default
// (2). The same correctly rounded operations, so the same bits: the pragma above keeps
// the compiler from contracting into the FMA instructions x86-64-v4 has (the library has
// none: `objdump -d | grep vfmadd`). A 256^3 field on two threads of a Xeon with
// AVX-512 (wall time x 2 per cell): 13.8 ns with the x86-64-v4 clone, 24 ns with the AVX2
// one (built alone).
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void normals(u64 first, u64 key, long n, double* out, const Coeffs* c) {
  for (long k = 0; k < n; ++k) out[k] = normal(first + static_cast<u64>(k), key, *c);
}

template <typename T>
class WhiteNoiseOp : public OpKernel {
 public:
  explicit WhiteNoiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<i64> g, s;
    i64 key;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("global_shape", &g));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slice_shape", &s));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key));
    OP_REQUIRES(ctx, !g.empty() && g.size() == s.size(),
                InvalidArgument("white noise: global_shape and slice_shape must have the same "
                                "non-zero rank"));
    global_ = g;
    slice_ = s;
    key_ = static_cast<u64>(key);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& begin_t = ctx->input(0);
    const int nd = static_cast<int>(global_.size());
    OP_REQUIRES(ctx, begin_t.dims() == 1 && begin_t.dim_size(0) == nd,
                InvalidArgument("white noise: begin must be a vector of ", nd, " entries"));
    auto b = begin_t.flat<i64>();
    std::vector<i64> begin(nd);
    for (int d = 0; d < nd; ++d) {
      begin[d] = b(d);
      OP_REQUIRES(ctx, begin[d] >= 0 && begin[d] + slice_[d] <= global_[d],
                  InvalidArgument("white noise: slice [", begin[d], ", ", begin[d] + slice_[d],
                                  ") outside the global axis ", d, " of ", global_[d]));
    }
    TensorShape shape;
    for (i64 s : slice_) shape.AddDim(s);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    T* o = out->flat<T>().data();
    const i64 inner = slice_[nd - 1];
    const i64 rows = shape.num_elements() / (inner > 0 ? inner : 1);
    if (shape.num_elements() == 0) return;
    static const Coeffs coeffs;
    const std::vector<i64> g = global_, s = slice_;
    const u64 key = key_;
    auto work = [&, g, s, key, begin](i64 r0, i64 r1) {
      constexpr i64 kChunk = 256;
      double buf[kChunk];
      std::vector<i64> idx(nd);
      for (i64 r = r0; r < r1; ++r) {
        // global flat index of the row's first cell: ((b0+i0) g1 + (b1+i1)) g2 + ...
        i64 rem = r;
        for (int d = nd - 2; d >= 0; --d) {
          idx[d] = rem % s[d];
          rem /= s[d];
        }
        u64 flat = 0;
        for (int d = 0; d < nd - 1; ++d)
          flat = flat * static_cast<u64>(g[d]) + static_cast<u64>(begin[d] + idx[d]);
        flat = flat * static_cast<u64>(g[nd - 1]) + static_cast<u64>(begin[nd - 1]);
        T* row = o + r * inner;
        for (i64 k0 = 0; k0 < inner; k0 += kChunk) {
          const i64 n = std::min<i64>(kChunk, inner - k0);
          normals(flat + static_cast<u64>(k0), key, static_cast<long>(n), buf, &coeffs);
          for (i64 k = 0; k < n; ++k) row[k0 + k] = static_cast<T>(buf[k]);
        }
      }
    };
    shard(ctx, rows, 60 * inner, work);
  }

 private:
  std::vector<i64> global_, slice_;
  u64 key_;
};

}  // namespace

REGISTER_OP("FlowpmWhiteNoise")
    .Input("begin: int64")
    .Output("noise: T")
    .Attr("T: {float, double}")
    .Attr("global_shape: list(int)")
    .Attr("slice_shape: list(int)")
    .Attr("key: int")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      std::vector<i64> s;
      TF_RETURN_IF_ERROR(c->GetAttr("slice_shape", &s));
      std::vector<::tensorflow::shape_inference::DimensionHandle> dims;
      for (i64 v : s) dims.push_back(c->MakeDim(v));
      c->set_output(0, c->MakeShape(dims));
      return ::tensorflow::OkStatus();
    });

FLOWPM_REGISTER_FLOAT_KERNELS("FlowpmWhiteNoise", WhiteNoiseOp);
