// Local 1D FFTs along one axis of a batched array, on the CPU, with FFTW.
//
// LINK: -lfftw3f_threads -lfftw3_threads -lfftw3f -lfftw3 -lpthread
//
// Ops (the Python side, gradients included, is flowpm_mtf/fft.py):
//
//   FlowpmFftC2c(x: complex64|complex128, axis, inverse, normalized) -> same shape
//       y[j] = c * sum_k x[k] exp(-+ 2 pi i j k / n)   (sign + when inverse)
//   FlowpmFftR2c(x: float|double, axis, normalized) -> complex, n // 2 + 1 along axis
//       numpy.fft.rfft (times c)
//   FlowpmFftC2r(x: complex, n, axis, normalized) -> real, n along axis
//       unnormalised inverse of the Hermitian extension (imaginary parts of the
//       zero and Nyquist modes ignored), times c: numpy.fft.irfft when normalized
//   FlowpmPairs(x: complex [nx, ly, L], firsts: int32 [2], fold) -> complex
//       Between the representatives (L = h) and a full kz block (L = 2 h) of a real
//       field's 3D transform in mirror-pair order (flowpm_mtf.layout.k_order): see the
//       comment above PairsOp. One pass, on the intra-op pool; gradients on the Python
//       side (flowpm_mtf/fft.py).
//
// FlowpmFftC2c, and FlowpmFftR2c / FlowpmFftC2r with full or packed = true, take
// in_blocks and out_blocks (default 1): the input / output stored as the pieces of an
// all-to-all, [blocks, .., len / blocks along axis, ..] (`axis` counts the unblocked
// axes); the panel copies read / write that layout, so no transpose packs or unpacks
// an exchange. in_pairs / out_pairs (c2c; r2c / c2r with full = true): the k side in
// mirror-pair order along the axis, permuted by the same copies. packed = true (r2c /
// c2r, even n, the last axis): n // 2 values, the zero mode's slot holding the zero and
// Nyquist modes as x_0 + i x_{n/2}.
//
// with c = 1/n when `normalized`, else 1; n is the transform length (the real
// length for r2c/c2r). numpy.fft.fft = (inverse=False, normalized=False),
// numpy.fft.ifft = (inverse=True, normalized=True).
//
// The array is viewed as [outer, n, inner] around `axis`; one FFTW guru plan
// covers a piece [outer_count, n, inner_count] of it (howmany-rank 2, so no
// transposes). The pieces (split along outer, or along inner when outer is
// smaller than the thread count) run on TensorFlow's intra-op thread pool,
// i.e. with the threads the session gives this process (the ranks size it per
// rank), never with extra FFTW threads. Plans are created once per
// (kind, precision, piece geometry, alignment, in-place) under one mutex (the
// FFTW planner is not thread-safe) and executed with the new-array interface
// (thread-safe). FLOWPM_MTF_FFTW_PLANNER=estimate (default) | measure chooses
// the planner rigour; measure plans on scratch arrays (never on user data).
#include <fftw3.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <complex>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "tf_op.h"

namespace {

// kC2RDestroy: c2r allowed to overwrite its input (our own panel buffers).
enum Kind { kC2C = 0, kR2C = 1, kC2R = 2, kC2RDestroy = 3 };

// ---------------------------------------------------------------- FFTW by precision
// Work buffers (panels, Hermitian folds, planner scratch) start on a 64-byte
// boundary, as TensorFlow's tensors do. Plans are cached per alignment (mod 64)
// of their arrays and FFTW picks its codelets by alignment, so buffers whose
// alignment varied from call to call (fftw_malloc guarantees 16 or 32 bytes;
// where a 32-byte block lands mod 64 depends on the heap, e.g. under tcmalloc)
// gave a different plan, and different last bits, for the same data: a run
// resumed from a checkpoint was not bit-identical to the uninterrupted one.
inline void* aligned_buffer(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, n ? n : 64) != 0) return nullptr;
  return p;
}

template <typename R>
struct Fftw;

template <>
struct Fftw<float> {
  typedef fftwf_plan Plan;
  typedef fftwf_complex C;
  static const int kPrecision = 1;
  static Plan c2c(const fftw_iodim64* d, const fftw_iodim64* h, C* in, C* out, int sign,
                  unsigned flags) {
    return fftwf_plan_guru64_dft(1, d, 2, h, in, out, sign, flags);
  }
  static Plan r2c(const fftw_iodim64* d, const fftw_iodim64* h, float* in, C* out,
                  unsigned flags) {
    return fftwf_plan_guru64_dft_r2c(1, d, 2, h, in, out, flags);
  }
  static Plan c2r(const fftw_iodim64* d, const fftw_iodim64* h, C* in, float* out,
                  unsigned flags) {
    return fftwf_plan_guru64_dft_c2r(1, d, 2, h, in, out, flags);
  }
  static void exec(Plan p, C* in, C* out) { fftwf_execute_dft(p, in, out); }
  static void exec(Plan p, float* in, C* out) { fftwf_execute_dft_r2c(p, in, out); }
  static void exec(Plan p, C* in, float* out) { fftwf_execute_dft_c2r(p, in, out); }
  static void* malloc(size_t n) { return aligned_buffer(n); }
  static void free(void* p) { std::free(p); }
};

template <>
struct Fftw<double> {
  typedef fftw_plan Plan;
  typedef fftw_complex C;
  static const int kPrecision = 2;
  static Plan c2c(const fftw_iodim64* d, const fftw_iodim64* h, C* in, C* out, int sign,
                  unsigned flags) {
    return fftw_plan_guru64_dft(1, d, 2, h, in, out, sign, flags);
  }
  static Plan r2c(const fftw_iodim64* d, const fftw_iodim64* h, double* in, C* out,
                  unsigned flags) {
    return fftw_plan_guru64_dft_r2c(1, d, 2, h, in, out, flags);
  }
  static Plan c2r(const fftw_iodim64* d, const fftw_iodim64* h, C* in, double* out,
                  unsigned flags) {
    return fftw_plan_guru64_dft_c2r(1, d, 2, h, in, out, flags);
  }
  static void exec(Plan p, C* in, C* out) { fftw_execute_dft(p, in, out); }
  static void exec(Plan p, double* in, C* out) { fftw_execute_dft_r2c(p, in, out); }
  static void exec(Plan p, C* in, double* out) { fftw_execute_dft_c2r(p, in, out); }
  static void* malloc(size_t n) { return aligned_buffer(n); }
  static void free(void* p) { std::free(p); }
};

// ---------------------------------------------------------------- plan cache
// (kind, precision, sign, n, in_len, out_len, inner, outer_count, inner_count, in % 64,
//  out % 64, in-place)
typedef std::tuple<int, int, int, i64, i64, i64, i64, i64, i64, int, int, bool> PlanKey;

// Guards the plan cache and every call of our FFTW planner. Other code in the
// process (e.g. mpi4py-fft, numpy extensions linking FFTW) may plan at the same
// time: fftw_make_planner_thread_safe (FFTW >= 3.3.5) makes FFTW serialise
// all planner calls of the process too.
std::mutex& planner_mutex() {
  static std::mutex m;
  static std::once_flag once;
  std::call_once(once, [] {
    fftw_make_planner_thread_safe();
    fftwf_make_planner_thread_safe();
  });
  return m;
}

std::map<PlanKey, void*>& plan_cache() {
  static std::map<PlanKey, void*> cache;
  return cache;
}

unsigned planner_flags() {
  static const unsigned flags = [] {
    const char* v = std::getenv("FLOWPM_MTF_FFTW_PLANNER");
    std::string s = v ? v : "estimate";
    if (s == "measure") return FFTW_MEASURE;
    if (s == "patient") return FFTW_PATIENT;
    return FFTW_ESTIMATE;
  }();
  return flags;
}

// Geometry of one piece: transform length n along a stride of `inner`
// elements; outer_count batches `in_len * inner` (input) / `out_len * inner`
// (output) apart; inner_count batches 1 apart.
struct Piece {
  i64 n, in_len, out_len, inner, outer_count, inner_count;
};

template <typename R, typename In, typename Out>
void* make_plan(int kind, int sign, const Piece& p, In* in, Out* out, bool in_place) {
  typedef Fftw<R> F;
  fftw_iodim64 dims[1] = {{p.n, p.inner, p.inner}};
  fftw_iodim64 how[2] = {{p.outer_count, p.in_len * p.inner, p.out_len * p.inner},
                         {p.inner_count, 1, 1}};
  unsigned flags = planner_flags();
  // The planner overwrites its arrays unless it only estimates: plan on scratch
  // arrays with the same alignment (mod 64 bytes) as the real ones.
  void* scratch_in = nullptr;
  void* scratch_out = nullptr;
  In* pin = in;
  Out* pout = out;
  if (flags != FFTW_ESTIMATE) {
    size_t in_bytes = sizeof(In) * ((p.outer_count - 1) * p.in_len * p.inner +
                                    (p.in_len - 1) * p.inner + p.inner_count);
    size_t out_bytes = sizeof(Out) * ((p.outer_count - 1) * p.out_len * p.inner +
                                      (p.out_len - 1) * p.inner + p.inner_count);
    scratch_in = F::malloc(std::max(in_bytes, out_bytes) + 64);
    pin = reinterpret_cast<In*>(static_cast<char*>(scratch_in) +
                                reinterpret_cast<uintptr_t>(in) % 64);
    if (in_place) {
      pout = reinterpret_cast<Out*>(pin);
    } else {
      scratch_out = F::malloc(out_bytes + 64);
      pout = reinterpret_cast<Out*>(static_cast<char*>(scratch_out) +
                                    reinterpret_cast<uintptr_t>(out) % 64);
    }
  }
  void* plan = nullptr;
  if (kind == kC2C) {
    plan = F::c2c(dims, how, reinterpret_cast<typename F::C*>(pin),
                  reinterpret_cast<typename F::C*>(pout), sign, flags);
  } else if (kind == kR2C) {
    plan = F::r2c(dims, how, reinterpret_cast<R*>(pin), reinterpret_cast<typename F::C*>(pout),
                  flags);
  } else {
    // kC2R keeps the input: it belongs to TensorFlow.
    plan = F::c2r(dims, how, reinterpret_cast<typename F::C*>(pin), reinterpret_cast<R*>(pout),
                  kind == kC2R ? (flags | FFTW_PRESERVE_INPUT) : flags);
  }
  if (scratch_in) F::free(scratch_in);
  if (scratch_out) F::free(scratch_out);
  return plan;
}

template <typename R, typename In, typename Out>
void* get_plan(int kind, int sign, const Piece& p, In* in, Out* out) {
  bool in_place = static_cast<void*>(in) == static_cast<void*>(out);
  PlanKey key(kind, Fftw<R>::kPrecision, sign, p.n, p.in_len, p.out_len, p.inner,
              p.outer_count, p.inner_count,
              static_cast<int>(reinterpret_cast<uintptr_t>(in) % 64),
              static_cast<int>(reinterpret_cast<uintptr_t>(out) % 64), in_place);
  std::lock_guard<std::mutex> lock(planner_mutex());
  auto& cache = plan_cache();
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  void* plan = make_plan<R>(kind, sign, p, in, out, in_place);
  if (plan) cache[key] = plan;  // plans live for the process
  return plan;
}

// ---------------------------------------------------------------- shared kernel code
struct Geometry {
  i64 outer = 1, inner = 1;
};

Geometry geometry(const TensorShape& s, int axis) {
  Geometry g;
  for (int d = 0; d < axis; ++d) g.outer *= s.dim_size(d);
  for (int d = axis + 1; d < s.dims(); ++d) g.inner *= s.dim_size(d);
  return g;
}

template <typename R>
typename Fftw<R>::C* fw(std::complex<R>* p) {
  return reinterpret_cast<typename Fftw<R>::C*>(p);
}
template <typename R>
R* fw(R* p) {
  return p;
}

// Work per panel: about this many bytes, so that a panel stays in cache.
constexpr i64 kPanelBytes = 1 << 17;
// Row stride of the panel buffers: `block` + kPanelPad elements. A power-of-two
// stride (block = 64 or 128 columns at n = 256 or 128) maps a column's elements to a
// few cache sets; 2 more (rows stay 16-byte aligned) made the strided transforms
// 1.5-2.6x faster at n = 128 and 256 here (complex64, 1 thread), no change at 192.
constexpr i64 kPanelPad = 2;
// Below this many values the thread pool costs more than it saves.
constexpr i64 kMinParallel = 1 << 15;

// Variants of the real transforms along the axis (the layouts of in/out):
//   kHalf: r2c writes / c2r reads the n // 2 + 1 non-negative frequencies;
//   kFull: r2c writes all n modes (the upper half as the complex conjugates of
//          the lower: the DFT of a real input); c2r reads n modes and returns
//          Re(inverse DFT), computed as the c2r of the Hermitian part
//          (x_k + conj(x_{n-k})) / 2, k <= n // 2;
//   kPacked (even n): r2c writes / c2r reads n // 2 values, the zero mode's slot
//          holding the two real modes zero and Nyquist as x_0 + i x_{n/2}.
enum RealLayout { kHalf = 0, kFull = 1, kPacked = 2 };

// Mirror-pair order of the modes along an axis (flowpm_mtf.layout.k_order):
// 0, n/2, 1, n-1, 2, n-2, .. (even n), 0, 1, n-1, 2, n-2, .. (odd n). Returns the
// position of each numpy-order mode j (the inverse of k_order).
std::vector<i64> pair_positions(i64 n) {
  std::vector<i64> pos(n);
  pos[0] = 0;
  const i64 head = (n % 2 == 0 && n > 1) ? 2 : 1;
  if (head == 2) pos[n / 2] = 1;
  for (i64 j = 1; j <= (n - 1) / 2; ++j) {
    pos[j] = head + 2 * (j - 1);
    pos[n - j] = head + 2 * (j - 1) + 1;
  }
  return pos;
}

// The passes around the half-length complex FFT of the packed real transforms, on
// interleaved (re, im) rows of h values, with w = (re, im) of exp(-2 pi i k / n) for
// k < h and c a real factor. Pairs (k, h - k) use w_(h-k) = -conj(w_k).
//   post (r2c): z = FFT of x_2m + i x_2m+1. With a = z_k, b = conj(z_h-k),
//     e = c (a + b) / 2, t = w_k (a - b) / 2i: X_k = e + t, X_h-k = conj(e - t), and slot
//     0 = c ((Re z_0 + Im z_0) + i (Re z_0 - Im z_0)).
//   pre (c2r): with a = X_k, b = conj(X_h-k), s = c (a + b), t = i c (a - b) conj(w_k):
//     Z_k = s + t, Z_h-k = conj(s - t), Z_0 = c ((X_0 + X_h) + i (X_0 - X_h)) (slot 0 =
//     X_0 + i X_h); the inverse FFT of Z, read as reals, is n times the real row.
// Separate input and output rows (restrict): the loops vectorise; an AVX2 clone is
// chosen at load time.
template <typename R>
__attribute__((target_clones("avx2", "default"))) void packed_post(
    const R* __restrict z, R* __restrict out, const R* __restrict w, int64_t h, R c) {
  out[0] = c * (z[0] + z[1]);
  out[1] = c * (z[0] - z[1]);
  const R half = R(0.5) * c;
  const int64_t top = (h + 1) / 2;  // k < h - k
  for (int64_t k = 1; k < top; ++k) {
    const int64_t kk = h - k;
    const R ar = z[2 * k], ai = z[2 * k + 1], br = z[2 * kk], bi = -z[2 * kk + 1];
    const R er = half * (ar + br), ei = half * (ai + bi);
    const R odr = half * (ai - bi), odi = -half * (ar - br);  // (a - b) / 2i
    const R tr = w[2 * k] * odr - w[2 * k + 1] * odi;
    const R ti = w[2 * k] * odi + w[2 * k + 1] * odr;
    out[2 * k] = er + tr;
    out[2 * k + 1] = ei + ti;
    out[2 * kk] = er - tr;
    out[2 * kk + 1] = ti - ei;
  }
  if (h % 2 == 0 && h >= 2) {  // k = h/2, its own partner: X = c conj(z)
    out[h] = c * z[h];
    out[h + 1] = -c * z[h + 1];
  }
}

template <typename R>
__attribute__((target_clones("avx2", "default"))) void packed_pre(
    const R* __restrict x, R* __restrict z, const R* __restrict w, int64_t h, R c) {
  z[0] = c * (x[0] + x[1]);
  z[1] = c * (x[0] - x[1]);
  const int64_t top = (h + 1) / 2;
  for (int64_t k = 1; k < top; ++k) {
    const int64_t kk = h - k;
    const R ar = x[2 * k], ai = x[2 * k + 1], br = x[2 * kk], bi = -x[2 * kk + 1];
    const R sr = c * (ar + br), si = c * (ai + bi);
    const R ur = -c * (ai - bi), ui = c * (ar - br);  // i c (a - b)
    const R tr = ur * w[2 * k] + ui * w[2 * k + 1];   // times conj(w_k)
    const R ti = ui * w[2 * k] - ur * w[2 * k + 1];
    z[2 * k] = sr + tr;
    z[2 * k + 1] = si + ti;
    z[2 * kk] = sr - tr;
    z[2 * kk + 1] = ti - si;
  }
  if (h % 2 == 0 && h >= 2) {  // k = h/2: Z = 2 c conj(X)
    z[h] = R(2) * c * x[h];
    z[h + 1] = R(-2) * c * x[h + 1];
  }
}

template <typename T>
T conj_of(const T& v) {
  return v;
}
template <typename R>
std::complex<R> conj_of(const std::complex<R>& v) {
  return std::conj(v);
}

// The transform of `kind` along the middle axis of in [outer, in_len, inner]
// into out [outer, out_len, inner] (transform length n), times 1/n when
// `normalized`. Returns false if FFTW could not plan.
//
// Blocked layouts (in_blocks / out_blocks > 1, the pieces of an all-to-all): the
// array is stored as [blocks, outer, len / blocks, inner], the transform axis split
// into `blocks` blocks with the block index first. Row j of batch o is then at
// (j / lb) * outer * lb * inner + o * lb * inner + (j % lb) * inner (lb = len / blocks),
// which for one block is the plain layout. The copies into and out of the panel
// buffers read and write these rows directly, so the exchange needs no transpose.
//
// Along the last axis (inner == 1) the rows are contiguous: the threads each
// take a group of rows, transformed in place in the tensors. Along any other
// axis the transforms are strided by `inner` elements (often a multiple of
// 4 kB: cache-set conflicts); the threads each take [in_len, block] panels of
// `block` neighbouring columns, copy them into a buffer with a short row
// stride, transform there (FFTW vectorises across the columns) and copy the
// result out.
template <typename R, typename In, typename Out>
bool run_transform(OpKernelContext* ctx, int kind, int sign, const In* in_c, Out* out, i64 outer,
                   i64 n, i64 in_len, i64 out_len, i64 inner, bool normalized,
                   int layout = kHalf, i64 in_blocks = 1, i64 out_blocks = 1,
                   const i64* in_perm = nullptr, const i64* out_perm = nullptr) {
  typedef Fftw<R> F;
  typedef std::complex<R> Cx;
  // FFTW's signature; the input is written only when it is the output (forward_packed)
  In* in = const_cast<In*>(in_c);
  const R s = R(1) / R(n);
  const i64 m = n / 2 + 1;
  const bool fill = layout == kFull && kind == kR2C;   // write the upper half
  const bool fold = layout == kFull && kind == kC2R;   // Hermitian part first
  const bool packed = layout == kPacked;                // zero + Nyquist in one slot
  const i64 h = n / 2;
  std::vector<Cx> twiddle(packed ? h : 0);  // w^k = exp(-2 pi i k / n), k < n/2
  for (i64 k = 0; k < static_cast<i64>(twiddle.size()); ++k) {
    const double t = -2.0 * 3.14159265358979323846 * static_cast<double>(k) / static_cast<double>(n);
    twiddle[k] = Cx(static_cast<R>(std::cos(t)), static_cast<R>(std::sin(t)));
  }
  std::atomic<bool> ok(true);
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  i64 threads = workers->num_threads;
  if (outer * std::max(in_len, out_len) * inner < kMinParallel) threads = 1;
  const i64 lb_in = in_len / in_blocks, lb_out = out_len / out_blocks;
  // Offsets of row j of batch o (blocked layouts, see above); with in_perm / out_perm
  // (mirror-pair order) logical row j is stored at position perm[j].
  auto row_in = [&](i64 o, i64 j) {
    if (in_perm) j = in_perm[j];
    return (j / lb_in) * outer * lb_in * inner + o * lb_in * inner + (j % lb_in) * inner;
  };
  auto row_out = [&](i64 o, i64 j) {
    if (out_perm) j = out_perm[j];
    return (j / lb_out) * outer * lb_out * inner + o * lb_out * inner + (j % lb_out) * inner;
  };

  // `oc` contiguous rows pin -> pout (plain layouts): the transform, with the
  // Hermitian fold first (into `buf`, oc * m values) or the upper half filled after,
  // then the normalisation. False if FFTW could not plan.
  auto contiguous_rows = [&](In* pin, Out* pout, i64 oc, Cx* buf) {
    void* plan = nullptr;
    if (packed && kind == kR2C) {
      // The real row as h = n/2 complex values z_m = x_2m + i x_2m+1, a complex FFT of
      // length h (FFTW's estimated real-to-complex plans are ~2x slower here), then
      // X_k = E_k + w^k O_k with E_k = (Z_k + conj Z_h-k) / 2, O_k = (Z_k - conj Z_h-k)
      // / 2i, w = exp(-2 pi i / n) (packed_post, from the work buffer); slot 0 = X_0 +
      // i X_h = (Re Z_0 + Im Z_0) + i (Re Z_0 - Im Z_0). The normalisation rides along.
      Piece p{h, h, h, 1, oc, 1};
      Cx* zin = reinterpret_cast<Cx*>(pin);
      plan = get_plan<R>(kC2C, FFTW_FORWARD, p, fw<R>(zin), fw<R>(buf));
      if (!plan) return false;
      F::exec(static_cast<typename F::Plan>(plan), fw<R>(zin), fw<R>(buf));
      const R sc = normalized ? s : R(1);
      const R* wt = reinterpret_cast<const R*>(twiddle.data());
      for (i64 o = 0; o < oc; ++o)
        packed_post<R>(reinterpret_cast<const R*>(buf + o * h),
                       reinterpret_cast<R*>(pout) + 2 * o * h, wt, h, sc);
      return true;
    } else if (packed) {  // the inverse (see packed_pre), then a complex inverse FFT
      const R sc = normalized ? s : R(1);
      const R* wt = reinterpret_cast<const R*>(twiddle.data());
      if (static_cast<void*>(pin) == static_cast<void*>(pout)) {  // forwarded input
        std::memcpy(buf, pin, sizeof(Cx) * oc * h);  // packed_pre does not work in place
        pin = reinterpret_cast<In*>(buf);
      }
      for (i64 o = 0; o < oc; ++o)  // into the output rows (n reals = h complex), in place
        packed_pre<R>(reinterpret_cast<const R*>(pin) + 2 * o * h,
                      reinterpret_cast<R*>(pout) + 2 * o * h, wt, h, sc);
      Piece p{h, h, h, 1, oc, 1};
      Cx* zout = reinterpret_cast<Cx*>(pout);
      plan = get_plan<R>(kC2C, FFTW_BACKWARD, p, fw<R>(zout), fw<R>(zout));
      if (!plan) return false;
      F::exec(static_cast<typename F::Plan>(plan), fw<R>(zout), fw<R>(zout));
      return true;
    } else if (fold) {  // rows of n modes -> buffer of m Hermitian modes -> c2r
      const Cx* src = reinterpret_cast<const Cx*>(pin);
      for (i64 o = 0; o < oc; ++o)
        for (i64 k = 0; k < m; ++k)
          buf[o * m + k] = R(0.5) * (src[o * n + k] + std::conj(src[o * n + (n - k) % n]));
      Piece p{n, m, n, 1, oc, 1};
      plan = get_plan<R>(kC2RDestroy, sign, p, fw<R>(buf), fw<R>(pout));
      if (plan) F::exec(static_cast<typename F::Plan>(plan), fw<R>(buf), fw<R>(pout));
    } else {
      Piece p{n, in_len, out_len, 1, oc, 1};
      plan = get_plan<R>(kind, sign, p, fw<R>(pin), fw<R>(pout));
      if (plan) F::exec(static_cast<typename F::Plan>(plan), fw<R>(pin), fw<R>(pout));
    }
    if (!plan) return false;
    if (fill)
      for (i64 o = 0; o < oc; ++o)
        for (i64 k = m; k < n; ++k) pout[o * n + k] = conj_of(pout[o * n + n - k]);
    if (normalized)
      for (i64 i = 0; i < oc * out_len; ++i) pout[i] *= s;
    return true;
  };

  // work buffer per row group (a packed c2r in place copies its rows there first)
  const bool in_place = static_cast<const void*>(in_c) == static_cast<const void*>(out);
  const bool need_buf = fold || (packed && (kind == kR2C || in_place));
  const bool grouped = need_buf || packed;
  if (inner == 1 && (in_blocks > 1 || out_blocks > 1 || in_perm || out_perm || grouped)) {
    // Contiguous rows, blocked (or permuted) on one side or both, or through a work
    // buffer (fold, packed): groups of rows that fit a cache panel are gathered into a
    // buffer (blocked input), transformed as in the plain case below, and scattered
    // from a buffer (blocked output); the work buffer stays in cache.
    const i64 rows = std::max<i64>(1, kPanelBytes / (std::max(in_len, out_len) *
                                                     static_cast<i64>(sizeof(Cx))));
    const i64 groups = (outer + rows - 1) / rows;
    auto work = [&](int64_t begin, int64_t end) {
      const bool gather = in_blocks > 1 || in_perm, scatter = out_blocks > 1 || out_perm;
      In* tin = gather ? static_cast<In*>(F::malloc(sizeof(In) * rows * in_len)) : nullptr;
      Out* tout = scatter ? static_cast<Out*>(F::malloc(sizeof(Out) * rows * out_len)) : nullptr;
      Cx* buf = need_buf ? static_cast<Cx*>(F::malloc(sizeof(Cx) * rows * m)) : nullptr;
      for (i64 q = begin; q < end && ok; ++q) {
        const i64 o0 = q * rows, oc = std::min(rows, outer - o0);
        In* pin = in + o0 * in_len;
        if (tin && in_perm) {
          for (i64 o = 0; o < oc; ++o)
            for (i64 j = 0; j < in_len; ++j) tin[o * in_len + j] = in[row_in(o0 + o, j)];
          pin = tin;
        } else if (tin) {
          for (i64 o = 0; o < oc; ++o)
            for (i64 b = 0; b < in_blocks; ++b)
              std::memcpy(tin + o * in_len + b * lb_in, in + row_in(o0 + o, b * lb_in),
                          sizeof(In) * lb_in);
          pin = tin;
        }
        Out* pout = tout ? tout : out + o0 * out_len;
        if (!contiguous_rows(pin, pout, oc, buf)) {
          ok = false;
          break;
        }
        if (tout && out_perm)
          for (i64 o = 0; o < oc; ++o)
            for (i64 j = 0; j < out_len; ++j) out[row_out(o0 + o, j)] = tout[o * out_len + j];
        else if (tout)
          for (i64 o = 0; o < oc; ++o)
            for (i64 b = 0; b < out_blocks; ++b)
              std::memcpy(out + row_out(o0 + o, b * lb_out), tout + o * out_len + b * lb_out,
                          sizeof(Out) * lb_out);
      }
      if (buf) F::free(buf);
      if (tout) F::free(tout);
      if (tin) F::free(tin);
    };
    if (threads == 1 || groups == 1)
      work(0, groups);
    else
      ::tensorflow::Shard(static_cast<int>(threads), workers->workers, groups,
                          rows * std::max(in_len, out_len) * 20, work);
    return ok;
  }

  if (inner == 1) {
    i64 pieces = std::max<i64>(1, std::min(threads, outer));
    const i64 chunk = (outer + pieces - 1) / pieces;
    pieces = (outer + chunk - 1) / chunk;
    auto work = [&](int64_t begin, int64_t end) {
      for (i64 q = begin; q < end; ++q) {
        const i64 o0 = q * chunk, oc = std::min(chunk, outer - o0);
        Cx* buf = need_buf ? static_cast<Cx*>(F::malloc(sizeof(Cx) * oc * m)) : nullptr;
        const bool done = contiguous_rows(in + o0 * in_len, out + o0 * out_len, oc, buf);
        if (buf) F::free(buf);
        if (!done) {
          ok = false;
          return;
        }
      }
    };
    if (pieces == 1)
      work(0, 1);
    else  // one shard per piece: a cost far above the sharder's minimum per shard
      ::tensorflow::Shard(static_cast<int>(pieces), workers->workers, pieces, 1LL << 30, work);
    return ok;
  }

  const i64 len = std::max(in_len, out_len);
  const i64 block =
      std::min(inner, std::max<i64>(4, kPanelBytes / (len * static_cast<i64>(sizeof(In)))));
  const i64 blocks = (inner + block - 1) / block;
  const i64 ld = block + kPanelPad;  // row stride of the panel buffers
  const i64 units = outer * blocks;
  const int panel_kind = kind == kC2R ? kC2RDestroy : kind;
  const i64 buf_in_len = fold ? m : in_len;  // rows FFTW reads
  const bool same_buffer = kind == kC2C;
  auto work = [&](int64_t begin, int64_t end) {
    In* buf_in = static_cast<In*>(F::malloc(sizeof(In) * buf_in_len * ld));
    Out* buf_out =
        same_buffer ? reinterpret_cast<Out*>(buf_in)
                    : static_cast<Out*>(F::malloc(sizeof(Out) * out_len * ld));
    for (i64 u = begin; u < end && ok; ++u) {
      const i64 o = u / blocks, b0 = (u % blocks) * block, bc = std::min(block, inner - b0);
      const In* src = in + b0;
      if (fold) {
        for (i64 k = 0; k < m; ++k) {
          const In* a = src + row_in(o, k);
          const In* b = src + row_in(o, (n - k) % n);
          In* row = buf_in + k * ld;
          for (i64 i = 0; i < bc; ++i) row[i] = R(0.5) * (a[i] + conj_of(b[i]));
        }
      } else {
        for (i64 j = 0; j < in_len; ++j)
          std::memcpy(buf_in + j * ld, src + row_in(o, j), sizeof(In) * bc);
      }
      Piece p{n, buf_in_len, out_len, ld, 1, bc};
      void* plan = get_plan<R>(panel_kind, sign, p, fw<R>(buf_in), fw<R>(buf_out));
      if (!plan) {
        ok = false;
        break;
      }
      F::exec(static_cast<typename F::Plan>(plan), fw<R>(buf_in), fw<R>(buf_out));
      if (fill)
        for (i64 k = m; k < n; ++k) {
          Out* row = buf_out + k * ld;
          const Out* mirror = buf_out + (n - k) * ld;
          for (i64 i = 0; i < bc; ++i) row[i] = conj_of(mirror[i]);
        }
      Out* dst = out + b0;
      for (i64 j = 0; j < out_len; ++j) {
        Out* row = buf_out + j * ld;
        if (normalized)
          for (i64 i = 0; i < bc; ++i) row[i] *= s;
        std::memcpy(dst + row_out(o, j), row, sizeof(Out) * bc);
      }
    }
    if (!same_buffer) F::free(buf_out);
    F::free(buf_in);
  };
  if (threads == 1 || units == 1)
    work(0, units);
  else
    ::tensorflow::Shard(static_cast<int>(threads), workers->workers, units,
                        len * block * 20, work);
  return ok;
}

// The logical shape of x stored with `blocks` blocks along `axis`
// ([blocks, .., len / blocks, ..] -> [.., len, ..]; one block: x's own shape).
::tensorflow::Status logical_shape(const TensorShape& x, int axis, i64 blocks,
                                   TensorShape* out) {
  if (blocks < 1) return InvalidArgument("blocks must be >= 1, got ", blocks);
  *out = x;
  if (blocks == 1) return ::tensorflow::OkStatus();
  if (x.dims() < 2 || x.dim_size(0) != blocks)
    return InvalidArgument("a blocked input needs a leading axis of ", blocks,
                           " blocks, got shape ", x.DebugString());
  out->RemoveDim(0);
  if (axis < 0 || axis >= out->dims())
    return InvalidArgument("axis ", axis, " out of range for a tensor of rank ", out->dims());
  out->set_dim(axis, out->dim_size(axis) * blocks);
  return ::tensorflow::OkStatus();
}

// The stored shape of a logical shape with `blocks` blocks along `axis`.
::tensorflow::Status blocked_shape(const TensorShape& logical, int axis, i64 blocks,
                                   TensorShape* out) {
  if (blocks < 1) return InvalidArgument("blocks must be >= 1, got ", blocks);
  *out = logical;
  if (blocks == 1) return ::tensorflow::OkStatus();
  if (logical.dim_size(axis) % blocks)
    return InvalidArgument("axis ", axis, " of length ", logical.dim_size(axis),
                           " does not split into ", blocks, " blocks");
  out->set_dim(axis, logical.dim_size(axis) / blocks);
  out->InsertDim(0, blocks);
  return ::tensorflow::OkStatus();
}

void checked_axis(OpKernelContext* ctx, int axis, const TensorShape& s) {
  OP_REQUIRES(ctx, axis >= 0 && axis < s.dims(),
              InvalidArgument("axis ", axis, " out of range for a tensor of rank ", s.dims()));
}

::tensorflow::Status plan_failed(const char* what) {
  return ::tensorflow::errors::Internal("FFTW could not plan the ", what, " transform");
}

// ---------------------------------------------------------------- c2c
template <typename R>
class C2COp : public OpKernel {
 public:
  explicit C2COp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("axis", &axis_));
    OP_REQUIRES_OK(c, c->GetAttr("inverse", &inverse_));
    OP_REQUIRES_OK(c, c->GetAttr("normalized", &normalized_));
    OP_REQUIRES_OK(c, c->GetAttr("in_blocks", &in_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("out_blocks", &out_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("in_pairs", &in_pairs_));
    OP_REQUIRES_OK(c, c->GetAttr("out_pairs", &out_pairs_));
  }

  void Compute(OpKernelContext* ctx) override {
    typedef std::complex<R> Cx;
    const Tensor& x = ctx->input(0);
    TensorShape ls, os;
    OP_REQUIRES_OK(ctx, logical_shape(x.shape(), axis_, in_blocks_, &ls));
    checked_axis(ctx, axis_, ls);
    if (!ctx->status().ok()) return;
    OP_REQUIRES_OK(ctx, blocked_shape(ls, axis_, out_blocks_, &os));
    // In place when TensorFlow lets us reuse the input buffer, also with the pair
    // orders: every panel (row group) reads all its rows before it writes them.
    Tensor* y = nullptr;
    if (in_blocks_ == 1 && out_blocks_ == 1)
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, os, &y));
    else
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, os, &y));
    if (x.NumElements() == 0) return;
    const i64 n = ls.dim_size(axis_);
    Geometry g = geometry(ls, axis_);
    const std::vector<i64> pos = pair_positions(n);
    OP_REQUIRES(ctx,
                run_transform<R>(ctx, kC2C, inverse_ ? FFTW_BACKWARD : FFTW_FORWARD,
                                 x.flat<Cx>().data(), y->flat<Cx>().data(), g.outer, n, n, n,
                                 g.inner, normalized_, kHalf, in_blocks_, out_blocks_,
                                 in_pairs_ ? pos.data() : nullptr,
                                 out_pairs_ ? pos.data() : nullptr),
                plan_failed("c2c"));
  }

 private:
  int axis_;
  bool inverse_, normalized_, in_pairs_, out_pairs_;
  ::tensorflow::int64 in_blocks_, out_blocks_;
};

// The packed transforms (r2c / c2r, packed = true, one block each side) write n reals
// per row where they read n / 2 complex values, or the converse: the same bytes at the
// same offsets. When TensorFlow lets us take over the input's buffer (a computed tensor
// that nothing else holds: `forward_input` with the input's own type and shape), the
// output is that buffer reinterpreted as the output type, so the transform runs in place
// and allocates no output (at 512^3, 537 MB that would otherwise be touched afresh).
// Each row group is read whole (into the FFT's work buffer) before its rows are written
// (run_transform), and the groups are disjoint, so in place gives the same bits.
// *y is left null when the input cannot be taken over.
template <typename Out>
::tensorflow::Status forward_packed(OpKernelContext* ctx, const TensorShape& out_shape,
                                    Tensor** y) {
  const Tensor& x = ctx->input(0);
  std::unique_ptr<Tensor> taken = ctx->forward_input(
      0, 0, x.dtype(), x.shape(), ::tensorflow::DEVICE_MEMORY, ctx->output_alloc_attr(0));
  if (!taken) return ::tensorflow::OkStatus();
  Tensor out;
  TF_RETURN_IF_ERROR(out.BitcastFrom(*taken, ::tensorflow::DataTypeToEnum<Out>::v(), out_shape));
  ctx->set_output(0, out);
  *y = ctx->mutable_output(0);
  return ::tensorflow::OkStatus();
}

// ---------------------------------------------------------------- r2c
template <typename R>
class R2COp : public OpKernel {
 public:
  explicit R2COp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("axis", &axis_));
    OP_REQUIRES_OK(c, c->GetAttr("normalized", &normalized_));
    OP_REQUIRES_OK(c, c->GetAttr("full", &full_));
    OP_REQUIRES_OK(c, c->GetAttr("packed", &packed_));
    OP_REQUIRES_OK(c, c->GetAttr("in_blocks", &in_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("out_blocks", &out_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("out_pairs", &out_pairs_));
    OP_REQUIRES(c, !(full_ && packed_), InvalidArgument("r2c: full and packed exclude each other"));
    OP_REQUIRES(c, full_ || packed_ || (in_blocks_ == 1 && out_blocks_ == 1),
                InvalidArgument("r2c: blocked layouts need full or packed"));
    OP_REQUIRES(c, full_ || !out_pairs_, InvalidArgument("r2c: out_pairs needs full = true"));
  }

  void Compute(OpKernelContext* ctx) override {
    typedef std::complex<R> Cx;
    const Tensor& x = ctx->input(0);
    TensorShape ls, os;
    OP_REQUIRES_OK(ctx, logical_shape(x.shape(), axis_, in_blocks_, &ls));
    checked_axis(ctx, axis_, ls);
    if (!ctx->status().ok()) return;
    const i64 n = ls.dim_size(axis_);
    OP_REQUIRES(ctx, n >= 1, InvalidArgument("r2c: the transform length must be >= 1"));
    if (packed_) {
      OP_REQUIRES(ctx, n % 2 == 0 && n >= 2,
                  InvalidArgument("r2c: packed needs an even length, got ", n));
      OP_REQUIRES(ctx, axis_ == ls.dims() - 1,
                  InvalidArgument("r2c: packed needs the last axis, got axis ", axis_));
    }
    const i64 m = full_ ? n : packed_ ? n / 2 : n / 2 + 1;
    TensorShape lo = ls;
    lo.set_dim(axis_, m);
    OP_REQUIRES_OK(ctx, blocked_shape(lo, axis_, out_blocks_, &os));
    Tensor* y = nullptr;
    if (packed_ && in_blocks_ == 1 && out_blocks_ == 1)
      OP_REQUIRES_OK(ctx, forward_packed<Cx>(ctx, os, &y));
    if (y == nullptr) OP_REQUIRES_OK(ctx, ctx->allocate_output(0, os, &y));
    if (y->NumElements() == 0) return;
    Geometry g = geometry(ls, axis_);
    OP_REQUIRES(ctx,
                run_transform<R>(ctx, kR2C, 0, x.flat<R>().data(), y->flat<Cx>().data(), g.outer,
                                 n, n, m, g.inner, normalized_,
                                 full_ ? kFull : packed_ ? kPacked : kHalf, in_blocks_,
                                 out_blocks_, nullptr,
                                 out_pairs_ ? pair_positions(n).data() : nullptr),
                plan_failed("r2c"));
  }

 private:
  int axis_;
  bool normalized_, full_, packed_, out_pairs_;
  ::tensorflow::int64 in_blocks_, out_blocks_;
};

// ---------------------------------------------------------------- c2r
template <typename R>
class C2ROp : public OpKernel {
 public:
  explicit C2ROp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("axis", &axis_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("normalized", &normalized_));
    OP_REQUIRES_OK(c, c->GetAttr("full", &full_));
    OP_REQUIRES(c, n_ >= 1, InvalidArgument("c2r: the transform length n must be >= 1"));
    OP_REQUIRES_OK(c, c->GetAttr("packed", &packed_));
    OP_REQUIRES_OK(c, c->GetAttr("in_blocks", &in_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("out_blocks", &out_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("in_pairs", &in_pairs_));
    OP_REQUIRES(c, !(full_ && packed_), InvalidArgument("c2r: full and packed exclude each other"));
    OP_REQUIRES(c, full_ || packed_ || (in_blocks_ == 1 && out_blocks_ == 1),
                InvalidArgument("c2r: blocked layouts need full or packed"));
    OP_REQUIRES(c, full_ || !in_pairs_, InvalidArgument("c2r: in_pairs needs full = true"));
    OP_REQUIRES(c, !packed_ || n_ % 2 == 0,
                InvalidArgument("c2r: packed needs an even length n, got ", n_));
  }

  void Compute(OpKernelContext* ctx) override {
    typedef std::complex<R> Cx;
    const Tensor& x = ctx->input(0);
    TensorShape ls, os;
    OP_REQUIRES_OK(ctx, logical_shape(x.shape(), axis_, in_blocks_, &ls));
    checked_axis(ctx, axis_, ls);
    if (!ctx->status().ok()) return;
    const i64 n = n_, m = full_ ? n_ : packed_ ? n_ / 2 : n_ / 2 + 1;
    OP_REQUIRES(ctx, ls.dim_size(axis_) == m,
                InvalidArgument("c2r: axis ", axis_, " has length ", ls.dim_size(axis_),
                                ", expected ", full_ ? "n = " : packed_ ? "n // 2 = " : "n // 2 + 1 = ",
                                m, " for n = ", n));
    OP_REQUIRES(ctx, !packed_ || axis_ == ls.dims() - 1,
                InvalidArgument("c2r: packed needs the last axis, got axis ", axis_));
    TensorShape lo = ls;
    lo.set_dim(axis_, n);
    OP_REQUIRES_OK(ctx, blocked_shape(lo, axis_, out_blocks_, &os));
    Tensor* y = nullptr;
    if (packed_ && in_blocks_ == 1 && out_blocks_ == 1 && !in_pairs_)
      OP_REQUIRES_OK(ctx, forward_packed<R>(ctx, os, &y));
    if (y == nullptr) OP_REQUIRES_OK(ctx, ctx->allocate_output(0, os, &y));
    if (y->NumElements() == 0) return;
    Geometry g = geometry(ls, axis_);
    OP_REQUIRES(ctx,
                run_transform<R>(ctx, kC2R, 0, x.flat<Cx>().data(), y->flat<R>().data(), g.outer,
                                 n, m, n, g.inner, normalized_,
                                 full_ ? kFull : packed_ ? kPacked : kHalf, in_blocks_,
                                 out_blocks_, in_pairs_ ? pair_positions(n).data() : nullptr),
                plan_failed("c2r"));
  }

 private:
  int axis_;
  ::tensorflow::int64 n_;
  bool normalized_, full_, packed_, in_pairs_;
  ::tensorflow::int64 in_blocks_, out_blocks_;
};


// ---------------------------------------------------------------- mirror-pair completion / fold
// x: [nx, ly, L] complex, kx (all nx modes) and ky (a block of ly positions, the
// first block when first_y) in mirror-pair order, whose mirrors are local: position p
// of an even-length axis mirrors p for p < 2 in the first block, p ^ 1 otherwise.
// The last axis holds kz: a block of 2 h positions in pair order (full side) or the h
// representatives j of its pairs (half side), whose zero-mode slot of the first block
// (first_z) packs the modes 0 and n/2 as A + i B.
//   fold=false (extend, h -> 2 h): y[p, r, 2 j] = x[p, r, j],
//     y[p, r, 2 j + 1] = conj(x[p', r', j]); in the packed slot A = (P + conj(P')) / 2,
//     B = (P - conj(P')) / (2 i) with P = x[p, r, 0], P' = x[p', r', 0].
//   fold=true (2 h -> h): y[p, r, j] = (x[p, r, 2 j] + conj(x[p', r', 2 j + 1])) / 2, the
//     Hermitian part at the representative; the packed slot A + i B with
//     A = (x[p, r, 0] + conj(x[p', r', 0])) / 2, B = (x[p, r, 1] + conj(x[p', r', 1])) / 2.
// firsts: int32 [2], (first_y, first_z) as 0 / 1 (the rank's block indices are 0).
template <typename R>
class PairsOp : public OpKernel {
 public:
  explicit PairsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("fold", &fold_));
  }

  void Compute(OpKernelContext* ctx) override {
    typedef std::complex<R> Cx;
    const Tensor& x = ctx->input(0);
    const Tensor& firsts = ctx->input(1);
    OP_REQUIRES(ctx, x.dims() == 3,
                InvalidArgument("pairs: x must have rank 3, got ", x.shape().DebugString()));
    OP_REQUIRES(ctx, firsts.NumElements() == 2,
                InvalidArgument("pairs: firsts must hold 2 values"));
    const i64 nx = x.dim_size(0), ly = x.dim_size(1), len = x.dim_size(2);
    OP_REQUIRES(ctx, nx % 2 == 0 && ly % 2 == 0,
                InvalidArgument("pairs: the kx and ky extents must be even, got ", nx, ", ", ly));
    OP_REQUIRES(ctx, !fold_ || len % 2 == 0,
                InvalidArgument("pairs: fold needs an even kz extent, got ", len));
    const auto f = firsts.flat<int32_t>();
    const bool first_y = f(0) != 0, first_z = f(1) != 0;
    const i64 h = fold_ ? len / 2 : len, out_len = fold_ ? h : 2 * h;
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nx, ly, out_len}), &y));
    if (y->NumElements() == 0) return;
    const Cx* in = x.flat<Cx>().data();
    Cx* out = y->flat<Cx>().data();
    const bool fold = fold_;
    auto mirror = [](i64 p, bool first) { return (first && p < 2) ? p : (p ^ 1); };
    auto work = [&](i64 r0, i64 r1) {
      for (i64 row = r0; row < r1; ++row) {
        const i64 p = row / ly, r = row % ly;
        const Cx* src = in + row * len;
        const Cx* mir = in + (mirror(p, true) * ly + mirror(r, first_y)) * len;
        Cx* dst = out + row * out_len;
        i64 j0 = 0;
        if (first_z) {
          j0 = 1;
          if (fold) {
            const Cx a = R(0.5) * (src[0] + std::conj(mir[0]));
            const Cx b = R(0.5) * (src[1] + std::conj(mir[1]));
            dst[0] = a + Cx(-b.imag(), b.real());
          } else {
            const Cx P = src[0], Pm = std::conj(mir[0]);
            const Cx d = P - Pm;
            dst[0] = R(0.5) * (P + Pm);
            dst[1] = R(0.5) * Cx(d.imag(), -d.real());  // (P - conj(P')) / (2 i)
          }
        }
        if (fold) {
          for (i64 j = j0; j < h; ++j)
            dst[j] = R(0.5) * (src[2 * j] + std::conj(mir[2 * j + 1]));
        } else {
          for (i64 j = j0; j < h; ++j) {
            dst[2 * j] = src[j];
            dst[2 * j + 1] = std::conj(mir[j]);
          }
        }
      }
    };
    shard(ctx, nx * ly, (len + out_len) * 4, work);
  }

 private:
  bool fold_;
};

// ---------------------------------------------------------------- registration
// Output shape of a 1D transform along `axis` with blocked layouts (attrs in_blocks,
// out_blocks): the input's logical shape, the axis length mapped by `length` (a
// known input length -> the output length), stored with out_blocks.
template <typename F>
::tensorflow::Status transform_shape(InferenceContext* c, F length) {
  int axis;
  ::tensorflow::int64 in_blocks, out_blocks;
  TF_RETURN_IF_ERROR(c->GetAttr("axis", &axis));
  TF_RETURN_IF_ERROR(c->GetAttr("in_blocks", &in_blocks));
  TF_RETURN_IF_ERROR(c->GetAttr("out_blocks", &out_blocks));
  if (!c->RankKnown(c->input(0))) {
    c->set_output(0, c->UnknownShape());
    return ::tensorflow::OkStatus();
  }
  ShapeHandle x = c->input(0);
  const int lead = in_blocks > 1 ? 1 : 0;
  if (axis < 0 || axis + lead >= c->Rank(x))
    return InvalidArgument("axis ", axis, " out of range for rank ", c->Rank(x) - lead);
  ShapeHandle logical = x;
  DimensionHandle d = c->Dim(x, axis + lead);
  if (lead) {
    DimensionHandle b = c->Dim(x, 0);
    if (c->ValueKnown(b) && c->Value(b) != in_blocks)
      return InvalidArgument("a blocked input needs a leading axis of ", in_blocks,
                             " blocks, got ", c->Value(b));
    TF_RETURN_IF_ERROR(c->Subshape(x, 1, &logical));
    if (c->ValueKnown(d)) d = c->MakeDim(c->Value(d) * in_blocks);
    else d = c->UnknownDim();
  }
  DimensionHandle out_len = c->ValueKnown(d) ? c->MakeDim(length(c->Value(d))) : c->UnknownDim();
  if (out_blocks > 1) {
    if (c->ValueKnown(out_len)) {
      if (c->Value(out_len) % out_blocks)
        return InvalidArgument("axis ", axis, " of length ", c->Value(out_len),
                               " does not split into ", out_blocks, " blocks");
      out_len = c->MakeDim(c->Value(out_len) / out_blocks);
    }
  }
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(logical, axis, out_len, &out));
  if (out_blocks > 1)
    TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(out_blocks), out, &out));
  c->set_output(0, out);
  return ::tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("FlowpmFftC2c")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {complex64, complex128}")
    .Attr("axis: int")
    .Attr("inverse: bool")
    .Attr("normalized: bool")
    .Attr("in_blocks: int = 1")
    .Attr("out_blocks: int = 1")
    .Attr("in_pairs: bool = false")
    .Attr("out_pairs: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      return transform_shape(c, [](i64 len) { return len; });
    })
    .Doc("1D complex FFT along `axis` (FFTW); times 1/n when `normalized`. With "
         "in_blocks / out_blocks > 1 the input / output is stored as the pieces of an "
         "all-to-all: [blocks, .., len / blocks along axis, ..].");

REGISTER_OP("FlowpmFftR2c")
    .Input("x: Treal")
    .Output("y: Tcomplex")
    .Attr("Treal: {float, double}")
    .Attr("Tcomplex: {complex64, complex128}")
    .Attr("axis: int")
    .Attr("normalized: bool")
    .Attr("full: bool = false")
    .Attr("packed: bool = false")
    .Attr("in_blocks: int = 1")
    .Attr("out_blocks: int = 1")
    .Attr("out_pairs: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      bool full, packed;
      TF_RETURN_IF_ERROR(c->GetAttr("full", &full));
      TF_RETURN_IF_ERROR(c->GetAttr("packed", &packed));
      return transform_shape(
          c, [full, packed](i64 len) { return full ? len : packed ? len / 2 : len / 2 + 1; });
    })
    .Doc("Real-to-complex 1D FFT along `axis` (numpy.fft.rfft; with `full`, all n modes: "
         "numpy.fft.fft of the real input), times 1/n when `normalized`.");

REGISTER_OP("FlowpmFftC2r")
    .Input("x: Tcomplex")
    .Output("y: Treal")
    .Attr("Treal: {float, double}")
    .Attr("Tcomplex: {complex64, complex128}")
    .Attr("n: int")
    .Attr("axis: int")
    .Attr("normalized: bool")
    .Attr("full: bool = false")
    .Attr("packed: bool = false")
    .Attr("in_blocks: int = 1")
    .Attr("out_blocks: int = 1")
    .Attr("in_pairs: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::int64 n;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      return transform_shape(c, [n](i64) { return static_cast<i64>(n); });
    })
    .Doc("Complex-to-real 1D FFT along `axis` (numpy.fft.irfft when `normalized`; with "
         "`full`, n input modes: numpy.fft.ifft(x).real).");

REGISTER_OP("FlowpmPairs")
    .Input("x: T")
    .Input("firsts: int32")
    .Output("y: T")
    .Attr("T: {complex64, complex128}")
    .Attr("fold: bool")
    .SetShapeFn([](InferenceContext* c) {
      bool fold;
      TF_RETURN_IF_ERROR(c->GetAttr("fold", &fold));
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
      DimensionHandle d = c->Dim(x, 2), out;
      if (!c->ValueKnown(d)) out = c->UnknownDim();
      else out = c->MakeDim(fold ? c->Value(d) / 2 : 2 * c->Value(d));
      ShapeHandle y;
      TF_RETURN_IF_ERROR(c->ReplaceDim(x, 2, out, &y));
      c->set_output(0, y);
      return ::tensorflow::OkStatus();
    })
    .Doc("Full <-> half spectrum of a real field's transform in mirror-pair order "
         "(fold=false: completion from the representatives; fold=true: Hermitian part).");

#define REGISTER(R, C)                                                                    \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("FlowpmFftC2c").Device(::tensorflow::DEVICE_CPU).TypeConstraint<C>("T"),       \
      C2COp<R>);                                                                          \
  REGISTER_KERNEL_BUILDER(Name("FlowpmFftR2c")                                            \
                              .Device(::tensorflow::DEVICE_CPU)                           \
                              .TypeConstraint<R>("Treal")                                 \
                              .TypeConstraint<C>("Tcomplex"),                             \
                          R2COp<R>);                                                      \
  REGISTER_KERNEL_BUILDER(Name("FlowpmFftC2r")                                            \
                              .Device(::tensorflow::DEVICE_CPU)                           \
                              .TypeConstraint<R>("Treal")                                 \
                              .TypeConstraint<C>("Tcomplex"),                             \
                          C2ROp<R>);                                                      \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("FlowpmPairs").Device(::tensorflow::DEVICE_CPU).TypeConstraint<C>("T"),        \
      PairsOp<R>);

REGISTER(float, ::tensorflow::complex64)
REGISTER(double, ::tensorflow::complex128)
