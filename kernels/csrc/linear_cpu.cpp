// The linear layers of a float32 model whose weights are bfloat16 values (a bfloat16 checkpoint computed in
// float32 on a CPU without native bfloat16): float32 activations times the weights stored in bfloat16,
// widened to float32 in registers (a 16-bit shift: exact), accumulated in float32 with FMA. The weights
// cross the memory bus at half their float32 size, which is what a decode step's linears wait on; the
// products are the float32 products of the same values.
//
// The weight is packed in panels of 16 output columns, [ceil(N / 16), K, 16] (pack_bf16_panels in
// cpu_ops.py): one panel streams sequentially, and one load of 32 bytes gives the 16 columns' weights of
// one input feature. A tile of up to 6 token rows keeps its accumulators in registers: 6 x 2 of 8 lanes
// with AVX2, 6 of 16 lanes with AVX-512. Every output is summed by one thread in an order fixed by the
// shapes alone, so the result does not depend on the thread count.
#include "linear_cpu.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvpilot_cpu {
namespace {

constexpr int kPanel = 16;  // output columns per panel
constexpr int kRows = 6;    // token rows per register tile
constexpr int64_t kBlockRows = 16 * kRows;  // token rows per pass over the weight
// Up to these rows the tiles widen the weights in registers (reading 2 bytes per weight per tile); past
// them a float32 copy of the panel, written once, costs less (benchmarks/linear_cpu.py).
constexpr int64_t kDirectRows = 4 * kRows;

// A bfloat16's bits as float32 (exact), or a float32 as is.
inline float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float widen(float v) { return v; }

#if defined(__AVX512F__)
// One panel row of 16 columns is one 512-bit register.
inline __m512 load16(const uint16_t* w) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }

inline void store16(float* y, __m512 v, int cols) {
  if (cols == kPanel) {
    _mm512_storeu_ps(y, v);
  } else {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << cols) - 1), v);
  }
}

// R rows of x times one panel. A row's FMAs form a chain bound by the FMA latency: with few rows the
// features are split over 4 (one or two rows) or 2 (three or four) streams of accumulators, summed in a
// fixed order at the end, so the result does not depend on anything but the shapes.
#define KVPILOT_ROW_FMA(r, k, acc, wv)                                               \
  if constexpr (R > r) {                                                             \
    acc##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * ldx + (k)]), wv, acc##r);        \
  }
#define KVPILOT_ROWS_FMA(k, acc, wv) \
  KVPILOT_ROW_FMA(0, k, acc, wv)     \
  KVPILOT_ROW_FMA(1, k, acc, wv)     \
  KVPILOT_ROW_FMA(2, k, acc, wv)     \
  KVPILOT_ROW_FMA(3, k, acc, wv)     \
  KVPILOT_ROW_FMA(4, k, acc, wv)     \
  KVPILOT_ROW_FMA(5, k, acc, wv)

template <int R, typename W>
void panel_tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy, int cols) {
  static_assert(R >= 1 && R <= kRows, "a tile holds 1 to 6 rows");
  const __m512 z = _mm512_setzero_ps();
  __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z;  // stream 0 (every feature when R > 4)
  __m512 b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z;  // stream 1
  __m512 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z;  // streams 2 and 3 (R <= 2)
  __m512 d0 = z, d1 = z, d2 = z, d3 = z, d4 = z, d5 = z;
  int64_t k = 0;
  if constexpr (R <= 2) {
    for (; k + 4 <= K; k += 4) {
      const __m512 w0 = load16(w + k * kPanel), w1 = load16(w + (k + 1) * kPanel);
      const __m512 w2 = load16(w + (k + 2) * kPanel), w3 = load16(w + (k + 3) * kPanel);
      KVPILOT_ROWS_FMA(k, a, w0)
      KVPILOT_ROWS_FMA(k + 1, b, w1)
      KVPILOT_ROWS_FMA(k + 2, c, w2)
      KVPILOT_ROWS_FMA(k + 3, d, w3)
    }
    a0 = _mm512_add_ps(_mm512_add_ps(a0, b0), _mm512_add_ps(c0, d0));
    a1 = _mm512_add_ps(_mm512_add_ps(a1, b1), _mm512_add_ps(c1, d1));
  } else if constexpr (R <= 4) {
    for (; k + 2 <= K; k += 2) {
      const __m512 w0 = load16(w + k * kPanel), w1 = load16(w + (k + 1) * kPanel);
      KVPILOT_ROWS_FMA(k, a, w0)
      KVPILOT_ROWS_FMA(k + 1, b, w1)
    }
    a0 = _mm512_add_ps(a0, b0);
    a1 = _mm512_add_ps(a1, b1);
    a2 = _mm512_add_ps(a2, b2);
    a3 = _mm512_add_ps(a3, b3);
  }
  (void)b4, (void)b5, (void)c2, (void)c3, (void)c4, (void)c5, (void)d2, (void)d3, (void)d4, (void)d5;
  for (; k < K; ++k) {
    const __m512 w0 = load16(w + k * kPanel);
    KVPILOT_ROWS_FMA(k, a, w0)
  }
  if constexpr (R > 0) store16(y + 0 * ldy, a0, cols);
  if constexpr (R > 1) store16(y + 1 * ldy, a1, cols);
  if constexpr (R > 2) store16(y + 2 * ldy, a2, cols);
  if constexpr (R > 3) store16(y + 3 * ldy, a3, cols);
  if constexpr (R > 4) store16(y + 4 * ldy, a4, cols);
  if constexpr (R > 5) store16(y + 5 * ldy, a5, cols);
}
#undef KVPILOT_ROWS_FMA
#undef KVPILOT_ROW_FMA
constexpr const char* kPath = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
inline void load16(const uint16_t* w, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

inline void store16(float* y, __m256 lo, __m256 hi, int cols) {
  if (cols == kPanel) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::memcpy(y, tmp, sizeof(float) * cols);
}

// R rows of x times one panel, the accumulators named (an array of them would live on the stack). One or
// two rows are bound by the FMA latency: they keep a second pair of accumulators for odd features.
#define KVPILOT_ROW_FMA(r, k, lo, hi, wl, wh)                          \
  if constexpr (R > r) {                                               \
    const __m256 xv = _mm256_broadcast_ss(x + (r) * ldx + (k));        \
    lo##r = _mm256_fmadd_ps(xv, wl, lo##r);                            \
    hi##r = _mm256_fmadd_ps(xv, wh, hi##r);                            \
  }
#define KVPILOT_ROWS_FMA(k, lo, hi, wl, wh) \
  KVPILOT_ROW_FMA(0, k, lo, hi, wl, wh)     \
  KVPILOT_ROW_FMA(1, k, lo, hi, wl, wh)     \
  KVPILOT_ROW_FMA(2, k, lo, hi, wl, wh)     \
  KVPILOT_ROW_FMA(3, k, lo, hi, wl, wh)     \
  KVPILOT_ROW_FMA(4, k, lo, hi, wl, wh)     \
  KVPILOT_ROW_FMA(5, k, lo, hi, wl, wh)

template <int R, typename W>
void panel_tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy, int cols) {
  static_assert(R >= 1 && R <= kRows, "a tile holds 1 to 6 rows");
  const __m256 z = _mm256_setzero_ps();
  __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z;  // columns 0-7 of rows 0-5
  __m256 b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z;  // columns 8-15
  int64_t k = 0;
  if constexpr (R <= 2) {
    __m256 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z;  // odd features (only c0, c1 are used)
    __m256 d0 = z, d1 = z, d2 = z, d3 = z, d4 = z, d5 = z;
    for (; k + 2 <= K; k += 2) {
      __m256 wl, wh, vl, vh;
      load16(w + k * kPanel, wl, wh);
      load16(w + (k + 1) * kPanel, vl, vh);
      KVPILOT_ROWS_FMA(k, a, b, wl, wh)
      KVPILOT_ROWS_FMA(k + 1, c, d, vl, vh)
    }
    a0 = _mm256_add_ps(a0, c0);
    b0 = _mm256_add_ps(b0, d0);
    a1 = _mm256_add_ps(a1, c1);
    b1 = _mm256_add_ps(b1, d1);
    (void)c2, (void)c3, (void)c4, (void)c5, (void)d2, (void)d3, (void)d4, (void)d5;
  }
  for (; k < K; ++k) {
    __m256 wl, wh;
    load16(w + k * kPanel, wl, wh);
    KVPILOT_ROWS_FMA(k, a, b, wl, wh)
  }
  if constexpr (R > 0) store16(y + 0 * ldy, a0, b0, cols);
  if constexpr (R > 1) store16(y + 1 * ldy, a1, b1, cols);
  if constexpr (R > 2) store16(y + 2 * ldy, a2, b2, cols);
  if constexpr (R > 3) store16(y + 3 * ldy, a3, b3, cols);
  if constexpr (R > 4) store16(y + 4 * ldy, a4, b4, cols);
  if constexpr (R > 5) store16(y + 5 * ldy, a5, b5, cols);
}
#undef KVPILOT_ROWS_FMA
#undef KVPILOT_ROW_FMA
constexpr const char* kPath = "avx2";
#else
// The portable loop: the compiler vectorises the 16 columns.
template <int R, typename W>
void panel_tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy, int cols) {
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    float wk[kPanel];
#pragma omp simd
    for (int c = 0; c < kPanel; ++c) wk[c] = widen(w[k * kPanel + c]);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int c = 0; c < kPanel; ++c) acc[r][c] += xv * wk[c];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(float) * cols);
}
constexpr const char* kPath = "portable";
#endif

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int);
template <typename W>
constexpr TileFn<W> kTiles[kRows + 1] = {nullptr,          panel_tile<1, W>, panel_tile<2, W>, panel_tile<3, W>,
                                         panel_tile<4, W>, panel_tile<5, W>, panel_tile<6, W>};

// The rows of x times one panel. Past kDirectRows the panel is widened once into float32 (it stays in L1
// or L2), so that each tile's inner loop is loads and FMAs only.
void panel_rows(const float* x, int64_t ldx, int64_t M, const uint16_t* panel, int64_t K, float* y,
                int64_t ldy, int cols, std::vector<float>& wide) {
  if (M <= kDirectRows) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      kTiles<uint16_t>[rows](x + m0 * ldx, ldx, panel, K, y + m0 * ldy, ldy, cols);
    }
    return;
  }
  wide.resize(static_cast<size_t>(K) * kPanel);
  float* wp = wide.data();
#pragma omp simd
  for (int64_t i = 0; i < K * kPanel; ++i) wp[i] = widen(panel[i]);
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
    kTiles<float>[rows](x + m0 * ldx, ldx, wp, K, y + m0 * ldy, ldy, cols);
  }
}

}  // namespace

std::string linear_bf16w_path() { return kPath; }

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w_packed, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16w: x must be float32 [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "linear_bf16w: x rows must be contiguous");
  TORCH_CHECK(w_packed.dim() == 3 && w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() &&
                  w_packed.size(2) == kPanel,
              "linear_bf16w: the weight must be bfloat16 panels [ceil(N / 16), K, 16], contiguous");
  const int64_t M = x.size(0), K = x.size(1), num_panels = w_packed.size(0);
  TORCH_CHECK(w_packed.size(1) == K, "linear_bf16w: x has ", K, " features, the weight ", w_packed.size(1));
  TORCH_CHECK(n_out > (num_panels - 1) * kPanel && n_out <= num_panels * kPanel,
              "linear_bf16w: ", n_out, " output columns do not fill ", num_panels, " panels of 16");
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w_packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  // Blocks of rows (their x stays in L2 while every panel passes over it), the panels of a block split
  // over the threads; a panel is widened once per block.
  for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
    const int64_t rows = std::min<int64_t>(kBlockRows, M - m0);
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wide;
      for (int64_t p = begin; p < end; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n_out - p * kPanel));
        panel_rows(xp + m0 * ldx, ldx, rows, wp + p * K * kPanel, K, yp + m0 * n_out + p * kPanel, n_out,
                   cols, wide);
      }
    });
  }
  return y;
}

}  // namespace kvpilot_cpu
