// Fused elementwise ops of the decoder layer on CPU, for bfloat16, float16 and float32 activations.
//
// Each op reproduces the roundings of the torch ops it replaces (a half-precision result after every
// torch op; none for float32, whose every operation rounds as torch's), computed in fp32 in one pass
// over the data:
//   add_rms_norm_   residual <- x + residual; out <- weight * half(rms_norm(float(residual)))
//   rms_norm        out <- weight * half(rms_norm(float(x)))
//   rotary_         q, k <- q * cos + rotate_half(q) * sin (neox style), in place
//   silu_and_mul    out <- half(silu(gate)) * up, gate and up the two halves of the last dimension
// Products of two half-precision numbers are exact in fp32, so rotary_ matches torch bit for bit;
// rms_norm's sum of squares and silu's exp may differ from torch's in the last fp32 bit. float32 sums
// the squares in double (with no rounding after it, an fp32 sum's error would show in the result).
//
// Vectorised: bfloat16 with AVX512-BF16 (16 lanes), bfloat16 and float32 with AVX2 (8 lanes); the rest
// in loops the compiler vectorises.
// Shapes: x, residual, out: [num_tokens, hidden]; q: [num_tokens, num_heads, head_size] and k:
// [num_tokens, num_kv_heads, head_size] (views whose last dimension is contiguous, e.g. of a fused
// QKV output); cos, sin: [num_tokens, head_size] in the activations' dtype; gate_up: [num_tokens,
// 2 * inter].

#include "fused_cpu.h"

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvpilot_cpu {
namespace {

inline float to_float(c10::BFloat16 v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(__builtin_bit_cast(uint16_t, v)) << 16);
}
inline float to_float(c10::Half v) { return static_cast<float>(__builtin_bit_cast(_Float16, v)); }
inline float to_float(float v) { return v; }

// Round to nearest even, as c10 does (NaN to the canonical quiet NaN).
inline c10::BFloat16 to_half(float f, c10::BFloat16) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t r = std::isnan(f) ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return __builtin_bit_cast(c10::BFloat16, static_cast<uint16_t>(r));
}
inline c10::Half to_half(float f, c10::Half) {
  return __builtin_bit_cast(c10::Half, static_cast<_Float16>(f));
}
// float32 activations: no rounding between the ops.
inline float to_half(float f, float) { return f; }

template <typename T>
inline float round_trip(float f) {
  return to_float(to_half(f, T()));
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVPILOT_BF16_VEC 1
// 16 bfloat16 lanes <-> fp32 (the narrowing rounds to nearest even, as c10 does); lanes past n are
// neither read nor written.
inline __m512 load16(const c10::BFloat16* p, int64_t n) {
  const __mmask16 mask = first_lanes(static_cast<int>(std::min<int64_t>(n, 16)));
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 round16(__m512 v) {  // to bfloat16 and back
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(c10::BFloat16* p, __m512 v, int64_t n) {
  const __mmask16 mask = first_lanes(static_cast<int>(std::min<int64_t>(n, 16)));
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

void norm_rows_vec(const c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* weight,
                   c10::BFloat16* out, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* xr = x + r * x_stride;
      c10::BFloat16* res = residual ? residual + r * n : nullptr;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        __m512 v = load16(xr + i, n - i);
        if (res) {
          v = round16(_mm512_add_ps(v, load16(res + i, n - i)));
          store16(res + i, v, n - i);
        }
        sum = _mm512_fmadd_ps(v, v, sum);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sum) / static_cast<float>(n) + eps);
      const __m512 scale = _mm512_set1_ps(inv);
      const c10::BFloat16* src = res ? res : xr;
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 h = round16(_mm512_mul_ps(load16(src + i, n - i), scale));
        store16(out + r * n + i, _mm512_mul_ps(load16(weight + i, n - i), h), n - i);
      }
    }
  });
}

void rotary_rows_vec(c10::BFloat16* t, int64_t tokens, int64_t heads, int64_t token_stride,
                     int64_t head_stride, const c10::BFloat16* cos, const c10::BFloat16* sin, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tok = begin; tok < end; ++tok) {
      const c10::BFloat16* c = cos + tok * d;
      const c10::BFloat16* s = sin + tok * d;
      for (int64_t h = 0; h < heads; ++h) {
        c10::BFloat16* row = t + tok * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; i += 16) {
          const int64_t n = half - i;
          const __m512 x1 = load16(row + i, n), x2 = load16(row + half + i, n);
          const __m512 a1 = _mm512_add_ps(round16(_mm512_mul_ps(x1, load16(c + i, n))),
                                          round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                                load16(s + i, n))));
          const __m512 a2 = _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(c + half + i, n))),
                                          round16(_mm512_mul_ps(x1, load16(s + half + i, n))));
          store16(row + i, a1, n);
          store16(row + half + i, a2, n);
        }
      }
    }
  });
}

void silu_mul_rows_vec(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows, int64_t inter,
                       int64_t in_stride) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = gate_up + r * in_stride;
      for (int64_t i = 0; i < inter; i += 16) {
        const int64_t n = inter - i;
        const __m512 x = load16(g + i, n);
        // sigmoid from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0, e / (1 + e) below.
        const __m512 e = exp_nonpositive_16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);
        const __m512 silu = round16(_mm512_mul_ps(x, sig));
        store16(out + r * inter + i, _mm512_mul_ps(silu, load16(g + inter + i, n)), n);
      }
    }
  });
}
#endif

// The sum of squares of a row's values as norm_rows takes it: in fp32 for the half-precision types,
// in double for float32.
template <typename T>
using SquareSum = std::conditional_t<std::is_same_v<T, float>, double, float>;

#if defined(KVPILOT_AVX2)
// 8 lanes of bfloat16 or float32 <-> fp32 registers; lanes past n (< 8) are neither read (they read as
// 0) nor written. AVX2 has no masked 16-bit loads or stores: a bfloat16 tail goes through the stack.
inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, _mm256_castps_si256(first_lanes_8(n)));
}
inline __m256 load8(const c10::BFloat16* p, int64_t n) {
  if (n >= 8) return load8_fp32(p);
  c10::BFloat16 tail[8] = {};
  std::memcpy(tail, p, n * sizeof(c10::BFloat16));
  return load8_fp32(tail);
}
inline void store8(float* p, __m256 v, int64_t n) {
  if (n >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, _mm256_castps_si256(first_lanes_8(n)), v);
}
inline void store8(c10::BFloat16* p, __m256 v, int64_t n) {  // rounded as to_half
  const __m128i h = fp32_to_bf16x8(v);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return;
  }
  c10::BFloat16 tail[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(tail), h);
  std::memcpy(p, tail, n * sizeof(c10::BFloat16));
}
// To the element type and back: round_trip on 8 lanes.
inline __m256 round8(__m256 v, c10::BFloat16) { return _mm256_castsi256_ps(bf16_rounded_bits(v)); }
inline __m256 round8(__m256 v, float) { return v; }

// The sum of the squares of 8 lanes added to an fp32 (bfloat16) or double (float32) accumulator.
inline void add_squares8(__m256 v, __m256& sum, c10::BFloat16) { sum = _mm256_fmadd_ps(v, v, sum); }
inline void add_squares8(__m256 v, __m256d (&sum)[2], float) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  sum[0] = _mm256_fmadd_pd(lo, lo, sum[0]);
  sum[1] = _mm256_fmadd_pd(hi, hi, sum[1]);
}
inline float reduce_squares8(__m256 sum) { return reduce_add_8(sum); }
inline double reduce_squares8(const __m256d (&sum)[2]) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(sum[0], sum[1]));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

template <typename T>
void norm_rows_8(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, int64_t x_stride,
                 float eps) {
  using Sum = std::conditional_t<std::is_same_v<T, float>, __m256d[2], __m256>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* res = residual ? residual + r * n : nullptr;
      Sum sum;
      if constexpr (std::is_same_v<T, float>) {
        sum[0] = sum[1] = _mm256_setzero_pd();
      } else {
        sum = _mm256_setzero_ps();
      }
      for (int64_t i = 0; i < n; i += 8) {
        __m256 v = load8(xr + i, n - i);
        if (res) {
          v = round8(_mm256_add_ps(v, load8(res + i, n - i)), T());
          store8(res + i, v, n - i);
        }
        add_squares8(v, sum, T());
      }
      const SquareSum<T> squares = reduce_squares8(sum);
      const float inv = 1.0f / std::sqrt(static_cast<float>(squares / static_cast<SquareSum<T>>(n)) + eps);
      const __m256 scale = _mm256_set1_ps(inv);
      const T* src = res ? res : xr;
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 h = round8(_mm256_mul_ps(load8(src + i, n - i), scale), T());
        store8(out + r * n + i, _mm256_mul_ps(load8(weight + i, n - i), h), n - i);
      }
    }
  });
}

template <typename T>
void rotary_rows_8(T* t, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride, const T* cos,
                   const T* sin, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t tok = begin; tok < end; ++tok) {
      const T* c = cos + tok * d;
      const T* s = sin + tok * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = t + tok * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; i += 8) {
          const int64_t n = half - i;
          const __m256 x1 = load8(row + i, n), x2 = load8(row + half + i, n);
          const __m256 a1 = _mm256_add_ps(round8(_mm256_mul_ps(x1, load8(c + i, n)), T()),
                                          round8(_mm256_mul_ps(_mm256_xor_ps(x2, sign), load8(s + i, n)), T()));
          const __m256 a2 = _mm256_add_ps(round8(_mm256_mul_ps(x2, load8(c + half + i, n)), T()),
                                          round8(_mm256_mul_ps(x1, load8(s + half + i, n)), T()));
          store8(row + i, a1, n);
          store8(row + half + i, a2, n);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows_8(const T* gate_up, T* out, int64_t rows, int64_t inter, int64_t in_stride) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * in_stride;
      for (int64_t i = 0; i < inter; i += 8) {
        const int64_t n = inter - i;
        const __m256 x = load8(g + i, n);
        // sigmoid from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0, e / (1 + e) below.
        const __m256 e = exp_nonpositive_accurate_8(_mm256_or_ps(x, sign));
        const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(inv, e), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
        const __m256 silu = round8(_mm256_mul_ps(x, sig), T());
        store8(out + r * inter + i, _mm256_mul_ps(silu, load8(g + inter + i, n)), n);
      }
    }
  });
}
#endif

template <typename T>
void norm_rows(const T* x, T* residual, const T* y, const T* weight, T* out, int64_t rows, int64_t n,
               int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* res = residual ? residual + r * n : nullptr;
      const T* yr = y ? y + r * n : nullptr;
      T* o = out + r * n;
      SquareSum<T> sum = 0;
      if (res) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          const float v = round_trip<T>(to_float(xr[i]) + to_float(yr[i]));
          res[i] = to_half(v, T());
          sum += static_cast<SquareSum<T>>(v) * v;
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          const float v = to_float(xr[i]);
          sum += static_cast<SquareSum<T>>(v) * v;
        }
      }
      const float inv = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<SquareSum<T>>(n)) + eps);
      const T* src = res ? res : xr;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float h = round_trip<T>(to_float(src[i]) * inv);
        o[i] = to_half(to_float(weight[i]) * h, T());
      }
    }
  });
}

template <typename T>
void rotary_rows(T* t, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                 const T* cos, const T* sin, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tok = begin; tok < end; ++tok) {
      const T* c = cos + tok * d;
      const T* s = sin + tok * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = t + tok * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(row[i]), x2 = to_float(row[i + half]);
          // torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded.
          const float a1 = round_trip<T>(x1 * to_float(c[i])) + round_trip<T>(-x2 * to_float(s[i]));
          const float a2 = round_trip<T>(x2 * to_float(c[i + half])) + round_trip<T>(x1 * to_float(s[i + half]));
          row[i] = to_half(a1, T());
          row[i + half] = to_half(a2, T());
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter, int64_t in_stride) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * in_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = to_float(g[i]);
        float silu;
        if constexpr (std::is_same_v<T, float>) {
          // As silu_mul_rows_8: with no rounding after it, exp's error would show in the result.
          const float e = exp_nonpositive_accurate(-std::fabs(x));
          const float inv = 1.0f / (1.0f + e);
          silu = x * (x < 0.0f ? inv * e : inv);
        } else {
          silu = round_trip<T>(x / (1.0f + exp_approx(-x)));
        }
        o[i] = to_half(silu * to_float(u[i]), T());
      }
    }
  });
}

#if defined(KVPILOT_AVX2)
// 8 float32 values narrowed as to_half rounds them (F16C converts to nearest even, as the cast does).
inline __m128i narrow8(__m256 v, c10::BFloat16) { return fp32_to_bf16x8(v); }
inline __m128i narrow8(__m256 v, c10::Half) {
  return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

// float32 -> bfloat16 or float16, element by element as to_half rounds.
template <typename T>
void narrow_row(const float* src, T* dst, int64_t n) {
  int64_t i0 = 0;
#if defined(KVPILOT_AVX2)
  for (; i0 + 8 <= n; i0 += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i0), narrow8(_mm256_loadu_ps(src + i0), T()));
#endif
#pragma omp simd
  for (int64_t i = i0; i < n; ++i) dst[i] = to_half(src[i], T());
}

void check_activation(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat,
              name, " must be float32, bfloat16 or float16");
}

// fn(T()) for the activations' element type T (checked by check_activation).
template <typename Fn>
void dispatch_activation(at::ScalarType type, const Fn& fn) {
  switch (type) {
    case at::kFloat: return fn(float());
    case at::kBFloat16: return fn(c10::BFloat16());
    default: return fn(c10::Half());
  }
}

// Whether T has the 8-wide AVX2 loops (float16 keeps the portable ones).
template <typename T>
constexpr bool kVec8 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

template <typename T>
T* data(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// rms_norm (residual null) or add_rms_norm_ on the kernels this build has for T.
template <typename T>
void norm(const at::Tensor& x, T* residual, const at::Tensor& weight, at::Tensor& out, double eps) {
  const float e = static_cast<float>(eps);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
#ifdef KVPILOT_BF16_VEC
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return norm_rows_vec(data<T>(x), residual, data<T>(weight), data<T>(out), rows, n, stride, e);
#endif
#if defined(KVPILOT_AVX2)
  if constexpr (kVec8<T>)
    return norm_rows_8(data<T>(x), residual, data<T>(weight), data<T>(out), rows, n, stride, e);
#endif
  norm_rows<T>(data<T>(x), residual, residual, data<T>(weight), data<T>(out), rows, n, stride, e);
}

template <typename T>
void rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  T* p = data<T>(t);
  const T* c = data<T>(cos);
  const T* s = data<T>(sin);
  const int64_t tokens = t.size(0), heads = t.size(1), d = t.size(2);
#ifdef KVPILOT_BF16_VEC
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return rotary_rows_vec(p, tokens, heads, t.stride(0), t.stride(1), c, s, d);
#endif
#if defined(KVPILOT_AVX2)
  if constexpr (kVec8<T>) return rotary_rows_8(p, tokens, heads, t.stride(0), t.stride(1), c, s, d);
#endif
  rotary_rows(p, tokens, heads, t.stride(0), t.stride(1), c, s, d);
}

template <typename T>
void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
#ifdef KVPILOT_BF16_VEC
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return silu_mul_rows_vec(data<T>(gate_up), data<T>(out), rows, inter, gate_up.stride(0));
#endif
#if defined(KVPILOT_AVX2)
  if constexpr (kVec8<T>) return silu_mul_rows_8(data<T>(gate_up), data<T>(out), rows, inter, gate_up.stride(0));
#endif
  silu_mul_rows(data<T>(gate_up), data<T>(out), rows, inter, gate_up.stride(0));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_activation(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [num_tokens, hidden] with a contiguous row");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight must be [hidden] in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_activation(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    norm<T>(x, nullptr, weight, out, eps);
  });
  return out;
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_activation(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [num_tokens, hidden] with a contiguous row");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(), "residual must be a contiguous tensor like x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight must be [hidden] in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_activation(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    norm<T>(x, data<T>(residual), weight, out, eps);
  });
  return out;
}

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_activation(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [num_tokens, heads, head_size] with a contiguous last dimension");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(), "q, k, cos and sin must share a dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && k.size(2) == d && k.size(0) == q.size(0), "q and k shapes differ");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * d &&
                  sin.numel() == cos.numel(), "cos and sin must be contiguous [num_tokens, head_size]");
  dispatch_activation(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotary<T>(q, cos, sin);
    rotary<T>(k, cos, sin);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_activation(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [num_tokens, 2 * inter] with a contiguous row");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_activation(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_mul<T>(gate_up, out);
  });
  return out;
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(),
              "key and value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "caches must be [num_blocks, block_size, heads, d] with a contiguous head dimension");
  const at::ScalarType src_type = key.scalar_type(), cache_type = k_cache.scalar_type();
  TORCH_CHECK(value.scalar_type() == src_type && v_cache.scalar_type() == cache_type,
              "key and value, and k_cache and v_cache, must share a dtype");
  const bool narrowing = src_type == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf);
  TORCH_CHECK(src_type == cache_type || narrowing,
              "key/value and caches must share a dtype, or be float32 over bfloat16 or float16 caches");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "head shapes differ");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0), "slot_mapping must be int64 [num_tokens]");
  const int64_t num_tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " out of range");
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t src_es = key.element_size(), es = k_cache.element_size();
  const int64_t row_bytes = d * es;
  // A row is copied as it is, or narrowed from float32 with the rounding of torch's .to().
  auto store = [&](char* dst, const char* src) {
    if (!narrowing) {
      std::memcpy(dst, src, row_bytes);
    } else if (cache_type == at::kBFloat16) {
      narrow_row(reinterpret_cast<const float*>(src), reinterpret_cast<c10::BFloat16*>(dst), d);
    } else {
      narrow_row(reinterpret_cast<const float*>(src), reinterpret_cast<c10::Half*>(dst), d);
    }
  };
  // Element offsets from the caches' strides: the pool may be laid out block-major with each (block,
  // head) contiguous and exposed as a permuted view.
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding: nothing to store
      const int64_t block = slot[t] / block_size, pos = slot[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        store(kc + (block * kb + pos * kt + h * kh) * es, k + (t * key.stride(0) + h * key.stride(1)) * src_es);
        store(vc + (block * vb + pos * vt + h * vh) * es,
              v + (t * value.stride(0) + h * value.stride(1)) * src_es);
      }
    }
  });
}

}  // namespace kvpilot_cpu
