// Row conversions, a vectorisable exp and the AVX-512 and AVX2 score kernels of paged_attention_cpu.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

// The 8-wide AVX2 + FMA loops, for x86 CPUs without AVX-512; where KVPILOT_NO_AVX2_PATHS is defined such
// a CPU runs the portable loops instead (to measure or test them there).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__) && \
    !defined(KVPILOT_NO_AVX2_PATHS)
#define KVPILOT_AVX2 1
#endif

namespace kvpilot_cpu {

#if defined(KVPILOT_AVX2)
inline __m256 bf16x8_to_fp32(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// v rounded to bfloat16 to nearest even, as c10 rounds (NaN to the canonical quiet NaN), in the high
// half of each 32-bit lane (the low half zero): the lanes are the rounded values as fp32.
inline __m256i bf16_rounded_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))),
                            _mm256_set1_epi32(0x7FC00000), nan);
}

// 8 consecutive elements as fp32.
inline __m256 load8_fp32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_fp32(const c10::BFloat16* p) {
  return bf16x8_to_fp32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8_fp32(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m128i fp32_to_bf16x8(__m256 v) {
  const __m256i h = _mm256_srli_epi32(bf16_rounded_bits(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#endif

inline void load_row(const float* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}

inline void load_row(const c10::BFloat16* src, float* dst, int n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int i0 = 0;
#if defined(KVPILOT_AVX2)
  for (; i0 + 8 <= n; i0 += 8)
    _mm256_storeu_ps(dst + i0, bf16x8_to_fp32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i0))));
#endif
#pragma omp simd
  for (int i = i0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16);
}

inline void load_row(const c10::Half* src, float* dst, int n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int i0 = 0;
#if defined(KVPILOT_AVX2)
  for (; i0 + 8 <= n; i0 += 8)
    _mm256_storeu_ps(dst + i0, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i0))));
#endif
#pragma omp simd
  for (int i = i0; i < n; ++i) dst[i] = static_cast<float>(__builtin_bit_cast(_Float16, s[i]));
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

// exp(x) for x <= 0 (clamped to -87) to a few ulps at any x: exp_approx's reduced argument t - n with
// the rounding error of t = x * log2(e) carried along (the FMA gives the product's error exactly, and x
// times log2(e)'s own error in fp32 is added). Without it that error costs |x| * 2^-24 relative, 1e-6
// at x = -16: the softmax tolerates it, float32 silu would show it. (n from nearbyint, not the shifter:
// with t used by an FMA and a rounding, the compiler cannot contract t's product into t - n.)
inline float exp_nonpositive_accurate(float x) {
  x = std::fmax(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = (t - n) + std::fma(x, 1.925963e-08f, std::fma(x, 1.4426950408889634f, -t));
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
// Whether the score, softmax and PV loops have a vector path here, and its width in fp32 lanes.
constexpr bool kWide = true;
constexpr int kLanes = 16;

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
#elif defined(KVPILOT_AVX2)
constexpr bool kWide = true;
constexpr int kLanes = 8;

// Lane k of the result is the sum of the lanes of v[k]: a transposing reduction tree (6 combines of
// two shuffles and an add, then one of the two 128-bit halves) instead of 8 separate horizontal sums.
inline __m256 sum_lanes_8(const __m256 (&v)[8]) {
  __m256 c[4], e[2];
  for (int j = 0; j < 4; ++j) {  // in each half, c[j] = [pair sums of v[2j] | pair sums of v[2j+1]]
    const __m256 a = v[2 * j], b = v[2 * j + 1];
    c[j] = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  }
  for (int j = 0; j < 2; ++j) {  // lane t of each half of e[j] holds that half's sum of v[4j + t]
    const __m256 a = c[2 * j], b = c[2 * j + 1];
    e[j] = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(e[0], e[1], 0x20), _mm256_permute2f128_ps(e[0], e[1], 0x31));
}

// The sum of the 8 lanes (in a fixed order: the result does not depend on where a row is computed).
inline float reduce_add_8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max_8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp_nonpositive on 8 lanes, lane for lane the same arithmetic (round to nearest, the same
// polynomial, the power of two 2^n built in the exponent bits: n >= -126 after the clamp, so it is a
// normal number and the product p * 2^n rounds exactly as exp_approx's).
inline __m256 exp_nonpositive_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// exp_nonpositive_accurate on 8 lanes, lane for lane the same arithmetic.
inline __m256 exp_nonpositive_accurate_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 log2e = _mm256_set1_ps(1.4426950408889634f);
  const __m256 t = _mm256_mul_ps(x, log2e);
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 t_error = _mm256_fmadd_ps(x, _mm256_set1_ps(1.925963e-08f), _mm256_fmsub_ps(x, log2e, t));
  const __m256 f = _mm256_add_ps(_mm256_sub_ps(t, n), t_error);
  __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// All bits set in lanes [0, n), none elsewhere (as a blend or and-mask).
inline __m256 first_lanes_8(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// Scores of one query row against 8 consecutive fp32 key rows (d a multiple of 8).
template <int HEAD>
inline __m256 scores_8(const float* q, const float* keys, int head) {
  const int d = HEAD ? HEAD : head;
  __m256 acc[8];
  for (int k = 0; k < 8; ++k) {
    const float* kr = keys + k * d;
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kr));
    for (int i = 8; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kr + i), a);
    acc[k] = a;
  }
  return sum_lanes_8(acc);
}
#else
constexpr bool kWide = false;
constexpr int kLanes = 1;
#endif

}  // namespace kvpilot_cpu
