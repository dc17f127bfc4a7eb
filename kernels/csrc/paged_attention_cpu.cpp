// Paged attention on CPU that reads K/V where they lie in the block pool.
//
// One call covers the flattened batch (decode rows and prefill chunks with cached context). Work items
// are (request, KV head, tile of query tokens); the query heads of a GQA group are processed together,
// so every K/V row is read and converted once per item. Each item walks its request's block table and
// runs an online softmax over the key blocks with fp32 accumulation. Items are handed out dynamically
// (largest first) to the threads of ATen's pool. bfloat16 items with few rows (decode) take a path that
// reads K and V straight from the cache with AVX512-BF16 (attend_bf16_rows), with no fp32 scratch copy;
// bfloat16 items with more rows (prefill tiles) run QK^T and PV on AMX tiles where the CPU has them
// (attend_amx). Other items convert K/V to fp32 rows in scratch, and compute scores, softmax and PV
// 16 fp32 lanes at a time with AVX-512. On x86 CPUs with AVX2 and FMA but no AVX-512 the same loops run
// 8 lanes wide, and items with few rows (decode) read K and V straight from the cache, converting them
// in registers (attend_rows_8); elsewhere, and for head sizes not a multiple of the vector width, they
// are portable loops the compiler vectorises.
//
// The query (and output) dtype is either the caches' or float32 over bfloat16 or float16 caches (fp32
// compute over a half-precision pool); the AVX512-BF16 and AMX paths serve only an all-bfloat16 call.
//
// Shapes (strides are taken from the tensors; the last dimension must be contiguous):
//   query:           [num_tokens, num_heads, head_size]
//   k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_size]
//   query_start_loc: [num_reqs + 1] int32, seq_lens: [num_reqs] int32,
//   block_tables:    [num_reqs, max_num_blocks] int32
// Returns [num_tokens, num_heads, head_size] (contiguous) in the query's dtype.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_vec.h"
#include "fused_cpu.h"
#include "linear_cpu.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvpilot_cpu;

// Query tokens of one prefill request attended by one work item: small enough to load-balance a
// long chunk over the threads, large enough that K/V conversion (or the AMX repacking) is shared by
// many rows. On the benchmark workload's prefills (bfloat16, AMX, one thread) 64 measured 82-97 ms a
// layer against 100-109 for 32 and 119-126 for 16; fp32 217 against 232 for 16.
constexpr int kQueryTile = 64;

#ifndef KVPILOT_PREFETCH_BLOCKS
#define KVPILOT_PREFETCH_BLOCKS 2
#endif
// Key blocks requested ahead of the one being computed.
constexpr int kPrefetchBlocks = KVPILOT_PREFETCH_BLOCKS;

#ifndef KVPILOT_ROWS_PREFETCH_BLOCKS
#define KVPILOT_ROWS_PREFETCH_BLOCKS 3
#endif
// The same for the decode paths that read the cache in place (attend_bf16_rows, attend_rows_8), which
// request them into L2 only (prefetcht1): at 64 decodes of 512 tokens (d = 64, one thread, head-major
// pool) 3 or 4 blocks ahead into L2 measured 4.1 ms a layer, 2 blocks into L1 4.4 ms, 6 or 8 blocks
// 4.6-4.8 ms, none 6.5 ms (AVX512-BF16). On an AVX2 CPU the scratch path measured the same with 2 to
// 8 blocks ahead into L1 or L2.
constexpr int kRowsPrefetchBlocks = KVPILOT_ROWS_PREFETCH_BLOCKS;

// Keys per online-softmax step of a prefill tile (whole blocks, at least one): with many rows the max,
// exp-sum and rescale of each row are paid once per this many keys rather than once per block (1.3x on
// a prefill tile). A decode item (rows <= kChunkMinRows) steps block by block: it is bound by reading
// K/V, and the larger step measured 10-15% slower there.
constexpr int kChunkKeys = 64;
constexpr int kChunkMinRows = 8;

inline int blocks_per_chunk(int block_size) { return std::max(1, kChunkKeys / block_size); }

struct WorkItem {
  int req;
  int kv_head;
  int q_begin;  // query tokens [q_begin, q_end) of the request
  int q_end;
  int64_t cost;
};

// An item's cached context (tokens before its request's query span), its first query token in the
// flattened batch, and its rows (query tokens x the query heads of its KV head).
struct ItemSpan {
  int context, first_token, rows;
};

inline ItemSpan item_span(const WorkItem& item, const int32_t* query_start_loc, const int32_t* seq_lens,
                          int group) {
  const int q_len = query_start_loc[item.req + 1] - query_start_loc[item.req];
  return {seq_lens[item.req] - q_len, query_start_loc[item.req] + item.q_begin,
          (item.q_end - item.q_begin) * group};
}

struct Strides {
  int64_t q_token, q_head;
  int64_t k_block, k_token, k_head;
  int64_t v_block, v_token, v_head;
  int64_t table_row;
};

inline int round_up_16(int n) { return (n + 15) / 16 * 16; }

// Key rows and score rows (one chunk of keys) are padded to a multiple of 16 for the 16-key score
// kernel; padding rows hold zeros or stale (finite) converted keys, and their scores are masked.
struct Scratch {
  std::vector<float> q, acc, k, v, s, m, l;
  explicit Scratch(int rows, int chunk, int d)
      : q(rows * d),
        acc(rows * d),
        k(round_up_16(chunk) * d),
        v(round_up_16(chunk) * d),
        s(rows * round_up_16(chunk)),
        m(rows),
        l(rows) {}
};

#if defined(__AVX512F__)
// acc[r] += sum over keys k < num_keys of p[r][k] * v[k], for rows r0 .. r0 + R - 1 together: each V
// row is loaded once for the R rows (``load_v(k, v)`` fills its HEAD / 16 fp32 registers), and the
// R * HEAD / 16 accumulators stay in registers.
template <int HEAD, int R, typename LoadV>
inline void pv_rows(const float* s, int s_stride, float* acc, int r0, int num_keys, const LoadV& load_v) {
  constexpr int kVecs = HEAD / 16;
  __m512 a[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) a[r][j] = _mm512_loadu_ps(acc + (r0 + r) * HEAD + 16 * j);
  for (int k = 0; k < num_keys; ++k) {
    __m512 v[kVecs];
    load_v(k, v);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(s[(r0 + r) * s_stride + k]);
      for (int j = 0; j < kVecs; ++j) a[r][j] = _mm512_fmadd_ps(p, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(acc + (r0 + r) * HEAD + 16 * j, a[r][j]);
}

// pv_rows for n <= R rows (the count chosen at run time, the register blocking at compile time).
template <int HEAD, int R, typename LoadV>
inline void pv_upto(int n, const float* s, int s_stride, float* acc, int r0, int num_keys, const LoadV& load_v) {
  if constexpr (R > 1) {
    if (n < R) return pv_upto<HEAD, R - 1>(n, s, s_stride, acc, r0, num_keys, load_v);
  }
  pv_rows<HEAD, R>(s, s_stride, acc, r0, num_keys, load_v);
}

// The online-softmax step of one row over a chunk of scores ``sr`` (``visible`` of ``num_keys`` lanes
// valid, their max ``block_max``): p = exp(s - new max) overwrites the scores (0 past ``visible``), the
// row's accumulator ``acc`` (d values) and sum ``l`` are rescaled when its running max ``m`` rose, and
// the sum of p is added to ``l``.
inline void softmax_step_16(float* sr, int num_keys, int visible, float block_max, float& m, float& l,
                            float* acc, int d) {
  const float new_max = std::max(m, block_max);
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < num_keys; c += 16) {
    const __m512 p = _mm512_maskz_mov_ps(first_lanes(visible - c),
                                         exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), shift)));
    sum = _mm512_add_ps(sum, p);
    _mm512_storeu_ps(sr + c, p);
  }
  if (new_max != m) {
    // The first visible block has m = -inf: alpha 0 keeps the empty accumulator empty.
    const float alpha = std::isinf(m) ? 0.0f : exp_nonpositive(m - new_max);
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] *= alpha;
    l *= alpha;
    m = new_max;
  }
  l += _mm512_reduce_add_ps(sum);
}

// V rows already converted to fp32 (``vf``, HEAD apart).
template <int HEAD>
inline auto fp32_rows(const float* vf) {
  return [vf](int k, __m512* v) {
    const float* vr = vf + k * HEAD;
    for (int j = 0; j < HEAD / 16; ++j) v[j] = _mm512_loadu_ps(vr + 16 * j);
  };
}
#elif defined(KVPILOT_AVX2)
// softmax_step_16 on 8-wide registers.
inline void softmax_step_8(float* sr, int num_keys, int visible, float block_max, float& m, float& l, float* acc,
                           int d) {
  const float new_max = std::max(m, block_max);
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 sum = _mm256_setzero_ps();
  for (int c = 0; c < num_keys; c += 8) {
    const __m256 p = _mm256_and_ps(first_lanes_8(visible - c),
                                   exp_nonpositive_8(_mm256_sub_ps(_mm256_loadu_ps(sr + c), shift)));
    sum = _mm256_add_ps(sum, p);
    _mm256_storeu_ps(sr + c, p);
  }
  if (new_max != m) {
    // The first visible block has m = -inf: alpha 0 keeps the empty accumulator empty.
    const float alpha = std::isinf(m) ? 0.0f : exp_nonpositive(m - new_max);
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] *= alpha;
    l *= alpha;
    m = new_max;
  }
  l += reduce_add_8(sum);
}

// acc[r][c0, c0 + 8 V) += sum over keys k < num_keys of p[r][k] * v[k][c0, c0 + 8 V), for rows r0 ..
// r0 + R - 1 together: each V vector (``load_v(k, column)``, 8 fp32 values) is loaded once for the R
// rows, and the R * V accumulators stay in registers. GCC kept a copy of the accumulator array on the
// stack, stored on every key (1.5x the time of a whole prefill item), unless its loops are unrolled
// before it is split into registers: hence the pragmas and the flat array.
template <int HEAD, int R, int V, typename LoadV>
inline void pv_rows_8(const float* s, int s_stride, float* acc, int r0, int c0, int num_keys,
                      const LoadV& load_v) {
  __m256 a[R * V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) a[r * V + j] = _mm256_loadu_ps(acc + (r0 + r) * HEAD + c0 + 8 * j);
  for (int k = 0; k < num_keys; ++k) {
    __m256 p[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) p[r] = _mm256_broadcast_ss(s + (r0 + r) * s_stride + k);
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) {
      const __m256 v = load_v(k, c0 + 8 * j);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) a[r * V + j] = _mm256_fmadd_ps(p[r], v, a[r * V + j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + (r0 + r) * HEAD + c0 + 8 * j, a[r * V + j]);
}

// The column registers of one pv_rows_8 pass over R rows: the largest divisor of the row's vectors
// with at most 12 accumulators, which leaves the 16 registers room for the R probabilities and a V
// vector (a row's HEAD / 8 accumulators alone may not fit).
constexpr int pv_columns_8(int vecs, int rows) {
  for (int v = std::min(vecs, 8); v > 1; --v)
    if (vecs % v == 0 && v * rows <= 12) return v;
  return 1;
}

// acc += P V for the n <= R rows r0 .. r0 + n - 1 (the count chosen at run time, the register blocking
// at compile time), all columns, column registers a pass.
template <int HEAD, int R, typename LoadV>
inline void pv_upto_8(int n, const float* s, int s_stride, float* acc, int r0, int num_keys, const LoadV& load_v) {
  if constexpr (R > 1) {
    if (n < R) return pv_upto_8<HEAD, R - 1>(n, s, s_stride, acc, r0, num_keys, load_v);
  }
  constexpr int kCols = pv_columns_8(HEAD / 8, R);
  for (int c0 = 0; c0 < HEAD; c0 += 8 * kCols)
    pv_rows_8<HEAD, R, kCols>(s, s_stride, acc, r0, c0, num_keys, load_v);
}

// The rows of a pv_rows_8 pass over fp32 scratch rows: the fewest that give 8 accumulators, enough
// independent FMA chains to hide the FMA latency. More rows (fewer columns) a pass measured no faster
// on 512-token prefills (d = 32, 64, 128, one thread), 10-15% slower at d = 64 and 128.
constexpr int pv_rows_for_8(int vecs) {
  int r = 1;
  while (r * pv_columns_8(vecs, r) < 8 && r < 8) ++r;
  return r;
}

// acc += P V for all rows, R at a time.
template <int HEAD, int R, typename LoadV>
inline void pv_8(int rows, const float* s, int s_stride, float* acc, int num_keys, const LoadV& load_v) {
  for (int r0 = 0; r0 < rows; r0 += R)
    pv_upto_8<HEAD, R>(std::min(R, rows - r0), s, s_stride, acc, r0, num_keys, load_v);
}

// Rows of fp32 values HEAD apart (V converted into scratch), or of the cache (``stride`` apart), for
// pv_rows_8.
template <int HEAD>
inline auto fp32_rows_8(const float* vf) {
  return [vf](int k, int column) { return _mm256_loadu_ps(vf + k * HEAD + column); };
}
template <typename C>
inline auto cache_rows_8(const C* rows, int64_t stride) {
  return [rows, stride](int k, int column) { return load8_fp32(rows + k * stride + column); };
}

// Scores of one fp32 query row (HEAD values) against the first n <= 8 key rows of the cache (``stride``
// apart), converted in registers; lanes from n on are 0 and no row past n is read.
template <int HEAD, typename C>
inline __m256 scores_8_rows(const float* q, const C* keys, int64_t stride, int n) {
  __m256 acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
  if (n >= 8) {
    for (int i = 0; i < HEAD; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qi, load8_fp32(keys + k * stride + i), acc[k]);
    }
  } else {
    for (int i = 0; i < HEAD; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
      for (int k = 0; k < n; ++k) acc[k] = _mm256_fmadd_ps(qi, load8_fp32(keys + k * stride + i), acc[k]);
    }
  }
  return sum_lanes_8(acc);
}

// The path of an item with few rows (decode) on AVX2: K and V are read straight from the cache (any of
// the three types) and converted in registers, with no fp32 copy in scratch; block by block.
template <typename T, typename C, int HEAD>
void attend_rows_8(const WorkItem& item, const T* query, const C* k_cache, const C* v_cache, T* out,
                   const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_tables,
                   const Strides& st, int num_heads, int group, int block_size, float scale, Scratch& sc) {
  constexpr int d = HEAD;
  const auto [context, first_token, rows] = item_span(item, query_start_loc, seq_lens, group);
  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    float* row = q + r * d;
    load_row(query + token * st.q_token + q_head * st.q_head, row, d);
#pragma omp simd
    for (int i = 0; i < d; ++i) row[i] *= scale;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int s_stride = round_up_16(block_size);
  const int kv_end = context + item.q_end;
  const int32_t* table = block_tables + item.req * st.table_row;
  const C* kc = k_cache + item.kv_head * st.k_head;
  const C* vc = v_cache + item.kv_head * st.v_head;
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int base = 0, blk = 0; base < kv_end; base += block_size, ++blk) {
    const int num_keys = std::min(block_size, kv_end - base);
    for (int ahead = blk == 0 ? 1 : kRowsPrefetchBlocks; ahead <= kRowsPrefetchBlocks; ++ahead) {
      const int ahead_base = base + ahead * block_size;
      if (ahead_base >= kv_end) break;
      const int64_t next = table[blk + ahead];
      const int next_keys = std::min(block_size, kv_end - ahead_base);
      prefetch_rows<2>(kc + next * st.k_block, st.k_token, next_keys, d);
      prefetch_rows<2>(vc + next * st.v_block, st.v_token, next_keys, d);
    }
    const C* kb = kc + int64_t(table[blk]) * st.k_block;
    const C* vb = vc + int64_t(table[blk]) * st.v_block;
    int max_visible = 0;
    for (int r = 0; r < rows; ++r) {
      const int position = context + item.q_begin + r / group;
      const int visible = std::min(num_keys, position - base + 1);
      float* sr = s + r * s_stride;
      if (visible <= 0) {
        std::fill(sr, sr + num_keys, 0.0f);
        continue;
      }
      max_visible = std::max(max_visible, visible);
      __m256 max8 = minus_inf;
      for (int c = 0; c < visible; c += 8) {
        const __m256 sc8 = _mm256_blendv_ps(
            minus_inf, scores_8_rows<HEAD>(q + r * d, kb + c * st.k_token, st.k_token, visible - c),
            first_lanes_8(visible - c));
        max8 = _mm256_max_ps(max8, sc8);
        _mm256_storeu_ps(sr + c, sc8);
      }
      softmax_step_8(sr, num_keys, visible, reduce_max_8(max8), m[r], l[r], acc + r * d, d);
    }
    // All rows in one pass (rows <= kChunkMinRows): each V row is read and converted once.
    pv_8<HEAD, kChunkMinRows>(rows, s, s_stride, acc, max_visible, cache_rows_8(vb, st.v_token));
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    store_row(acc + r * d, 1.0f / l[r], out + (token * num_heads + q_head) * d, d);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bfloat16 path of an item with few rows (decode): K and V are read straight from the cache, with
// no fp32 copy in scratch.
//
// Scores: VDPBF16PS on the raw key rows and the unscaled bfloat16 query (each product of two bfloat16
// is exact in fp32; sums are fp32; the instruction treats subnormal inputs and results as zero), the
// scale applied to the 16 fp32 scores afterwards.
// PV: a 64-byte load of 32 bfloat16 holds them in pairs per 32-bit lane; a shift by 16 gives the even
// elements as fp32, masking off the low half the odd ones (exact, one instruction each). p stays fp32.
// The accumulator of a row is thus kept de-interleaved: per 32 elements, the 16 even ones, then the
// 16 odd ones; the final store interleaves them back.

inline __m512bh as_bf16_pairs(__m512i x) { return __builtin_bit_cast(__m512bh, x); }

// Scores of one query row (HEAD / 32 registers of bfloat16 pairs) against the first n <= 16 key rows
// of `keys` (row stride `stride` elements); lanes from n on are 0 and no memory past row n is read.
template <int HEAD>
inline __m512 scores_16_bf16(const __m512bh* q, const uint16_t* keys, int64_t stride, int n) {
  constexpr int kPairs = HEAD / 32;
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) {
    __m512 a = _mm512_setzero_ps();
    if (k < n) {
      const uint16_t* kr = keys + k * stride;
      for (int j = 0; j < kPairs; ++j)
        a = _mm512_dpbf16_ps(a, q[j], as_bf16_pairs(_mm512_loadu_si512(kr + 32 * j)));
    }
    acc[k] = a;
  }
  return sum_lanes_16(acc);
}

// bfloat16 V rows (``vals + k * stride``) converted in registers; the accumulator de-interleaved (see
// above).
template <int HEAD>
inline auto bf16_rows(const uint16_t* vals, int64_t stride) {
  return [vals, stride](int k, __m512* v) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const uint16_t* vr = vals + k * stride;
    for (int j = 0; j < HEAD / 32; ++j) {
      const __m512i raw = _mm512_loadu_si512(vr + 32 * j);
      v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
  };
}

// attend() for bfloat16, HEAD a multiple of 32 and at most kChunkMinRows rows: block by block.
template <int HEAD>
void attend_bf16_rows(const WorkItem& item, const c10::BFloat16* query, const c10::BFloat16* k_cache,
                      const c10::BFloat16* v_cache, c10::BFloat16* out, const int32_t* query_start_loc,
                      const int32_t* seq_lens, const int32_t* block_tables, const Strides& st, int num_heads,
                      int group, int block_size, float scale, Scratch& sc) {
  constexpr int d = HEAD;
  constexpr int kPairs = HEAD / 32;
  const auto [context, first_token, rows] = item_span(item, query_start_loc, seq_lens, group);
  float* acc = sc.acc.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  __m512bh q[kChunkMinRows][kPairs];
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(query + token * st.q_token + q_head * st.q_head);
    for (int j = 0; j < kPairs; ++j) q[r][j] = as_bf16_pairs(_mm512_loadu_si512(src + 32 * j));
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int s_stride = round_up_16(block_size);
  const int kv_end = context + item.q_end;
  const int32_t* table = block_tables + item.req * st.table_row;
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache) + item.kv_head * st.k_head;
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache) + item.kv_head * st.v_head;
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int base = 0, blk = 0; base < kv_end; base += block_size, ++blk) {
    const int num_keys = std::min(block_size, kv_end - base);
    for (int ahead = blk == 0 ? 1 : kRowsPrefetchBlocks; ahead <= kRowsPrefetchBlocks; ++ahead) {
      const int ahead_base = base + ahead * block_size;
      if (ahead_base >= kv_end) break;
      const int64_t next = table[blk + ahead];
      const int next_keys = std::min(block_size, kv_end - ahead_base);
      prefetch_rows<2>(kc + next * st.k_block, st.k_token, next_keys, d);
      prefetch_rows<2>(vc + next * st.v_block, st.v_token, next_keys, d);
    }
    const uint16_t* kb = kc + int64_t(table[blk]) * st.k_block;
    const uint16_t* vb = vc + int64_t(table[blk]) * st.v_block;
    int max_visible = 0;
    for (int r = 0; r < rows; ++r) {
      const int position = context + item.q_begin + r / group;
      const int visible = std::min(num_keys, position - base + 1);
      float* sr = s + r * s_stride;
      if (visible <= 0) {
        std::fill(sr, sr + num_keys, 0.0f);
        continue;
      }
      max_visible = std::max(max_visible, visible);
      float block_max = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < visible; c += 16) {
        const __m512 dots = scores_16_bf16<HEAD>(q[r], kb + c * st.k_token, st.k_token, visible - c);
        const __m512 sc16 =
            _mm512_mask_blend_ps(first_lanes(visible - c), minus_inf, _mm512_mul_ps(dots, scale16));
        block_max = std::max(block_max, _mm512_reduce_max_ps(sc16));
        _mm512_storeu_ps(sr + c, sc16);
      }
      softmax_step_16(sr, num_keys, visible, block_max, m[r], l[r], acc + r * d, d);
    }
    constexpr int kVecs = HEAD / 16;
    constexpr int kRows = kVecs >= 16 ? 1 : 16 / kVecs;
    for (int r0 = 0; r0 < rows; r0 += kRows)
      pv_upto<HEAD, kRows>(std::min(kRows, rows - r0), s, s_stride, acc, r0, max_visible,
                            bf16_rows<HEAD>(vb, st.v_token));
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    c10::BFloat16* dst = out + (token * num_heads + q_head) * d;
    const float inv = 1.0f / l[r];
    const float* ar = acc + r * d;
    for (int c = 0; c < d; c += 32)
      for (int j = 0; j < 16; ++j) {
        dst[c + 2 * j] = static_cast<c10::BFloat16>(ar[c + j] * inv);
        dst[c + 2 * j + 1] = static_cast<c10::BFloat16>(ar[c + 16 + j] * inv);
      }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVPILOT_AMX 1
// The bfloat16 path of an item with many rows (a prefill tile) on AMX: the query rows and the scores
// run through the tile unit in 16 x 16 fp32 tiles.
//
//   S = Q K^T   A = 16 query rows x 32 dims (bfloat16, as stored), B = K^T in pairs: a 16 x 16
//               transpose of the 32-bit dimension pairs of 16 keys (transpose_16x16_epi32)
//   O += P V    A = 16 rows x 32 keys of P rounded to bfloat16, B = 32 keys x 16 dims of V with
//               the rows of each key pair interleaved
//
// The online softmax between the two is the fp32 path's (per row, over a chunk of up to kChunkKeys
// keys). Products are exact in fp32 and sums fp32 as in the AVX512-BF16 path; P is rounded to
// bfloat16 for the PV product (as flash attention does on GPUs), the row sums l stay fp32.

// Whether this process may use the tile registers: Linux hands them out on request (once per process).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2, each 16 rows of 64 bytes: 0 the fp32 product, 1 A, 2 B.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Rows become columns: r[i] lane j <- r[j] lane i, for 16 rows of 16 32-bit lanes.
inline void transpose_16x16_epi32(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4g + k]: rows 4g .. 4g + 3 at column 4L + k, in 128-bit lane L
  for (int g = 0; g < 4; ++g) {
    const __m512i *a = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(a[0], a[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(a[0], a[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(a[1], a[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(a[1], a[3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v_lo = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
    const __m512i w_lo = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i v_hi = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i w_hi = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(v_lo, w_lo, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(v_lo, w_lo, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(v_hi, w_hi, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v_hi, w_hi, 0xDD);
  }
}

struct AmxScratch {
  std::vector<uint16_t> q, kt, vv, p;
  std::vector<float> s, acc, m, l;
};

template <int HEAD>
void attend_amx(const WorkItem& item, const c10::BFloat16* query, const c10::BFloat16* k_cache,
                const c10::BFloat16* v_cache, c10::BFloat16* out, const int32_t* query_start_loc,
                const int32_t* seq_lens, const int32_t* block_tables, const Strides& st, int num_heads, int group,
                int block_size, float scale) {
  static_assert(HEAD % 32 == 0, "AMX tiles take 32 dimensions at a time");
  constexpr int d = HEAD;
  constexpr int kSlabs = HEAD / 32;  // 32-dimension slabs of a key (QK) ...
  constexpr int kCols = HEAD / 16;   // ... and 16-dimension column tiles of V (PV)
  thread_local AmxScratch sc;
  const auto [context, first_token, rows] = item_span(item, query_start_loc, seq_lens, group);
  const int padded_rows = round_up_16(rows);
  const int chunk_blocks = blocks_per_chunk(block_size);
  const int chunk = chunk_blocks * block_size;
  const int cp = (chunk + 31) / 32 * 32;  // keys per chunk, padded to whole PV tiles
  sc.q.assign(static_cast<size_t>(padded_rows) * d, 0);
  sc.kt.resize(static_cast<size_t>(cp) * d);
  sc.vv.resize(static_cast<size_t>(cp) * d);
  sc.p.resize(static_cast<size_t>(padded_rows) * cp);
  sc.s.resize(static_cast<size_t>(padded_rows) * cp);
  sc.acc.assign(static_cast<size_t>(padded_rows) * d, 0.0f);
  sc.m.assign(padded_rows, -std::numeric_limits<float>::infinity());
  sc.l.assign(padded_rows, 0.0f);
  uint16_t* qb = sc.q.data();
  float* s = sc.s.data();
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(query + token * st.q_token + q_head * st.q_head);
    std::copy(src, src + d, qb + r * d);
  }
  configure_tiles();
  const int kv_end = context + item.q_end;
  const int32_t* table = block_tables + item.req * st.table_row;
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache) + item.kv_head * st.k_head;
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache) + item.kv_head * st.v_head;
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i zero = _mm512_setzero_si512();
  // Interleaves two 16-element bfloat16 rows a, b (in the low and high halves) as a0 b0 a1 b1 ...
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int base = 0, blk = 0; base < kv_end; base += chunk, blk += chunk_blocks) {
    const int num_keys = std::min(chunk, kv_end - base);
    auto key_row = [&](const uint16_t* cache, int64_t block_stride, int64_t token_stride, int k) {
      return cache + int64_t(table[blk + k / block_size]) * block_stride + (k % block_size) * token_stride;
    };
    // K^T tiles: for key tile kt and slab j, 16 rows (dimension pairs) of 16 keys.
    for (int kt = 0; kt < cp / 16; ++kt) {
      const uint16_t* krow[16];
      for (int n = 0; n < 16; ++n) {
        const int k = kt * 16 + n;
        krow[n] = k < num_keys ? key_row(kc, st.k_block, st.k_token, k) : nullptr;
      }
      for (int j = 0; j < kSlabs; ++j) {
        __m512i r[16];
        for (int n = 0; n < 16; ++n) r[n] = krow[n] ? _mm512_loadu_si512(krow[n] + 32 * j) : zero;
        transpose_16x16_epi32(r);
        uint16_t* dst = sc.kt.data() + (static_cast<size_t>(kt) * kSlabs + j) * 512;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + 32 * p, r[p]);
      }
    }
    // S = Q K^T, tile by tile.
    for (int rt = 0; rt < padded_rows / 16; ++rt) {
      for (int kt = 0; kt < cp / 16; ++kt) {
        _tile_zero(0);
        for (int j = 0; j < kSlabs; ++j) {
          _tile_loadd(1, qb + rt * 16 * d + 32 * j, d * 2);
          _tile_loadd(2, sc.kt.data() + (static_cast<size_t>(kt) * kSlabs + j) * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, s + rt * 16 * cp + kt * 16, cp * 4);
      }
    }
    // V in key pairs: for 32-key slab kk and column tile c, 16 rows of 16 interleaved pairs.
    for (int kk = 0; kk < cp / 32; ++kk) {
      for (int pr = 0; pr < 16; ++pr) {
        const int k0 = kk * 32 + 2 * pr, k1 = k0 + 1;
        const uint16_t* v0 = k0 < num_keys ? key_row(vc, st.v_block, st.v_token, k0) : nullptr;
        const uint16_t* v1 = k1 < num_keys ? key_row(vc, st.v_block, st.v_token, k1) : nullptr;
        for (int c = 0; c < kCols; ++c) {
          const __m256i a = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c))
                               : _mm256_setzero_si256();
          const __m256i b = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c))
                               : _mm256_setzero_si256();
          const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
          uint16_t* dst = sc.vv.data() + (static_cast<size_t>(kk) * kCols + c) * 512 + 32 * pr;
          _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(pairs, ab));
        }
      }
    }
    // The online softmax, row by row; P in bfloat16 for the PV tiles.
    for (int r = 0; r < padded_rows; ++r) {
      float* sr = s + r * cp;
      uint16_t* pr = sc.p.data() + r * cp;
      const int position = context + item.q_begin + r / group;
      const int visible = r < rows ? std::min(num_keys, position - base + 1) : 0;
      if (visible <= 0) {
        std::fill(pr, pr + cp, 0);
        continue;
      }
      __m512 block_max = minus_inf;
      for (int c = 0; c < visible; c += 16) {
        const __m512 v = _mm512_mask_blend_ps(first_lanes(visible - c), minus_inf,
                                              _mm512_mul_ps(_mm512_loadu_ps(sr + c), scale16));
        block_max = _mm512_max_ps(block_max, v);
        _mm512_storeu_ps(sr + c, v);
      }
      // softmax_step_16 with P written as bfloat16 pairs in the same pass (a separate conversion pass
      // measured 4-5% slower on the workload's prefill attention).
      const float new_max = std::max(m[r], _mm512_reduce_max_ps(block_max));
      const __m512 shift = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < cp; c += 32) {
        const __m512 p0 = _mm512_maskz_mov_ps(first_lanes(visible - c),
                                              exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), shift)));
        const __m512 p1 = _mm512_maskz_mov_ps(
            first_lanes(visible - c - 16), exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(sr + c + 16), shift)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_storeu_si512(pr + c, __builtin_bit_cast(__m512i, _mm512_cvtne2ps_pbh(p1, p0)));
      }
      if (new_max != m[r]) {
        const float alpha = std::isinf(m[r]) ? 0.0f : exp_nonpositive(m[r] - new_max);
        float* ar = acc + r * d;
        for (int i = 0; i < d; ++i) ar[i] *= alpha;
        l[r] *= alpha;
        m[r] = new_max;
      }
      l[r] += _mm512_reduce_add_ps(sum);
    }
    // O += P V.
    for (int rt = 0; rt < padded_rows / 16; ++rt) {
      for (int c = 0; c < kCols; ++c) {
        float* ac = acc + rt * 16 * d + 16 * c;
        _tile_loadd(0, ac, d * 4);
        for (int kk = 0; kk < cp / 32; ++kk) {
          _tile_loadd(1, sc.p.data() + rt * 16 * cp + 32 * kk, cp * 2);
          _tile_loadd(2, sc.vv.data() + (static_cast<size_t>(kk) * kCols + c) * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, ac, d * 4);
      }
    }
  }
  _tile_release();
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    store_row(acc + r * d, 1.0f / l[r], out + (token * num_heads + q_head) * d, d);
  }
}
#endif

// T: the query's and output's element type, C: the caches'. HEAD: the head size when known at compile
// time (fixed trip counts), 0 for any.
template <typename T, typename C, int HEAD>
void attend(const WorkItem& item, const T* query, const C* k_cache, const C* v_cache, T* out,
            const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_tables,
            const Strides& st, int num_heads, int group, int block_size, int head, float scale, Scratch& sc) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && HEAD > 0 &&
                HEAD % 32 == 0) {
    if ((item.q_end - item.q_begin) * group <= kChunkMinRows)
      return attend_bf16_rows<HEAD>(item, query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
                                    st, num_heads, group, block_size, scale, sc);
#if defined(KVPILOT_AMX)
    if (amx_permitted())
      return attend_amx<HEAD>(item, query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, st,
                              num_heads, group, block_size, scale);
#endif
  }
#elif defined(KVPILOT_AVX2)
  if constexpr (HEAD > 0 && HEAD % 8 == 0) {
    if ((item.q_end - item.q_begin) * group <= kChunkMinRows)
      return attend_rows_8<T, C, HEAD>(item, query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
                                       st, num_heads, group, block_size, scale, sc);
  }
#endif
  const int d = HEAD ? HEAD : head;
  const auto [context, first_token, rows] = item_span(item, query_start_loc, seq_lens, group);
  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* kf = sc.k.data();
  float* vf = sc.v.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  // Row r is query token first_token + r / group, head kv_head * group + r % group.
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    const T* src = query + token * st.q_token + q_head * st.q_head;
    float* row = q + r * d;
    load_row(src, row, d);
#pragma omp simd
    for (int i = 0; i < d; ++i) row[i] *= scale;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int chunk_blocks = rows > kChunkMinRows ? blocks_per_chunk(block_size) : 1;
  const int chunk = chunk_blocks * block_size;
  const int s_stride = round_up_16(chunk);
  const bool wide = kWide && d % kLanes == 0;
  // A row's running max rose to new_max: scale its accumulator and sum by exp(old - new).
  auto rescale = [&](int r, float new_max) {
    if (new_max == m[r]) return;
    // The first visible block has m = -inf: alpha 0 keeps the empty accumulator empty.
    const float alpha = std::isinf(m[r]) ? 0.0f : exp_nonpositive(m[r] - new_max);
    float* ar = acc + r * d;
#pragma omp simd
    for (int i = 0; i < d; ++i) ar[i] *= alpha;
    l[r] *= alpha;
    m[r] = new_max;
  };
  // Keys at positions < kv_end are visible to the item's last query token (at context + q_end - 1).
  const int kv_end = context + item.q_end;
  const int32_t* table = block_tables + item.req * st.table_row;
  // Converts the chunk's first n keys (or values) to fp32 rows dst[0 .. n): key k lies in block
  // table[blk + k / block_size] (walked block by block, no division per key).
  int blk = 0;
  auto load_keys = [&](const C* cache, int64_t block_stride, int64_t head_offset, int64_t token_stride,
                       int n, float* dst) {
    for (int j = 0, k0 = 0; k0 < n; ++j, k0 += block_size) {
      const C* b = cache + int64_t(table[blk + j]) * block_stride + head_offset;
      const int stop = std::min(block_size, n - k0);
      for (int k = 0; k < stop; ++k) load_row(b + k * token_stride, dst + (k0 + k) * d, d);
    }
  };
  for (int base = 0; base < kv_end; base += chunk, blk += chunk_blocks) {
    const int num_keys = std::min(chunk, kv_end - base);
    // This head's rows are short runs spread over each block (its token stride is all KV heads): the
    // hardware prefetcher misses them, so ask for the blocks ahead while this chunk is computed.
    const int ahead_blocks = std::max(kPrefetchBlocks, chunk_blocks);
    for (int ahead = blk == 0 ? 1 : ahead_blocks; ahead < chunk_blocks + ahead_blocks; ++ahead) {
      const int ahead_base = base + ahead * block_size;
      if (ahead_base >= kv_end) break;
      const int64_t next = table[blk + ahead];
      const int next_keys = std::min(block_size, kv_end - ahead_base);
      prefetch_rows(k_cache + next * st.k_block + item.kv_head * st.k_head, st.k_token, next_keys, d);
      prefetch_rows(v_cache + next * st.v_block + item.kv_head * st.v_head, st.v_token, next_keys, d);
    }
    load_keys(k_cache, st.k_block, item.kv_head * st.k_head, st.k_token, num_keys, kf);
    // Scores and the online-softmax update, row by row; p overwrites the scores.
    int max_visible = 0;
    for (int r = 0; r < rows; ++r) {
      const int position = context + item.q_begin + r / group;
      const int visible = std::min(num_keys, position - base + 1);
      float* sr = s + r * s_stride;
      if (visible <= 0) {
        std::fill(sr, sr + num_keys, 0.0f);
        continue;
      }
      max_visible = std::max(max_visible, visible);
      const float* qr = q + r * d;
      float block_max = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
      if (wide) {
        // Scores, max, exp and sum in registers, 16 keys at a time; lanes past `visible` are masked.
        const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int c = 0; c < visible; c += 16) {
          const __m512 sc16 = _mm512_mask_blend_ps(first_lanes(visible - c), minus_inf,
                                                   scores_16<HEAD>(qr, kf + c * d, d));
          block_max = std::max(block_max, _mm512_reduce_max_ps(sc16));
          _mm512_storeu_ps(sr + c, sc16);
        }
        softmax_step_16(sr, num_keys, visible, block_max, m[r], l[r], acc + r * d, d);
        continue;
      }
#elif defined(KVPILOT_AVX2)
      if (wide) {
        // Scores, max, exp and sum in registers, 8 keys at a time; lanes past `visible` are masked.
        const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        __m256 max8 = minus_inf;
        for (int c = 0; c < visible; c += 8) {
          const __m256 sc8 =
              _mm256_blendv_ps(minus_inf, scores_8<HEAD>(qr, kf + c * d, d), first_lanes_8(visible - c));
          max8 = _mm256_max_ps(max8, sc8);
          _mm256_storeu_ps(sr + c, sc8);
        }
        softmax_step_8(sr, num_keys, visible, reduce_max_8(max8), m[r], l[r], acc + r * d, d);
        continue;
      }
#endif
      {
        for (int k = 0; k < visible; ++k) {
          const float* kr = kf + k * d;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int i = 0; i < d; ++i) dot += qr[i] * kr[i];
          sr[k] = dot;
        }
      }
      for (int k = 0; k < visible; ++k) block_max = std::max(block_max, sr[k]);
      const float new_max = std::max(m[r], block_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int k = 0; k < visible; ++k) {
        const float p = exp_nonpositive(sr[k] - new_max);
        sr[k] = p;
        sum += p;
      }
      for (int k = visible; k < num_keys; ++k) sr[k] = 0.0f;
      rescale(r, new_max);
      l[r] += sum;
    }
#if defined(__AVX512F__)
    if constexpr (HEAD > 0) {
      if (wide) {
        load_keys(v_cache, st.v_block, item.kv_head * st.v_head, st.v_token, max_visible, vf);
        // kRows rows at a time, so that about 16 independent FMA chains hide the FMA latency (one row
        // alone is HEAD / 16 chains, each as long as the block).
        constexpr int kVecs = HEAD / 16;
        constexpr int kRows = kVecs >= 16 ? 1 : 16 / kVecs;
        for (int r0 = 0; r0 < rows; r0 += kRows)
          pv_upto<HEAD, kRows>(std::min(kRows, rows - r0), s, s_stride, acc, r0, max_visible,
                               fp32_rows<HEAD>(vf));
        continue;
      }
    }
#elif defined(KVPILOT_AVX2)
    if constexpr (HEAD > 0) {
      if (wide) {
        load_keys(v_cache, st.v_block, item.kv_head * st.v_head, st.v_token, max_visible, vf);
        pv_8<HEAD, pv_rows_for_8(HEAD / 8)>(rows, s, s_stride, acc, max_visible, fp32_rows_8<HEAD>(vf));
        continue;
      }
    }
#endif
    load_keys(v_cache, st.v_block, item.kv_head * st.v_head, st.v_token, max_visible, vf);
    for (int k = 0; k < max_visible; ++k) {
      const float* vr = vf + k * d;
      for (int r = 0; r < rows; ++r) {
        const float p = s[r * s_stride + k];
        float* ar = acc + r * d;
#pragma omp simd
        for (int i = 0; i < d; ++i) ar[i] += p * vr[i];
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_token + r / group, q_head = item.kv_head * group + r % group;
    T* dst = out + (token * num_heads + q_head) * d;
    store_row(acc + r * d, 1.0f / l[r], dst, d);
  }
}

template <typename T, typename C, int HEAD>
void run(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
         double scale) {
  const int num_heads = query.size(1);
  const int head = query.size(2);
  const int block_size = k_cache.size(1);
  const int num_kv_heads = k_cache.size(2);
  const int group = num_heads / num_kv_heads;
  const int num_reqs = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const Strides st{query.stride(0),   query.stride(1),   k_cache.stride(0), k_cache.stride(1),
                   k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                   block_tables.stride(0)};

  std::vector<WorkItem> items;
  items.reserve(static_cast<size_t>(num_reqs) * num_kv_heads);
  for (int r = 0; r < num_reqs; ++r) {
    const int q_len = qsl[r + 1] - qsl[r];
    const int context = lens[r] - q_len;
    for (int q0 = 0; q0 < q_len; q0 += kQueryTile) {
      const int q1 = std::min(q_len, q0 + kQueryTile);
      // Keys read plus scores computed: what the item costs, for the largest-first order.
      const int64_t cost = static_cast<int64_t>(context + q1) * (1 + (q1 - q0) * group);
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({r, h, q0, q1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const T* q = reinterpret_cast<const T*>(query.data_ptr());
  const C* kc = reinterpret_cast<const C*>(k_cache.data_ptr());
  const C* vc = reinterpret_cast<const C*>(v_cache.data_ptr());
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int max_rows = kQueryTile * group;
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(max_rows, blocks_per_chunk(block_size) * block_size, head);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend<T, C, HEAD>(items[i], q, kc, vc, o, qsl, lens, tables, st, num_heads, group, block_size,
                           head, static_cast<float>(scale), sc);
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head(int head, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   at::Tensor& out, const at::Tensor& qsl, const at::Tensor& lens, const at::Tensor& tables,
                   double scale) {
  switch (head) {
    case 32: return run<T, C, 32>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
    case 64: return run<T, C, 64>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
    case 80: return run<T, C, 80>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
    case 96: return run<T, C, 96>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
    case 128: return run<T, C, 128>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
    case 256: return run<T, C, 256>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
    default: return run<T, C, 0>(query, k_cache, v_cache, out, qsl, lens, tables, scale);
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  const at::ScalarType q_type = query.scalar_type(), c_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == c_type, "k_cache and v_cache must share a dtype; got ", c_type, " and ",
              v_cache.scalar_type());
  const bool same = q_type == c_type && (q_type == at::kFloat || q_type == at::kBFloat16 || q_type == at::kHalf);
  const bool widened = q_type == at::kFloat && (c_type == at::kBFloat16 || c_type == at::kHalf);
  TORCH_CHECK(same || widened, "unsupported dtypes: a ", q_type, " query over ", c_type,
              " caches (the caches must be the query's float32, bfloat16 or float16, or bfloat16 or float16 "
              "under a float32 query)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "head sizes differ");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(k_cache.size(2) > 0 && query.size(1) % k_cache.size(2) == 0,
              "num_heads must be a multiple of num_kv_heads");
  for (const auto* t : {&query_start_loc, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata must be contiguous int32");
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.size(0) == 0) return out;
  const int head = query.size(2);
  const auto& qsl = query_start_loc;
  using B = c10::BFloat16;
  using H = c10::Half;
  if (widened && c_type == at::kBFloat16) {
    dispatch_head<float, B>(head, query, k_cache, v_cache, out, qsl, seq_lens, block_tables, scale);
  } else if (widened) {
    dispatch_head<float, H>(head, query, k_cache, v_cache, out, qsl, seq_lens, block_tables, scale);
  } else if (q_type == at::kFloat) {
    dispatch_head<float, float>(head, query, k_cache, v_cache, out, qsl, seq_lens, block_tables, scale);
  } else if (q_type == at::kBFloat16) {
    dispatch_head<B, B>(head, query, k_cache, v_cache, out, qsl, seq_lens, block_tables, scale);
  } else {
    dispatch_head<H, H>(head, query, k_cache, v_cache, out, qsl, seq_lens, block_tables, scale);
  }
  return out;
}

// How many distinct threads an at::parallel_for over n single-item chunks runs on: 1 when the
// extension was built without OpenMP (ATen's parallel_for then runs the range on the caller).
int64_t parallel_width(int64_t n) {
  std::atomic<int64_t> seen{0};
  std::vector<std::atomic<int>> used(std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int64_t t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int64_t>(used.size()) && used[t].exchange(1) == 0) seen.fetch_add(1);
  });
  return seen.load();
}

// Whether bfloat16 prefill tiles run on AMX in this process (built for it and permitted by the OS).
bool uses_amx() {
#if defined(KVPILOT_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the flattened batch (CPU)");
  m.def("rms_norm", &kvpilot_cpu::rms_norm, "RMSNorm (half-precision rounding as torch)");
  m.def("add_rms_norm_", &kvpilot_cpu::add_rms_norm_, "Residual add in place, then RMSNorm");
  m.def("rotary_", &kvpilot_cpu::rotary_, "Neox rotary embedding in place on q and k");
  m.def("silu_and_mul", &kvpilot_cpu::silu_and_mul, "silu(gate) * up");
  m.def("write_kv_cache", &kvpilot_cpu::write_kv_cache, "Store K/V rows in their cache slots");
  m.def("linear_bf16w", &kvpilot_cpu::linear_bf16w, "float32 x times bfloat16-stored weight panels");
  m.def("linear_bf16w_path", &kvpilot_cpu::linear_bf16w_path, "The inner loop linear_bf16w runs here");
  m.def("uses_amx", &uses_amx, "Whether bfloat16 prefill tiles run on AMX");
  m.def("parallel_width", &parallel_width, "Threads an at::parallel_for over n items runs on");
}
