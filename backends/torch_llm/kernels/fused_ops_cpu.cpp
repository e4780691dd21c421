// Fused elementwise steps of a Llama decoder layer for CPU: each replaces a chain of 4-8 small
// torch ops (one dispatch, one temporary and one pass over memory each) by one pass. Built at first
// use by torch.utils.cpp_extension (backends/torch_llm/kernels/fused_cpu.py).
//
// The arithmetic is the reference model's, op for op, in the same precision: an intermediate the
// reference rounds to the tensor's dtype is rounded here too, and the build does not contract
// a * b + c into one FMA, so the residual adds, the rotary embedding and the products are bit-identical
// to torch's for float32. Two results may differ in the last bit: the mean of squares in RMSNorm
// (another summation order) and silu's exp (a polynomial here, torch's own vectorized one there).
//
// Rows are independent; they are split over torch's intra-op threads only when there are enough of
// them to pay for waking the threads (a prefill chunk), not for a decode step's few rows. Every
// kernel releases the GIL while it computes, as torch's own ops do (the engine steps on a thread
// beside the gateway's event loop). They write through data pointers: for inference only
// (the runner runs under `torch.inference_mode`), not for tensors autograd tracks.
#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// elements per thread below which a row range stays on the calling thread
constexpr int64_t kGrainElements = 1 << 17;  // measured: waking the threads costs more below

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// out = weight * to_T(x * rsqrt(mean(x^2) + eps)), the mean in float32 (as the reference RMSNorm)
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < H; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const T normed = round_to<T>(static_cast<float>(x[i]) * inv);
    out[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row<T>(xp + r * H, wp, op + r * H, H, static_cast<float>(eps));
  });
}

// residual += x; x = rms_norm(residual) (both in place): a layer's residual add and the next norm
template <typename T>
void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w, double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * H;
      T* rr = rp + r * H;
      for (int64_t i = 0; i < H; ++i) rr[i] = round_to<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      norm_row<T>(rr, wp, xr, H, static_cast<float>(eps));
    }
  });
}

// The first `heads` heads of every row of x ([T, row_stride], heads of D) rotated in place:
// x * cos + rotate_half(x) * sin, cos and sin [T, D]
template <typename T>
void rotary_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t D) {
  const int64_t T_ = x.size(0), stride = x.stride(0), half = D / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, T_, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
          // as the reference: (x * cos) + ((-x_other) * sin), each product rounded to T
          const T lo_cos = round_to<T>(a * static_cast<float>(c[i]));
          const T lo_sin = round_to<T>(-b * static_cast<float>(s[i]));
          const T hi_cos = round_to<T>(b * static_cast<float>(c[i + half]));
          const T hi_sin = round_to<T>(a * static_cast<float>(s[i + half]));
          v[i] = round_to<T>(static_cast<float>(lo_cos) + static_cast<float>(lo_sin));
          v[i + half] = round_to<T>(static_cast<float>(hi_cos) + static_cast<float>(hi_sin));
        }
      }
    }
  });
}

// e^x for float32 in branch-free arithmetic the compiler vectorizes (libm's expf is one call per
// element): x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error
// below 2e-7 on that range, about one ulp; Horner steps as FMAs, the chain being the loop's
// latency), times 2^n built in the exponent bits.
inline float exp_approx(float x) {
  const bool overflows = x > 88.72f;  // e^x is +inf there (so silu(-x) is -0, as torch's)
  x = x < -87.0f ? -87.0f : x;  // below, e^x is under 1.7e-38: silu(-x) is x to float precision
  x = x > 88.0f ? 88.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;  // ln2 in two parts
  float p = 1.f / 720.f;
  p = __builtin_fmaf(p, r, 1.f / 120.f);
  p = __builtin_fmaf(p, r, 1.f / 24.f);
  p = __builtin_fmaf(p, r, 1.f / 6.f);
  p = __builtin_fmaf(p, r, 0.5f);
  p = __builtin_fmaf(p, r, 1.f);
  p = __builtin_fmaf(p, r, 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return overflows ? std::numeric_limits<float>::infinity() : p * scale;
}

// out[t] = silu(gate_up[t, :I]) * gate_up[t, I:], silu rounded to T first (as F.silu(gate) * up)
template <typename T>
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t I = out.size(-1), rows = out.numel() / I;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * I;
      const T* u = g + I;
      T* o = op + r * I;
      // unrolled: independent vectors in flight hide the polynomial's dependent chain (2.6x here)
#pragma GCC ivdep
#pragma GCC unroll 4
      for (int64_t i = 0; i < I; ++i) {
        const float x = static_cast<float>(g[i]);
        const T act = round_to<T>(x / (1.f + exp_approx(-x)));
        o[i] = round_to<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0, what,
              ": a contiguous CPU tensor with non-empty rows");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "rms_norm");
  check_rows(w, "rms_norm weight");
  TORCH_CHECK(w.numel() == x.size(-1) && w.scalar_type() == x.scalar_type(), "rms_norm: weight vs input");
  auto out = torch::empty_like(x);
  pybind11::gil_scoped_release no_gil;  // the event loop shares this process: let it run meanwhile
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, w, out, eps);
  });
  return out;
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_ residual");
  check_rows(w, "add_rms_norm_ weight");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: input vs residual");
  TORCH_CHECK(w.numel() == x.size(-1) && w.scalar_type() == x.scalar_type(), "add_rms_norm_: weight vs input");
  at::assert_no_internal_overlap(x);
  at::assert_no_internal_overlap(residual);
  at::assert_no_overlap(x, residual);
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_impl<scalar_t>(x, residual, w, eps);
  });
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && (x.size(0) <= 1 || x.stride(0) >= x.size(1)),
              "rotary_: rows of a CPU tensor, not overlapping");
  check_rows(cos, "rotary_ cos");
  check_rows(sin, "rotary_ sin");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && heads >= 0 && heads * head_dim <= x.size(1),
              "rotary_: heads x head_dim vs row");
  TORCH_CHECK(cos.numel() == x.size(0) * head_dim && sin.numel() == cos.numel() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: cos/sin vs rows");
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(x, cos, sin, heads, head_dim);
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: gate and up of equal size");
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  auto out = torch::empty(sizes, gate_up.options());
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up, out);
  });
  return out;
}
