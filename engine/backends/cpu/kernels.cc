// The engine's CPU kernels, XLA FFI custom calls for x86 with AVX2 + FMA (see engine/backends/cpu/kernels.py).
//
// 1. Matmul, y = x @ W. Why: XLA's CPU dot reaches ~30-45 GFLOP/s on the 1..32-row products of decoding and has no fast
// bfloat16 path, so a batch-1 step reads every weight as float32. This kernel streams bfloat16 (or
// float32, or int8: quantized weights, whose per-column scales the caller applies to y, or float8
// e4m3: a checkpoint's FP8 weights, scaled per group of depth rows and column) weights once
// per step, widens them in registers and accumulates in float32. Products of many rows (prompts,
// large batches) run on 16-lane vectors where the CPU has AVX-512: twice the FMAs per instruction.
//
// Layout invariants:
//   x: f32[M, K] row-major.
//   w: T[N / 16, K, 16]: the weight in panels of 16 output columns; panel p holds W[:, 16p:16p+16]
//      row by row, so a micro-tile reads one contiguous stream. N must be a multiple of 16.
//   y: f32[M, N] row-major.
//   scales (float8 weights only): f32[N / 16, K / G, 16] in the weights' panels; W[d, c] is the e4m3
//      value times scales[c / 16, d / G, c % 16] / 256 (the 256 undoes the widening's, see Load8).
//
// 2. Paged attention: each query token against its sequence's cached keys and values, read in
//    place from the page pool. A prompt token is such a query too (its row's page table, the
//    tokens up to and including itself), so this is causal prefill attention as well as decode
//    attention. Why: XLA gathers every row's pages into a padded copy and reduces over the padding
//    too, which cost more than the matmuls at batch 32 and ~20% of a 512-token prefill step.
//    A run of a prompt's consecutive tokens is attended together, so that each key and value load
//    feeds all their query heads. On CPUs with AVX-512 (and pages of 16 tokens) it runs on
//    16-lane vectors: half the instructions per score and per value column. A cache whose values
//    are its keys (latent attention's) is one array in the values' layout, scored row by row.
//
// 1b. Grouped matmul: a mixture of experts' products, rows grouped by expert, each group against its
//    own expert's panels, read in place from the stack of every expert's (XLA on CPUs runs
//    jax.lax.ragged_dot as a product over every expert, and widens bfloat16 weights whole).
//
// 3. SwiGLU's gating, out = silu(g) * u elementwise, read from the fused gate/up matmul's output.
//    Why: XLA runs this fusion on one thread; it took ~1.3 ms of a batch-32 decode step and ~14 ms
//    of a 512-token prefill step, and slicing g and u out of the fused output ~11 ms more.
//
// 4. Greedy decoding's argmax over the vocabulary, the first maximum of each row. Why: XLA's
//    reduction is one-threaded and scalar, ~1.2-1.35 ms for 32 rows of 32000 logits.
//
// All four split their work into chunks that the caller and the XLA intra-op pool threads claim from
// an atomic counter; the caller returns only when every chunk is done.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;   // output columns per panel: two 8-float registers
constexpr int64_t kMR = 6;    // rows per micro-tile: 12 accumulators + 2 weights + 1 broadcast
constexpr int64_t kKC = 1024; // depth block: a panel block (32 / 64 KiB) stays in cache across rows
constexpr int64_t kMC = 96;   // row block: its x block (up to 384 KiB) stays in L2 across panels
// (kKC = 512 split a 768-deep product in two passes, the second re-reading and re-writing y: 5-11%
// slower at 8-32 rows on this 2-core host, equal at 128.)
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead a panel stream is prefetched
constexpr int64_t kStreamRows = 16;       // prefetch for products of up to this many rows (memory-bound)

inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 Load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float32 (a bf16 is a float's top half)
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 Load8(const int8_t* p) {  // 8 int8 -> 8 float32 (exact); the caller scales the output
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// 8 float8 e4m3 -> 8 float32 of 1/256 their value (exact): an e4m3 number's exponent and mantissa bits,
// moved up 7 places, are a float16 of 2^-8 its value (normal and subnormal alike, e4m3's bias being
// 7 and float16's 15); the sign moves to bit 15. The scales carry the 256 back.
inline __m128i E4m3ToHalf(__m128i b) {  // 8 bytes widened to 16-bit lanes -> float16 bits
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return _mm_or_si128(magnitude, _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
}

inline __m256 Load8(const uint8_t* p) {
  return _mm256_cvtph_ps(E4m3ToHalf(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}

// Float8 weights are scaled per group of depth rows; other types are not (int8's scales apply to y).
template <typename T>
constexpr bool kScaled = std::is_same_v<T, uint8_t>;

// Where a panel's scales are: f32[K / group, 16] at `panel`, the next panel's `stride` floats on; the
// first depth row of a call is `k0`. Unused (null) for unscaled weights.
struct Scales {
  const float* panel = nullptr;
  int64_t stride = 0;
  int64_t group = 1;
  int64_t k0 = 0;
  Scales At(int64_t p, int64_t depth) const { return {panel == nullptr ? nullptr : panel + p * stride, stride, group, depth}; }
  const float* Row(int64_t d) const { return panel + (k0 + d) / group * 16; }  // the scales of call depth d
  int64_t GroupEnd(int64_t d, int64_t depth) const {  // the end of depth d's group, within the call's depth
    return std::min(depth, ((k0 + d) / group + 1) * group - k0);
  }
};

// Functions that run on 16-lane vectors, called only where the CPU has AVX-512F/BW/DQ (`wide`).
#define WIDE_TARGET __attribute__((target("avx512f,avx512bw,avx512dq")))

WIDE_TARGET inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }

WIDE_TARGET inline __m512 Load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

WIDE_TARGET inline __m512 Load16(const int8_t* p) {  // 16 int8 -> 16 float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

WIDE_TARGET inline __m512 Load16(const uint8_t* p) {  // 16 e4m3 -> 16 float32 of 1/256 their value (see Load8)
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(magnitude, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8)));
}

// acc[r][c] = sum over i < depth of a[r * lda + i] * b[c][16 i : 16 i + 16]: R broadcast rows against C
// columns of 16 lanes, in order of i, each column load feeding R FMAs. Inlined, acc stays in registers.
// Float8 columns are scaled by s[c]'s group scales as they load.
template <int R, int C, typename T>
WIDE_TARGET __attribute__((always_inline)) inline void Products16(const float* a, int64_t lda, const T* const* b,
                                                                  int64_t depth, __m512 (&acc)[R][C],
                                                                  const Scales* s = nullptr) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < depth;) {
    const int64_t end = kScaled<T> ? s[0].GroupEnd(i, depth) : depth;
    __m512 scale[C];
    if constexpr (kScaled<T>) {
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) scale[c] = _mm512_loadu_ps(s[c].Row(i));
    }
    for (; i < end; ++i) {
      __m512 col[C];
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        col[c] = Load16(b[c] + i * 16);
        if constexpr (kScaled<T>) col[c] = _mm512_mul_ps(col[c], scale[c]);
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 ai = _mm512_set1_ps(a[r * lda + i]);
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(ai, col[c], acc[r][c]);
      }
    }
  }
}

inline float ToFloat(float f) { return f; }

inline float ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Asks for the cache lines of `count` elements at p ahead of use (kLocality 3: into L1, 2: into L2).
template <int kLocality, typename T>
inline void Prefetch(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < count * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, kLocality);
}

// y[R, 16] (+)= x[R, kc] @ w[kc, 16]; `accumulate` adds to y (later depth blocks).
// With few rows, U independent partial sums over alternating depths (summed at the end) keep enough
// FMAs in flight; otherwise 2R accumulators chained through the FMA latency would bound the loop.
// kStream: this tile is the first to read the panel block, from memory; it prefetches kPrefetchBytes
// ahead, running on into `next` (the next panel block, or null). The hardware prefetcher alone left
// few-row products latency-bound. On this 2-core host, 12 layers' projections + the LM head: ~6%
// faster at 1 row, 1-4% at 8 (paired A/B both orders); no change at 32 rows, which never stream.
// Float8 weights are scaled by `s`'s group scales as they load, the depth run group by group.
template <int R, bool kStream, typename T>
inline void MicroTile(const float* x, int64_t ldx, const T* w, int64_t kc, float* y, int64_t ldy,
                      bool accumulate, const T* next, const Scales& s) {
  constexpr int64_t kRowsPerLine = 64 / (kNR * sizeof(T));
  constexpr int64_t kAhead = kPrefetchBytes / (kNR * sizeof(T));  // depth rows
  constexpr int U = R == 1 ? 4 : R == 2 ? 2 : 1;
  __m256 acc0[U][R], acc1[U][R];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc0[u][r] = acc1[u][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc;) {  // one pass: the whole depth, or one scale group of it
    const int64_t end = kScaled<T> ? s.GroupEnd(k, kc) : kc;
    __m256 s0, s1;
    if constexpr (kScaled<T>) s0 = _mm256_loadu_ps(s.Row(k)), s1 = _mm256_loadu_ps(s.Row(k) + 8);
    auto load = [&](int64_t d, __m256& w0, __m256& w1) {
      w0 = Load8(w + d * kNR), w1 = Load8(w + d * kNR + 8);
      if constexpr (kScaled<T>) w0 = _mm256_mul_ps(w0, s0), w1 = _mm256_mul_ps(w1, s1);
    };
    for (; k + U <= end; k += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        if (kStream && (k + u) % kRowsPerLine == 0) {
          const int64_t d = k + u + kAhead;
          const T* line = d < kc ? w + d * kNR : next != nullptr && d < 2 * kc ? next + (d - kc) * kNR : nullptr;
          if (line != nullptr) Prefetch<3>(line, 1);
        }
        __m256 w0, w1;
        load(k + u, w0, w1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 b = _mm256_broadcast_ss(x + r * ldx + k + u);
          acc0[u][r] = _mm256_fmadd_ps(b, w0, acc0[u][r]);
          acc1[u][r] = _mm256_fmadd_ps(b, w1, acc1[u][r]);
        }
      }
    }
    for (; k < end; ++k) {  // depth tail (U > 1 only)
      __m256 w0, w1;
      load(k, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
        acc0[0][r] = _mm256_fmadd_ps(b, w0, acc0[0][r]);
        acc1[0][r] = _mm256_fmadd_ps(b, w1, acc1[0][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) {
      acc0[0][r] = _mm256_add_ps(acc0[0][r], acc0[u][r]);
      acc1[0][r] = _mm256_add_ps(acc1[0][r], acc1[u][r]);
    }
    if (accumulate) {
      acc0[0][r] = _mm256_add_ps(acc0[0][r], _mm256_loadu_ps(y + r * ldy));
      acc1[0][r] = _mm256_add_ps(acc1[0][r], _mm256_loadu_ps(y + r * ldy + 8));
    }
    _mm256_storeu_ps(y + r * ldy, acc0[0][r]);
    _mm256_storeu_ps(y + r * ldy + 8, acc1[0][r]);
  }
}

template <bool kStream, typename T>
void RowsTile(int64_t rows, const float* x, int64_t ldx, const T* w, int64_t kc, float* y, int64_t ldy,
              bool accumulate, const T* next, const Scales& s) {
  switch (rows) {
    case 1: return MicroTile<1, kStream>(x, ldx, w, kc, y, ldy, accumulate, next, s);
    case 2: return MicroTile<2, kStream>(x, ldx, w, kc, y, ldy, accumulate, next, s);
    case 3: return MicroTile<3, kStream>(x, ldx, w, kc, y, ldy, accumulate, next, s);
    case 4: return MicroTile<4, kStream>(x, ldx, w, kc, y, ldy, accumulate, next, s);
    case 5: return MicroTile<5, kStream>(x, ldx, w, kc, y, ldy, accumulate, next, s);
    default: return MicroTile<6, kStream>(x, ldx, w, kc, y, ldy, accumulate, next, s);
  }
}

// Panels [p0, p1) of y = x @ w. Depth blocks only pay off when several row tiles reuse a panel
// block; one row tile streams each panel whole.
template <typename T>
void Panels(const float* x, const T* w, float* y, int64_t m, int64_t k, int64_t n, int64_t p0, int64_t p1,
            const Scales& scales) {
  const int64_t depth_block = m > kMR ? kKC : k;
  for (int64_t k0 = 0; k0 < k; k0 += depth_block) {
    const int64_t kc = std::min(depth_block, k - k0);
    for (int64_t m0 = 0; m0 < m; m0 += kMC) {
      const int64_t mc = std::min(kMC, m - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const T* panel = w + p * k * kNR + k0 * kNR;
        const T* next = p + 1 < p1 ? panel + k * kNR : nullptr;  // panel p + 1's block at k0
        for (int64_t r = 0; r < mc; r += kMR) {
          const int64_t row = m0 + r;
          const int64_t rows = std::min(kMR, mc - r);
          float* out = y + row * n + p * kNR;
          const Scales s = scales.At(p, k0);
          if (r == 0 && mc <= kStreamRows) {
            RowsTile<true>(rows, x + row * k + k0, k, panel, kc, out, n, k0 > 0, next, s);
          } else {
            RowsTile<false>(rows, x + row * k + k0, k, panel, kc, out, n, k0 > 0, next, s);
          }
        }
      }
    }
  }
}

// ---- Products of many rows on 16-lane vectors (AVX-512). A panel is one register, so a micro-tile
// of kWideRows rows by two panels keeps 24 sums, two weights and a broadcast in the 32 registers:
// each weight load (and its widening) feeds 12 FMAs, against 6 in the 8-lane tile. Same arithmetic
// as the 8-lane tiles of 3 rows or more: each output one float32 sum over the depth in order, depth
// blocks of kKC added through y, so a row's outputs do not depend on which of the two ran.
// Products of kStreamRows rows or fewer read their weights from memory once and stay on the 8-lane
// tiles, which prefetch them.
constexpr int64_t kWideRows = 12;

// y[R, 16P] (+)= x[R, kc] @ [the P panels at w, ldw apart][kc, 16P].
template <int R, int P, typename T>
WIDE_TARGET inline void WideTile(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t kc, float* y,
                                 int64_t ldy, bool accumulate, const Scales& s) {
  const T* panels[P];
  Scales scales[P];
#pragma GCC unroll 2
  for (int p = 0; p < P; ++p) panels[p] = w + p * ldw, scales[p] = s.At(p, s.k0);
  __m512 acc[R][P];
  Products16<R, P>(x, ldx, panels, kc, acc, scales);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      float* out = y + r * ldy + p * kNR;
      _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(acc[r][p], _mm512_loadu_ps(out)) : acc[r][p]);
    }
}

// WideTile for `rows` <= R rows.
template <int R, int P, typename T>
WIDE_TARGET void WideRows(int64_t rows, const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t kc, float* y,
                          int64_t ldy, bool accumulate, const Scales& s) {
  if constexpr (R > 1) {
    if (rows < R) return WideRows<R - 1, P>(rows, x, ldx, w, ldw, kc, y, ldy, accumulate, s);
  }
  WideTile<R, P>(x, ldx, w, ldw, kc, y, ldy, accumulate, s);
}

// Panels [p0, p1) of y = x @ w, two at a time, blocked as `Panels` blocks many rows.
template <typename T>
WIDE_TARGET void WidePanels(const float* x, const T* w, float* y, int64_t m, int64_t k, int64_t n, int64_t p0,
                            int64_t p1, const Scales& scales) {
  for (int64_t k0 = 0; k0 < k; k0 += kKC) {
    const int64_t kc = std::min(kKC, k - k0);
    for (int64_t m0 = 0; m0 < m; m0 += kMC) {
      const int64_t mc = std::min(kMC, m - m0);
      for (int64_t p = p0; p < p1; p += 2) {
        const T* panel = w + p * k * kNR + k0 * kNR;
        for (int64_t r = 0; r < mc; r += kWideRows) {
          const int64_t row = m0 + r, rows = std::min(kWideRows, mc - r);
          const float* in = x + row * k + k0;
          float* out = y + row * n + p * kNR;
          const Scales s = scales.At(p, k0);
          if (p + 1 < p1) {
            WideRows<kWideRows, 2>(rows, in, k, panel, k * kNR, kc, out, n, k0 > 0, s);
          } else {
            WideRows<kWideRows, 1>(rows, in, k, panel, k * kNR, kc, out, n, k0 > 0, s);
          }
        }
      }
    }
  }
}

struct Job {
  std::atomic<int64_t> next{0};  // next chunk to claim
  std::atomic<int64_t> done{0};  // chunks finished
  int64_t chunks = 0;
  std::mutex mutex;  // with `finished`: wakes a caller that stopped spinning
  std::condition_variable finished;
};

// Runs body(c) for c in [0, chunks) on the caller and up to num_threads - 1 pool threads. A pool
// thread that starts late finds no chunk left and touches nothing, so returning is safe. The
// caller spins briefly for chunks still running elsewhere, then sleeps: on a busy host the thread
// it waits for may be preempted, and a sleeping caller frees its core for it.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t chunks, Body body) {
  auto job = std::make_shared<Job>();
  job->chunks = chunks;
  auto work = [job, body]() {
    for (int64_t c; (c = job->next.fetch_add(1)) < job->chunks;) {
      body(c);
      if (job->done.fetch_add(1, std::memory_order_acq_rel) + 1 == job->chunks) {
        std::lock_guard<std::mutex> lock(job->mutex);  // the caller is waiting or will see `done`
        job->finished.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  auto all_done = [&] { return job->done.load(std::memory_order_acquire) >= chunks; };
  for (int spin = 0; spin < 4096 && !all_done(); ++spin) _mm_pause();
  if (!all_done()) {
    std::unique_lock<std::mutex> lock(job->mutex);
    job->finished.wait(lock, all_done);
  }
}

// The panel parts of a 16-lane product split into `chunks` = row parts x panel parts: the split
// whose chunks read the least in all, each its rows of x and its panels' weights (once: they stay
// in cache across its row blocks). Many rows over few panels are split by rows (else each chunk
// reads all of x), few rows over many panels by panels.
template <typename T>
int64_t WidePanelParts(int64_t m, int64_t n, int64_t chunks) {
  int64_t best = 1, least = -1;
  for (int64_t parts = 1; parts <= chunks; ++parts) {
    if (chunks % parts) continue;
    const int64_t read = parts * m * static_cast<int64_t>(sizeof(float)) +
                         chunks / parts * n * static_cast<int64_t>(sizeof(T));  // per depth row
    if (least < 0 || read < least) least = read, best = parts;
  }
  return best;
}

// y = x @ w on the 16-lane tiles where `wide` and x has more than kStreamRows rows, else on the
// 8-lane ones. Either way each output is computed by one tile, so how the work is split does not
// change it.
template <typename T>
void MatmulOf(ffi::ThreadPool& pool, const float* xp, const void* w, float* yp, int64_t m, int64_t k,
              int64_t panels, bool wide, Scales scales = {}) {
  const T* wp = static_cast<const T*>(w);
  const int64_t n = panels * kNR, threads = std::max<int64_t>(1, pool.num_threads());
  if (!wide || m <= kStreamRows) {
    // Enough chunks to balance threads, few enough that each reuses its x block across panels.
    const int64_t chunks = std::min(panels, threads * 4);
    ParallelFor(pool, chunks, [=](int64_t c) {
      Panels<T>(xp, wp, yp, m, k, n, panels * c / chunks, panels * (c + 1) / chunks, scales);
    });
    return;
  }
  const int64_t pairs = (panels + 1) / 2, tiles = (m + kWideRows - 1) / kWideRows;
  const int64_t parts = std::min(pairs, WidePanelParts<T>(m, n, threads * 4));
  const int64_t row_parts = std::min(tiles, threads * 4 / parts);
  ParallelFor(pool, parts * row_parts, [=](int64_t c) {
    const int64_t part = c % parts, row_part = c / parts;
    const int64_t p0 = std::min(panels, 2 * (pairs * part / parts));
    const int64_t p1 = std::min(panels, 2 * (pairs * (part + 1) / parts));
    const int64_t r0 = std::min(m, kWideRows * (tiles * row_part / row_parts));
    const int64_t r1 = std::min(m, kWideRows * (tiles * (row_part + 1) / row_parts));
    WidePanels<T>(xp + r0 * k, wp, yp + r0 * n, r1 - r0, k, n, p0, p1, scales);
  });
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y, bool wide, int64_t group) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const size_t n = wd.size();  // w[N / 16, K, 16], or a stack of them w[layers, N / 16, K, 16] read at `layer`
  if (xd.size() != 2 || (n != 3 && n != 4) || wd[n - 1] != kNR || wd[n - 2] != xd[1]) {
    return ffi::Error::InvalidArgument("matmul: want x[M, K] and w[N / 16, K, 16] or w[layers, N / 16, K, 16]");
  }
  const int64_t m = xd[0], k = xd[1], panels = wd[n - 3], layers = n == 4 ? wd[0] : 1;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("matmul: layer index out of range");
  float* yp = y->typed_data();
  if (m == 0 || panels == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(yp, yp + m * panels * kNR, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t offset = l * panels * k * kNR;  // elements before layer l's panels
  switch (w.element_type()) {
    case ffi::F32:
      MatmulOf<float>(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()) + offset, yp, m, k, panels,
                      wide);
      break;
    case ffi::BF16:
      MatmulOf<uint16_t>(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()) + offset, yp, m, k,
                         panels, wide);
      break;
    case ffi::S8:
      MatmulOf<int8_t>(pool, x.typed_data(), static_cast<const int8_t*>(w.untyped_data()) + offset, yp, m, k, panels,
                       wide);
      break;
    case ffi::F8E4M3FN: {
      // scales f32[N / 16, K / group, 16] (a stack: [layers, ...]), each group of depth rows its own
      const auto sd = scales.dimensions();
      if (group <= 0 || k % group || sd.size() != n || sd[n - 1] != kNR || sd[n - 2] != k / group ||
          sd[n - 3] != panels || (n == 4 && sd[0] != layers)) {
        return ffi::Error::InvalidArgument("matmul: float8 weights want scales[N / 16, K / group, 16] beside them");
      }
      const int64_t groups = k / group;
      const Scales at{scales.typed_data() + l * panels * groups * kNR, groups * kNR, group, 0};
      MatmulOf<uint8_t>(pool, x.typed_data(), static_cast<const uint8_t*>(w.untyped_data()) + offset, yp, m, k,
                        panels, wide, at);
      break;
    }
    default: return ffi::Error::InvalidArgument("matmul: weights must be float32, bfloat16, int8 or float8 e4m3");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Grouped matmul (a mixture of experts' products): x f32[R, K] holds rows grouped by expert, in
// expert order, sizes[e] rows for expert e; y[r] = x[r] @ W_e for each row r of group e, reading
// w T[E, N / 16, K, 16] (every expert's panels) in place; rows after the last group get zeros. Groups
// of few rows (decoding) share one pass over the threads, each chunk one expert's panel range; larger
// groups run one after another, each as the plain matmul runs it.

template <typename T>
void GroupedMatmulOf(ffi::ThreadPool& pool, const float* xp, const void* w, const int32_t* sizes, float* yp,
                     int64_t experts, int64_t k, int64_t panels, bool wide) {
  const T* wp = static_cast<const T*>(w);
  const int64_t n = panels * kNR, threads = std::max<int64_t>(1, pool.num_threads());
  std::vector<int64_t> start(experts + 1, 0);
  int64_t widest = 0;
  for (int64_t e = 0; e < experts; ++e) {
    start[e + 1] = start[e] + std::max<int32_t>(sizes[e], 0);
    widest = std::max<int64_t>(widest, start[e + 1] - start[e]);
  }
  if (!wide || widest <= kStreamRows) {
    std::vector<int64_t> used;  // the experts with rows
    for (int64_t e = 0; e < experts; ++e) {
      if (start[e + 1] > start[e]) used.push_back(e);
    }
    const int64_t count = static_cast<int64_t>(used.size());
    if (count == 0) return;
    const int64_t chunks = std::max<int64_t>(1, std::min(panels, threads * 4 / count + 1));
    const int64_t* up = used.data();
    const int64_t* sp = start.data();
    ParallelFor(pool, count * chunks, [=](int64_t c) {
      const int64_t e = up[c / chunks], part = c % chunks, r0 = sp[e];
      Panels<T>(xp + r0 * k, wp + e * panels * k * kNR, yp + r0 * n, sp[e + 1] - r0, k, n, panels * part / chunks,
                panels * (part + 1) / chunks, Scales{});
    });
    return;
  }
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows > 0) {
      MatmulOf<T>(pool, xp + start[e] * k, wp + e * panels * k * kNR, yp + start[e] * n, rows, k, panels, wide);
    }
  }
}

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> sizes,
                         ffi::ResultBuffer<ffi::F32> y, bool wide) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != kNR || wd[2] != xd[1] || sizes.element_count() != wd[0]) {
    return ffi::Error::InvalidArgument("grouped_matmul: want x[R, K], w[E, N / 16, K, 16] and sizes[E]");
  }
  const int64_t r = xd[0], k = xd[1], panels = wd[1], experts = wd[0];
  const int32_t* sp = sizes.typed_data();
  int64_t grouped = 0;
  for (int64_t e = 0; e < experts; ++e) grouped += std::max<int32_t>(sp[e], 0);
  if (grouped > r) return ffi::Error::InvalidArgument("grouped_matmul: the groups hold more rows than x has");
  float* yp = y->typed_data();
  std::fill(yp + grouped * panels * kNR, yp + r * panels * kNR, 0.0f);
  if (grouped == 0 || panels == 0) return ffi::Error::Success();
  switch (w.element_type()) {
    case ffi::F32:
      GroupedMatmulOf<float>(pool, x.typed_data(), w.untyped_data(), sp, yp, experts, k, panels, wide);
      break;
    case ffi::BF16:
      GroupedMatmulOf<uint16_t>(pool, x.typed_data(), w.untyped_data(), sp, yp, experts, k, panels, wide);
      break;
    default: return ffi::Error::InvalidArgument("grouped_matmul: weights must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Paged attention, one query per token (a decoding sequence's, or one prompt token).
//   q:     f32[S, H, G, D]  one pre-scaled query per token (H kv heads, G query heads each)
//   k:     T[layers, pages, H, D, PS]  (token slot minor; T float32, or bfloat16 / its uint16 bits)
//   v:     T[layers, pages, H, PS, D]
//   layer: i32[]   pages: i32[R, L] page tables   rows: i32[S] the page table of each query
//   lens:  i32[S] visible tokens (0: padding)
//   window: i32[]  > 0: a query sees only the last `window` of its visible tokens (a sliding window)
//   softcap: f32[] > 0: scores become softcap * tanh(scores / softcap) before the softmax
//   sinks: f32[H, G] each query head's sink logit, or f32[0] for none: a sink joins the softmax's
//          denominator as exp(sink - m), m the larger of it and the scores' maximum, and adds no value
//   out:   f32[S, H, G, D]  softmax(q k^T) v over tokens [max(0, lens[s] - window), lens[s]) of table rows[s];
//          zeros where lens[s] == 0.

// e^x = 2^i e^f with i = round(x / ln 2), f = x - i ln 2 (ln 2 in a high and a low part), and e^f
// = 1 + f + f^2 (c0 f^5 + ... + c5) on |f| <= ln2 / 2: relative error ~2e-7.
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-6f;
constexpr float kExpPoly[6] = {1.98756912e-4f, 1.39819994e-3f, 8.33345205e-3f, 4.16657962e-2f, 1.66666657e-1f, 5.0e-1f};

inline __m256 Exp8(__m256 x) {  // e^x for x <= 0; exactly 0 below -87
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(i, _mm256_set1_ps(kLn2Hi), _mm256_fnmadd_ps(i, _mm256_set1_ps(kLn2Lo), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[c]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, f), f, _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), kept);
}

struct AttnShape {
  int64_t heads, group, dim, page_size, pool_pages, table_len;
  int64_t window;       // > 0: the sliding window
  float softcap;        // > 0: the scores' soft-cap
  bool values_are_keys;  // the keys are the value rows [PS, D] (one array), not [D, PS] blocks
};

// Row stride of the scores buffer for n tokens: whole pages, rounded to a multiple of 8 (one register).
inline int64_t ScoresStride(int64_t n, int64_t page_size) {
  return ((n + page_size - 1) / page_size * page_size + 7) / 8 * 8;
}

// scores[v, t] = q[v] . k[:, t] for the NV query vectors at q (rows D apart) and NT * 8 tokens at kb
// (rows of a page's [D, PS] key block; column stride PS). NV * NT accumulators stay in registers.
template <int NV, int NT, typename T>
inline void ScoreBlock(const float* q, int64_t D, const T* kb, int64_t PS, float* scores, int64_t ld) {
  __m256 acc[NV][NT];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) acc[v][t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 k[NT];
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) k[t] = Load8(kb + d * PS + 8 * t);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256 qd = _mm256_broadcast_ss(q + v * D + d);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[v][t] = _mm256_fmadd_ps(qd, k[t], acc[v][t]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) _mm256_storeu_ps(scores + v * ld + 8 * t, acc[v][t]);
}

inline float Sum8(__m256 x) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// scores[m, t] = q[m] . k[t] for the M query vectors at q (rows D apart) and the PS keys of a page
// stored as rows, kb [PS, D] (a cache whose values are its keys). Dot products on 8 lanes where D % 8 == 0.
template <typename T>
inline void ScoreRows(const float* q, int64_t M, int64_t D, const T* kb, int64_t PS, float* scores, int64_t ld) {
  for (int64_t t = 0; t < PS; ++t) {
    const T* kt = kb + t * D;
    for (int64_t m = 0; m < M; ++m) {
      const float* qm = q + m * D;
      float score = 0.0f;
      if (D % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qm + d), Load8(kt + d), acc);
        score = Sum8(acc);
      } else {
        for (int64_t d = 0; d < D; ++d) score += qm[d] * ToFloat(kt[d]);
      }
      scores[m * ld + t] = score;
    }
  }
}

// out[v, d0:d0+16] = sum_t p[v, t] v[t, d0:d0+16] for NV query vectors over the n tokens of `table`'s pages.
template <int NV, typename T>
inline void ValueBlock(const float* p, int64_t ld, const T* vpool, const int32_t* table, int64_t n,
                       int64_t page_stride, int64_t PS, int64_t D, int64_t d0, float* out) {
  __m256 acc[NV][2];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) acc[v][0] = acc[v][1] = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < n; t0 += PS) {
    const T* vb = vpool + table[t0 / PS] * page_stride + d0;  // [PS, D] from column d0
    const int64_t valid = std::min(PS, n - t0);
    for (int64_t t = 0; t < valid; ++t) {
      const __m256 v0 = Load8(vb + t * D), v1 = Load8(vb + t * D + 8);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        const __m256 w = _mm256_broadcast_ss(p + v * ld + t0 + t);
        acc[v][0] = _mm256_fmadd_ps(w, v0, acc[v][0]);
        acc[v][1] = _mm256_fmadd_ps(w, v1, acc[v][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    _mm256_storeu_ps(out + v * D + d0, acc[v][0]);
    _mm256_storeu_ps(out + v * D + d0 + 8, acc[v][1]);
  }
}

// f(std::integral_constant<int, n>()) for a run-time 1 <= n <= N.
template <int N, typename F>
inline void WithCount(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return WithCount<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>());
}

// Query vectors [0, M) in blocks of up to Max: f(block_start, block_size) with the size a template argument.
template <int Max, typename F>
inline void ForVectorBlocks(int64_t M, F f) {
  for (int64_t v = 0; v < M; v += Max) {
    WithCount<Max>(std::min<int64_t>(Max, M - v), [&](auto nv) { f(v, nv); });
  }
}

// One row of scores before its softmax: soft-capped over [first, n) when softcap > 0; the tokens
// before `first` and the tail up to `padded` set to -1e30 (weight 0).
inline void CapAndMask(float* sg, int64_t first, int64_t n, int64_t padded, float softcap) {
  if (softcap > 0.0f) {
    for (int64_t t = first; t < n; ++t) sg[t] = softcap * std::tanh(sg[t] / softcap);
  }
  for (int64_t t = 0; t < first; ++t) sg[t] = -1e30f;
  for (int64_t t = n; t < padded; ++t) sg[t] = -1e30f;
}

// Softmax of one row of scores sg[padded] in place over tokens [first, n), soft-capped first when
// softcap > 0, with a sink logit in the denominator (-inf: none, which changes no bit); the tokens
// before `first` and the tail up to `padded` get weight 0.
void Softmax(float* sg, int64_t first, int64_t n, int64_t padded, float softcap, float sink) {
  CapAndMask(sg, first, n, padded, softcap);
  __m256 mx = _mm256_set1_ps(-1e30f);
  for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  const float m = std::max(*std::max_element(lanes, lanes + 8), sink);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(m)));
    _mm256_storeu_ps(sg + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_store_ps(lanes, sum);
  float total = 0.0f;
  for (float l : lanes) total += l;
  total += std::exp(sink - m);
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), inv));
}

// Query vectors scored together on 8-lane vectors: 2 kMaxVectors8 sums, two keys and a broadcast
// fit in AVX2's 16 registers.
constexpr int64_t kMaxVectors8 = 6;

// `count` consecutive queries of one row, `group` query vectors each (vector m: query m / group,
// query head m % group): query i sees tokens [First, Seen) with Seen = last - (count - 1 - i), the
// last one `last`.
struct QueryRun {
  int64_t count, group, last, window;
  const float* sinks;  // the group's sink logits at this kv head, or nullptr
  int64_t vectors() const { return count * group; }
  int64_t Seen(int64_t m) const { return last - (count - 1 - m / group); }
  int64_t First(int64_t m) const { return window > 0 ? std::max<int64_t>(0, Seen(m) - window) : 0; }
  float Sink(int64_t m) const { return sinks ? sinks[m % group] : -std::numeric_limits<float>::infinity(); }
};

// Attention for a run's query vectors q[M, D] at one kv head (kpool / vpool: this layer's keys /
// values at the head). All of them are scored against the pages up to the run's last length; each
// one's tokens past its own length get weight exactly 0, so each output is the one it would have
// alone: the same products, summed in the same order. The vector paths need PS % 8 == 0 and
// D % 16 == 0 (scalar loops otherwise). T: the cache's element type (float, or uint16_t holding
// bfloat16); arithmetic is float32 either way.
template <typename T>
void AttendVectors(const float* q, const QueryRun& run, const T* kpool, const T* vpool, const int32_t* table,
                   const AttnShape& a, float* scores, float* out) {
  const int64_t D = a.dim, PS = a.page_size, M = run.vectors();
  const int64_t page_stride = a.heads * D * PS;  // floats between consecutive pages of one head
  const int64_t longest = run.last, padded = ScoresStride(longest, PS);
  for (int64_t t0 = 0; t0 < longest; t0 += PS) {  // scores[m, t] = q[m] . k[t], whole pages
    const T* kb = kpool + table[t0 / PS] * page_stride;  // [D, PS]
    // A row's pages lie scattered over the pool, 2 KiB blocks the hardware prefetcher does not see coming.
    if (t0 + PS < longest) Prefetch<3>(kpool + table[t0 / PS + 1] * page_stride, D * PS);  // next keys
    Prefetch<2>(vpool + table[t0 / PS] * page_stride, D * PS);  // values, for the second pass
    if (a.values_are_keys) {
      ScoreRows(q, M, D, kb, PS, scores + t0, padded);
      continue;
    }
    if (PS % 8 == 0) {
      for (int64_t t = 0; t < PS; t += 16) {
        const bool two = t + 16 <= PS;
        ForVectorBlocks<kMaxVectors8>(M, [&](int64_t v, auto nv) {
          constexpr int NV = decltype(nv)::value;
          if (two) ScoreBlock<NV, 2>(q + v * D, D, kb + t, PS, scores + v * padded + t0 + t, padded);
          else ScoreBlock<NV, 1>(q + v * D, D, kb + t, PS, scores + v * padded + t0 + t, padded);
        });
      }
      continue;
    }
    for (int64_t m = 0; m < M; ++m) {
      float* sm = scores + m * padded + t0;
      for (int64_t t = 0; t < PS; ++t) sm[t] = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = q[m * D + d];
        for (int64_t t = 0; t < PS; ++t) sm[t] += qd * ToFloat(kb[d * PS + t]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    Softmax(scores + m * padded, run.First(m), run.Seen(m), padded, a.softcap, run.Sink(m));
  }
  if (D % 16 == 0) {  // out[m] = sum_t p[m, t] v[t], 16 columns at a time
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      ForVectorBlocks<kMaxVectors8>(M, [&](int64_t v, auto nv) {
        ValueBlock<decltype(nv)::value>(scores + v * padded, padded, vpool, table, longest, page_stride, PS, D, d0,
                                        out + v * D);
      });
    }
    return;
  }
  for (int64_t i = 0; i < M * D; ++i) out[i] = 0.0f;
  for (int64_t t0 = 0; t0 < longest; t0 += PS) {
    const T* vb = vpool + table[t0 / PS] * page_stride;  // [PS, D]
    const int64_t valid = std::min(PS, longest - t0);
    for (int64_t t = 0; t < valid; ++t) {
      for (int64_t m = 0; m < M; ++m) {
        const float p = scores[m * padded + t0 + t];
        for (int64_t d = 0; d < D; ++d) out[m * D + d] += p * ToFloat(vb[t * D + d]);
      }
    }
  }
}

// ---- The same attention on 16-lane vectors (AVX-512F/BW/DQ), for pages of 16 tokens and head sizes
// that are multiples of 16: a page's keys at one depth are one register, a value row 64 columns
// in four. Half the instructions of the 8-lane path per score and per value column; chosen at
// run time where the CPU has AVX-512 (`wide`), else the path above runs. Same arithmetic: float32
// products and sums, the same exponential, the softmax over the same tokens.
WIDE_TARGET inline __m512 Exp16(__m512 x) {  // Exp8 on 16 lanes
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(i, _mm512_set1_ps(kLn2Hi), _mm512_fnmadd_ps(i, _mm512_set1_ps(kLn2Lo), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[c]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, f), f, _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(kept, p, _mm512_castsi512_ps(e));
}

// Query vectors scored together on 16-lane vectors: 2 kMaxVectors16 sums, two pages' keys and a
// broadcast fit in AVX-512's 32 registers.
constexpr int64_t kMaxVectors16 = 12;

// scores[v, 16p + t] = q[v] . k_p[:, t] for NV query vectors (rows D apart) and the NP pages whose
// [D, 16] key blocks are kb[p]. Each key load feeds all NV vectors.
template <int NV, int NP, typename T>
WIDE_TARGET inline void ScorePages16(const float* q, int64_t D, const T* const* kb, float* scores, int64_t ld) {
  __m512 acc[NV][NP];
  Products16<NV, NP>(q, D, kb, D, acc);
#pragma GCC unroll 12
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(scores + v * ld + 16 * p, acc[v][p]);
}

// out[v, d0:d0 + 16 ND] = sum_t p[v, t] v[t, d0:d0 + 16 ND] for NV query vectors over the n tokens
// of `table`'s pages. Each value load feeds all NV vectors.
template <int NV, int ND, typename T>
WIDE_TARGET inline void ValuePages16(const float* p, int64_t ld, const T* vpool, const int32_t* table, int64_t n,
                                     int64_t page_stride, int64_t D, int64_t d0, float* out) {
  __m512 acc[NV][ND];
#pragma GCC unroll 12
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const T* vb = vpool + table[t0 / 16] * page_stride + d0;  // [16, D] from column d0
    const int64_t valid = std::min<int64_t>(16, n - t0);
    for (int64_t t = 0; t < valid; ++t) {
      __m512 x[ND];
#pragma GCC unroll 4
      for (int j = 0; j < ND; ++j) x[j] = Load16(vb + t * D + 16 * j);
#pragma GCC unroll 12
      for (int v = 0; v < NV; ++v) {
        const __m512 w = _mm512_set1_ps(p[v * ld + t0 + t]);
#pragma GCC unroll 4
        for (int j = 0; j < ND; ++j) acc[v][j] = _mm512_fmadd_ps(w, x[j], acc[v][j]);
      }
    }
  }
#pragma GCC unroll 12
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) _mm512_storeu_ps(out + v * D + d0 + 16 * j, acc[v][j]);
}

// Softmax's 16-lane form (`padded` a multiple of 16).
WIDE_TARGET void Softmax16(float* sg, int64_t first, int64_t n, int64_t padded, float softcap, float sink) {
  CapAndMask(sg, first, n, padded, softcap);
  __m512 mx = _mm512_set1_ps(-1e30f);
  for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
  const float m = std::max(_mm512_reduce_max_ps(mx), sink);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), _mm512_set1_ps(m)));
    _mm512_storeu_ps(sg + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / (_mm512_reduce_add_ps(sum) + std::exp(sink - m)));
  for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv));
}

// Query vectors in blocks of up to kMaxVectors16 and value columns in blocks of up to 64 (32 beside
// more than 6 vectors, so that NV * ND sums stay in registers): f(v, d0, NV, ND).
template <typename F>
inline void ForVectorAndColumnBlocks(int64_t M, int64_t D, F f) {
  ForVectorBlocks<kMaxVectors16>(M, [&](int64_t v, auto nv) {
    constexpr int kColumns = decltype(nv)::value <= 6 ? 4 : 2;
    for (int64_t d0 = 0; d0 < D; d0 += 16 * kColumns) {
      WithCount<kColumns>(std::min<int64_t>(kColumns, (D - d0) / 16), [&](auto nd) { f(v, d0, nv, nd); });
    }
  });
}

// AttendVectors on pages of 16 tokens (D % 16 == 0): the same scores and sums on 16-lane vectors.
template <typename T>
WIDE_TARGET void AttendVectors16(const float* q, const QueryRun& run, const T* kpool, const T* vpool,
                                 const int32_t* table, const AttnShape& a, float* scores, float* out) {
  const int64_t D = a.dim, page_stride = a.heads * D * 16, M = run.vectors();
  const int64_t longest = run.last;
  const int64_t pages = (longest + 15) / 16, padded = pages * 16;
  for (int64_t pg = 0; pg < pages; pg += 2) {  // two pages at a time: 2 NV independent sums
    const bool two = pg + 1 < pages;
    const T* kb[2] = {kpool + table[pg] * page_stride, two ? kpool + table[pg + 1] * page_stride : nullptr};
    if (pg + 2 < pages) Prefetch<3>(kpool + table[pg + 2] * page_stride, D * 16);  // next keys
    if (pg + 3 < pages) Prefetch<3>(kpool + table[pg + 3] * page_stride, D * 16);
    Prefetch<2>(vpool + table[pg] * page_stride, D * 16);  // values, for the second pass
    if (two) Prefetch<2>(vpool + table[pg + 1] * page_stride, D * 16);
    if (a.values_are_keys) {
      ScoreRows(q, M, D, kb[0], 16, scores + pg * 16, padded);
      if (two) ScoreRows(q, M, D, kb[1], 16, scores + pg * 16 + 16, padded);
      continue;
    }
    ForVectorBlocks<kMaxVectors16>(M, [&](int64_t v, auto nv) {
      if (two) ScorePages16<decltype(nv)::value, 2>(q + v * D, D, kb, scores + v * padded + pg * 16, padded);
      else ScorePages16<decltype(nv)::value, 1>(q + v * D, D, kb, scores + v * padded + pg * 16, padded);
    });
  }
  for (int64_t m = 0; m < M; ++m) {
    Softmax16(scores + m * padded, run.First(m), run.Seen(m), padded, a.softcap, run.Sink(m));
  }
  ForVectorAndColumnBlocks(M, D, [&](int64_t v, int64_t d0, auto nv, auto nd) {
    ValuePages16<decltype(nv)::value, decltype(nd)::value>(scores + v * padded, padded, vpool, table, longest,
                                                            page_stride, D, d0, out + v * D);
  });
}

// The tokens query s sees: its length clamped to its table, 0 for padding.
inline int64_t Visible(const AttnShape& a, int64_t tables, int32_t row, int32_t len) {
  return row < 0 || row >= tables ? 0 : std::min<int64_t>(std::max<int32_t>(len, 0), a.table_len * a.page_size);
}

// Runs of consecutive queries that share a page table and see n, n + 1, ... tokens (a prompt's
// tokens), up to `max_count` queries each: starts[r] is run r's first query, starts.back() == queries.
std::vector<int64_t> QueryRuns(const AttnShape& a, int64_t queries, int64_t tables, const int32_t* rp,
                               const int32_t* lp, int64_t max_count) {
  std::vector<int64_t> starts;
  for (int64_t s = 0; s < queries;) {
    starts.push_back(s);
    const int64_t n = Visible(a, tables, rp[s], lp[s]);
    int64_t e = s + 1;
    while (n > 0 && e < queries && e - s < max_count && rp[e] == rp[s] &&
           Visible(a, tables, rp[e], lp[e]) == n + (e - s)) {
      ++e;
    }
    s = e;
  }
  starts.push_back(queries);
  return starts;
}

// This thread's scratch memory, grown to the largest chunk it has run and kept: a long row's scores
// were a fresh allocation per chunk, its pages faulted in on first touch.
float* Scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// Each (run of queries, kv head) is one chunk, the G heads of its queries attended together, on
// 16-lane vectors where `wide` (and pages hold 16 tokens, D % 16 == 0), else on 8-lane ones.
// Decoding rows are runs of one query. sp: the sinks f32[H, G], or nullptr.
template <typename T>
void AttendAll(ffi::ThreadPool& pool, const AttnShape& a, int64_t queries, int64_t tables, const float* qp,
               const T* kl, const T* vl, const int32_t* tp, const int32_t* rp, const int32_t* lp, const float* sp,
               float* op, bool wide) {
  const int64_t G = a.group, D = a.dim, H = a.heads, PS = a.page_size;
  const bool sixteen = wide && PS == 16 && D % 16 == 0;
  const std::vector<int64_t> runs =
      QueryRuns(a, queries, tables, rp, lp, std::max<int64_t>(1, (sixteen ? kMaxVectors16 : kMaxVectors8) / G));
  const int64_t* starts = runs.data();
  ParallelFor(pool, (static_cast<int64_t>(runs.size()) - 1) * H, [=](int64_t c) {
    const int64_t s0 = starts[c / H], count = starts[c / H + 1] - s0, h = c % H, M = count * G;
    const int64_t last = Visible(a, tables, rp[s0 + count - 1], lp[s0 + count - 1]);
    if (last == 0) {  // padding (a run of one)
      std::fill(op + (s0 * H + h) * G * D, op + (s0 * H + h + 1) * G * D, 0.0f);
      return;
    }
    const QueryRun run{count, G, last, a.window, sp == nullptr ? nullptr : sp + h * G};
    float *q = Scratch(2 * M * D + M * ScoresStride(last, PS)), *out = q + M * D, *scores = out + M * D;
    for (int64_t i = 0; i < count; ++i) {  // gather the run's vectors: query s0 + i's G heads at kv head h
      std::copy_n(qp + ((s0 + i) * H + h) * G * D, G * D, q + i * G * D);
    }
    const T *k = kl + h * D * PS, *v = vl + h * D * PS;
    const int32_t* table = tp + rp[s0] * a.table_len;
    if (sixteen) AttendVectors16(q, run, k, v, table, a, scores, out);
    else AttendVectors(q, run, k, v, table, a, scores, out);
    for (int64_t i = 0; i < count; ++i) std::copy_n(out + i * G * D, G * D, op + ((s0 + i) * H + h) * G * D);
  });
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> rows,
                           ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> softcap,
                           ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, bool wide,
                           bool values_are_keys) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = pages.dimensions();
  const int64_t k_dim = kd.size() == 5 ? kd[values_are_keys ? 4 : 3] : -1;
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || kd[2] != qd[1] || k_dim != qd[3] ||
      rows.element_count() != qd[0] || lens.element_count() != qd[0] || v.dimensions().size() != 5) {
    return ffi::Error::InvalidArgument("paged_attention: want q[S,H,G,D], k[layers,pages,H,D,PS] (values_are_keys: "
                                       "[layers,pages,H,PS,D]), pages[R,L], rows[S], lens[S]");
  }
  if (k.element_type() != v.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention: keys and values must have one dtype");
  }
  if (sinks.element_count() != 0 && sinks.element_count() != qd[1] * qd[2]) {
    return ffi::Error::InvalidArgument("paged_attention: want sinks[H,G] (or an empty array for none)");
  }
  const float* sp = sinks.element_count() == 0 ? nullptr : sinks.typed_data();
  const AttnShape a{qd[1], qd[2], qd[3], kd[values_are_keys ? 3 : 4], kd[1], td[1], window.typed_data()[0],
                    softcap.typed_data()[0], values_are_keys};
  const int64_t layer_offset = layer.typed_data()[0] * a.pool_pages * a.heads * a.dim * a.page_size;
  const int32_t *tp = pages.typed_data(), *rp = rows.typed_data(), *lp = lens.typed_data();
  switch (k.element_type()) {
    case ffi::F32:
      AttendAll(pool, a, qd[0], td[0], q.typed_data(), static_cast<const float*>(k.untyped_data()) + layer_offset,
                static_cast<const float*>(v.untyped_data()) + layer_offset, tp, rp, lp, sp, out->typed_data(), wide);
      break;
    case ffi::BF16:
    case ffi::U16:  // bfloat16 bits (the cpu backend stores a bfloat16 cache as uint16)
      AttendAll(pool, a, qd[0], td[0], q.typed_data(),
                static_cast<const uint16_t*>(k.untyped_data()) + layer_offset,
                static_cast<const uint16_t*>(v.untyped_data()) + layer_offset, tp, rp, lp, sp, out->typed_data(),
                wide);
      break;
    default: return ffi::Error::InvalidArgument("paged_attention: the cache must be float32 or bfloat16 (or uint16 bits)");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// SwiGLU's gating: out[r, j] = silu(g) * u = g * sigmoid(g) * u with g = gu[r, j], u = gu[r, N + j]:
// each row of gu f32[M, 2N] holds the gate and up projections side by side, as the fused gate/up
// matmul writes them (so XLA copies out no slices), and out is f32[M, N].

inline __m256 Sigmoid8(__m256 g) {  // from e^-|g| <= 1, so the exponential never overflows
  const __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
  const __m256 numerator = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, g);  // g < 0: e^g / (1 + e^g)
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// out[0, len) = silu(g) * u over contiguous runs.
inline void SiluMulRun(const float* g, const float* u, float* out, int64_t len) {
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, Sigmoid8(gv)), _mm256_loadu_ps(u + i)));
  }
  for (; i < len; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

ffi::Error SiluMul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gu, ffi::ResultBuffer<ffi::F32> out) {
  const auto d = gu.dimensions();
  if (d.size() != 2 || d[1] % 2 != 0) return ffi::Error::InvalidArgument("silu_mul: want gate_up[M, 2N]");
  const int64_t n = d[1] / 2, total = d[0] * n;  // output elements
  const float* in = gu.typed_data();
  float* op = out->typed_data();
  constexpr int64_t kBlock = 8192;  // output elements per chunk; a chunk may span rows
  ParallelFor(pool, (total + kBlock - 1) / kBlock, [=](int64_t c) {
    const int64_t end = std::min(total, (c + 1) * kBlock);
    for (int64_t i = c * kBlock; i < end;) {  // one run per row the chunk touches
      const int64_t row = i / n, col = i % n, run_end = std::min(end, (row + 1) * n);
      const float* g = in + row * 2 * n + col;
      SiluMulRun(g, g + n, op + i, run_end - i);
      i = run_end;
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Greedy decoding's argmax: out[r] = the first index of row r's maximum in x f32[R, V] (jnp.argmax's
// tie rule), for rows without NaN. XLA runs this reduction on one thread at ~1.3 ns per logit.

int32_t RowArgmax(const float* p, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float best = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) best = std::max(best, p[i]);
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), target, _CMP_EQ_OQ));
    if (mask) return static_cast<int32_t>(i + __builtin_ctz(mask));
  }
  for (; i < n; ++i) if (p[i] == best) return static_cast<int32_t>(i);
  return 0;  // only with NaN in the row
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] == 0) return ffi::Error::InvalidArgument("argmax: want x[R, V] with V > 0");
  const int64_t n = d[1];
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  ParallelFor(pool, d[0], [=](int64_t r) { op[r] = RowArgmax(xp + r * n, n); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxServeMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("wide")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxServeGroupedMatmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("wide"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxServePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("wide")
                                  .Attr<bool>("values_are_keys"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxServeSiluMul, SiluMul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxServeArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
