// Row conversions, a vectorisable exp and the AVX-512 score kernel of paged_attention_cpu.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvpilot_cpu {

inline void load_row(const float* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}

inline void load_row(const c10::BFloat16* src, float* dst, int n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16);
}

inline void load_row(const c10::Half* src, float* dst, int n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(__builtin_bit_cast(_Float16, s[i]));
}

template <typename T>
inline void store_row(const float* src, float inv, T* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * inv);
}

// exp(x) over [-87, 88] (clamped outside) to about 1 ulp: 2^x' split into an integer and a fraction in [-0.5, 0.5], whose
// power of two is a degree-7 Taylor polynomial (truncation error < 1e-8). Written so that the
// compiler vectorises it (std::exp would be a scalar call per score).
inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.0f), 88.0f);
  const float t = x * 1.4426950408889634f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (t + shifter) - shifter;
  const float f = t - n;
  float p = 1.5252733804059841e-05f;
  p = std::fma(p, f, 1.5403530393381606e-04f);
  p = std::fma(p, f, 1.3333558146428443e-03f);
  p = std::fma(p, f, 9.6181291076284772e-03f);
  p = std::fma(p, f, 5.5504108664821580e-02f);
  p = std::fma(p, f, 2.4022650695910071e-01f);
  p = std::fma(p, f, 6.9314718055994531e-01f);
  p = std::fma(p, f, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// The softmax's case: x <= 0 (the upper clamp never applies).
inline float exp_nonpositive(float x) { return exp_approx(x); }

// Locality 3 (the default) asks for L1, 2 for L2 (prefetcht1).
template <int Locality = 3, typename T>
inline void prefetch_rows(const T* first, int64_t stride, int num_rows, int d) {
  constexpr int kLine = 64 / sizeof(T);
  for (int k = 0; k < num_rows; ++k) {
    const T* row = first + k * stride;
    for (int i = 0; i < d; i += kLine) __builtin_prefetch(row + i, 0, Locality);
  }
}

#if defined(__AVX512F__)
constexpr bool kWide = true;

// Lane k of the result is the sum of the lanes of v[k]: a transposing reduction tree (15 combines of
// two shuffles and an add) instead of 16 separate horizontal sums.
inline __m512 sum_lanes_16(const __m512 (&v)[16]) {
  __m512 c[8], e[4];
  for (int j = 0; j < 8; ++j) {  // 16 -> 8 partial sums each; c[j] = [v[2j] | v[2j+1]]
    const __m512 a = v[2 * j], b = v[2 * j + 1];
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // 8 -> 4; quarter t of e[j] holds v[4j + t]
    const __m512 a = c[2 * j], b = c[2 * j + 1];
    e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // 4 -> 2 -> 1 inside each quarter: lane 4t + j ends up holding the sum of v[4j + t].
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x44), _mm512_shuffle_ps(e[0], e[1], 0xEE));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_ps(e[2], e[3], 0x44), _mm512_shuffle_ps(e[2], e[3], 0xEE));
  const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(f0, f1, 0x88), _mm512_shuffle_ps(f0, f1, 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, g);
}

// exp_nonpositive on 16 lanes, lane for lane the same arithmetic (round to nearest, the same
// polynomial, the power of two applied exactly by scalef).
inline __m512 exp_nonpositive_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lanes [0, n) set (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int n) {
  return n <= 0 ? __mmask16(0) : n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// Scores of one query row against 16 consecutive fp32 key rows (d a multiple of 16).
template <int HEAD>
inline __m512 scores_16(const float* q, const float* keys, int head) {
  const int d = HEAD ? HEAD : head;
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) {
    const float* kr = keys + k * d;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kr));
    for (int i = 16; i < d; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(kr + i), a);
    acc[k] = a;
  }
  return sum_lanes_16(acc);
}
#else
constexpr bool kWide = false;
#endif

}  // namespace kvpilot_cpu
