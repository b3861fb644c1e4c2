// A float32 matmul over weights packed in column panels, as an XLA FFI custom call: y = x @ w for
// x [M, K] and w [K, N] held as panels [ceil(N/W), K, W] (W = kPanel columns, zero past N),
// and live i32[], the rows of x to compute. The same loop takes int8 panels with float32 scales
// for each group of G inputs of each output column (weight-only int8: y = x @ (w * scale)), laid
// out as the weights' panels [ceil(N/W), K/G, W]: a panel's rows are widened to float32 and
// multiplied by their group's scales a chunk at a time, and the chunk is then multiply-added as
// a float panel is. An int8 panel is a quarter of the bytes, what a memory-bound decode step pays
// for (docs/BENCHMARKS.md §2, "Quantized projections").
// jaxengine_kernels/cpu/native.py compiles and registers it, jaxengine_kernels/cpu/matmul.py packs the
// weights and calls it, and the tests hold it to numpy's product.
//
// Why native code: an engine's projections on the CPU are one step's few rows (decodes) times a
// weight matrix read from memory once per step. Packed in panels, each one contiguous stream,
// the weights go through this loop faster than through XLA's dots over [K, N] or through the
// same loop over [K, N]'s column slices (one short run per row of K): the panels are what pays.
// On long prefill chunks the loop is compute-bound and runs at numpy's sgemm rate, above XLA's
// dots, so one layout serves every step (docs/BENCHMARKS.md §2, "Packed projections").
//
// Work: units of one panel x a run of kRunRows rows, taken by XLA's intra-op threads from a
// shared counter, so a decode step's panels (each read from memory once) spread over the cores
// and a prefill chunk's runs of rows do too (run by run: see Unit). Inside a unit, blocks of
// kRowBlock rows keep kRowBlock x kVectors vectors of sums in registers while the panel (kVectors
// vectors wide) streams by, one row of K at a time (a unit of a few blocks takes the panel in
// chunks of rows, every block over each; see unit).
// Only the first `live` rows are computed and the rest written as zeros: an engine step's token
// bucket pads its rows, and the padding need not cost a product.
// Numerics: float32 multiply-adds in K's order for each output (no fast-math reassociation),
// whatever the row count or a row's place among row blocks, chunks and runs: a row's result
// does not depend on the rows beside it (an engine step's batch; tests/jaxengine_kernels/
// test_batch_invariant.py). XLA's dots do not give that: a row alone is a matrix-vector
// product there, rounded otherwise. The exception, by design: where the CPU has AVX512-BF16
// (kPairDot), int8 panels meet x in bfloat16 (see PairDot), still in K's order, a pair of
// inputs at a time, for every row count alike.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxengine_cpu::fast_silu;
using jaxengine_cpu::fvec;
using jaxengine_cpu::kLanes;
using jaxengine_cpu::loadv;
using jaxengine_cpu::parallel_for;
using jaxengine_cpu::storev;

// A row block's kRowBlock x kVectors sums, the panel row's kVectors vectors and one broadcast of
// x fill the vector registers. AVX2 has 16: 4 rows x 3 vectors (panels of 24 floats) keep 12
// sums and load 7 vectors per 12 multiply-adds, where 2 x 4 keeps 8 and loads 6 per 8.
// kAhead panel rows between a row's prefetch and its use: AVX2's narrower panel rows need more
// of them to ask far enough ahead in bytes (docs/BENCHMARKS.md §2, "AVX2 builds").
#if defined(__AVX512F__)
constexpr int64_t kRowBlock = 6, kVectors = 4, kAhead = 8;  // 24 + 4 + 1 of 32 registers
#elif defined(__AVX2__)
constexpr int64_t kRowBlock = 4, kVectors = 3, kAhead = 32;  // 12 + 3 + 1 of 16
#else
constexpr int64_t kRowBlock = 2, kVectors = 4, kAhead = 8;  // 8 + 4 + 1 of 16: SSE2, AVX
#endif
constexpr int64_t kPanel = kVectors * kLanes;  // columns per panel
constexpr int64_t kRunRows = 96;        // rows per unit (a decode step's rows are one run)
constexpr int64_t kChunkRows = 64;      // the most rows of a unit taken in chunks of K
constexpr int64_t kChunk = 16;          // panel rows per chunk

// PairDot: with AVX512-BF16, an int8 panel's rows (scaled) and x's are rounded to bfloat16 and
// multiplied two inputs at a time by vdpbf16ps, which does a vector's pairs of products and
// adds them to float32 sums in the time of one float multiply-add of a vector: twice the
// products per instruction, what a decode step of tens of rows is bound by once its int8
// panel is in cache (docs/BENCHMARKS.md §2, "Quantized projections"). An int8 weight fits
// bfloat16's 8 bits whole; the rounding is of its product with the scale and of x (relative
// 2^-9 each), far under int8's own (the bf16 activations). Float panels never pair:
// they are the float32 reference.
// A pair is one 32-bit lane: input k's bfloat16 in its low half, k + 1's in its high half
// (zero past K). x's rows in bfloat16, in order, are already pairs; a panel's rows k and k + 1
// are interleaved column by column (pair_rows).
#if defined(__AVX512BF16__)
constexpr bool kPairDot = true;
#else
constexpr bool kPairDot = false;
#endif
typedef uint32_t pvec __attribute__((vector_size(kLanes * sizeof(uint32_t))));  // kLanes pairs

// The multiply-add of a row block: acc + w * x for a float panel row and x's broadcast input;
// acc + the two products of each lane's pair for a pair row and x's broadcast pair.
inline fvec madd(fvec acc, fvec w, float x) { return acc + w * x; }
#if defined(__AVX512BF16__)
inline fvec madd(fvec acc, pvec w, uint32_t x) {
  return fvec(_mm512_dpbf16_ps(__m512(acc), __m512bh(w), __m512bh(_mm512_set1_epi32(x))));
}
// n floats of src as bfloat16 (rounded to nearest, ties to even) into dst [n]; a last part
// under kLanes through masked loads and stores.
inline void to_bf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        __m256i(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
  if (i < n) {
    const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, tail,
                             __m256i(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, src + i))));
  }
}
// kLanes columns of two panel rows as pairs: lo's (input k) and hi's (k + 1).
inline pvec pair_rows(fvec lo, fvec hi) {
  const __m512i l = _mm512_cvtepu16_epi32(__m256i(_mm512_cvtneps_pbh(__m512(lo))));
  const __m512i h = _mm512_cvtepu16_epi32(__m256i(_mm512_cvtneps_pbh(__m512(hi))));
  return pvec(_mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
}
#endif
inline pvec loadv(const uint32_t* p) {
  pvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Unit i of a product over `panels` panels: run i / panels of rows against panel i % panels.
// Run by run, a run's rows of x (at most kRunRows x K floats: 590 KB at K = 1536) stay in the
// core's L2 while the panels stream past, each read once per run and reread from L2 by the
// run's row blocks, where panel by panel every unit would read its run of x back from L3 (a
// 2048-row chunk's x is larger than L2), six strided rows at a time (docs/BENCHMARKS.md §2,
// "Packed projections").
struct Unit {
  int64_t panel, m0, m1;  // rows [m0, m1) of the product against one panel
};
// Units of a product of `rows` rows over `panels` panels.
inline int64_t unit_count(int64_t rows, int64_t panels) {
  return panels * ((rows + kRunRows - 1) / kRunRows);
}
inline Unit unit_at(int64_t i, int64_t panels, int64_t rows) {
  const int64_t m0 = i / panels * kRunRows;
  return {i % panels, m0, std::min(rows, m0 + kRunRows)};
}

// Memory a row block asks for while it computes: `rows` panel rows from `at`, one at each of
// its first `rows` panel rows (a panel row is kPanel weights of type W, float or int8).
template <typename W>
struct Prefetch {
  const W* at;
  int64_t rows;
};

// R rows of x (row stride ldx) against kc rows of a panel of T: floats (an int8 panel widened
// first), or pairs (x's rows in pairs too, ldx and kc in pairs); the sums go to out
// [R, kPanel], added to what it holds when Add. Each step asks for its rows of pf.
template <int64_t R, bool Add, typename T, typename PW>
inline void row_block(const T* x, int64_t ldx, int64_t kc, const T* panel, Prefetch<PW> pf,
                      float* out) {
  constexpr int64_t line = 64 / sizeof(PW);  // prefetched weights per cache line
  // pf's rows per step: two int8 rows make a row of pairs
  constexpr int64_t per = std::is_same_v<T, uint32_t> && std::is_same_v<PW, int8_t> ? 2 : 1;
  using Vec = std::conditional_t<std::is_same_v<T, float>, fvec, pvec>;
  fvec acc[R][kVectors];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v)
      acc[r][v] = Add ? loadv(out + r * kPanel + v * kLanes) : fvec{};
  for (int64_t k = 0; k < kc; ++k) {
    const T* row = panel + k * kPanel;
    for (int64_t i = k * per; i < std::min((k + 1) * per, pf.rows); ++i)
      for (int64_t v = 0; v < kPanel; v += line) __builtin_prefetch(pf.at + i * kPanel + v);
    Vec w[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) w[v] = loadv(row + v * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const T b = x[r * ldx + k];  // broadcast by the vector product
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = madd(acc[r][v], w[v], b);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v) storev(out + r * kPanel + v * kLanes, acc[r][v]);
}

template <int64_t R = kRowBlock, typename T, typename PW>
inline void row_tail(int64_t rows, bool add, const T* x, int64_t ldx, int64_t kc,
                     const T* panel, Prefetch<PW> pf, float* out) {
  if constexpr (R > 0) {
    if (rows == R)
      return add ? row_block<R, true>(x, ldx, kc, panel, pf, out)
                 : row_block<R, false>(x, ldx, kc, panel, pf, out);
    row_tail<R - 1>(rows, add, x, ldx, kc, panel, pf, out);
  }
}

// Panel rows [k0, k0 + rows) as a row block reads them: src (the first of them) itself for a
// float panel; an int8 one widened into dst, each row times its group's scales (scale: the
// panel's scales [K/group, kPanel]): as floats [rows, kPanel], or as pairs
// [(rows + 1) / 2, kPanel] (a missing last row zero).
inline const float* widened(const float* src, int64_t, float*, const float*, int64_t, int64_t) {
  return src;
}
inline const float* widened(const int8_t* src, int64_t rows, float* dst, const float* scale,
                            int64_t k0, int64_t group) {
  for (int64_t k = 0; k < rows; ++k) {
    const float* s = scale + (k0 + k) / group * kPanel;
    for (int64_t v = 0; v < kPanel; v += kLanes)
      storev(dst + k * kPanel + v, jaxengine_cpu::widen(src + k * kPanel + v) * loadv(s + v));
  }
  return dst;
}
#if defined(__AVX512BF16__)
inline const uint32_t* widened(const int8_t* src, int64_t rows, uint32_t* dst,
                               const float* scale, int64_t k0, int64_t group) {
  for (int64_t k = 0; k < rows; k += 2) {
    const float* lo = scale + (k0 + k) / group * kPanel;
    const float* hi = scale + (k0 + k + 1) / group * kPanel;  // read only below `rows`
    for (int64_t v = 0; v < kPanel; v += kLanes) {
      const fvec second = k + 1 < rows
          ? jaxengine_cpu::widen(src + (k + 1) * kPanel + v) * loadv(hi + v) : fvec{};
      const pvec pairs =
          pair_rows(jaxengine_cpu::widen(src + k * kPanel + v) * loadv(lo + v), second);
      std::memcpy(dst + k / 2 * kPanel + v, &pairs, sizeof pairs);
    }
  }
  return dst;
}
#endif

// x's rows as a row block reads them: floats, or pairs (PairDot) from row `first` on.
template <typename T>
struct Rows {
  const T* at;
  int64_t ld, first;  // elements per row; the row `at` points to
  // Row m from its input k0 (k0 even for pairs).
  const T* row(int64_t m, int64_t k0) const {
    return at + (m - first) * ld + (std::is_same_v<T, float> ? k0 : k0 / 2);
  }
  // A row block's steps over kc inputs.
  static int64_t steps(int64_t kc) { return std::is_same_v<T, float> ? kc : (kc + 1) / 2; }
};

// Output columns of one panel's sums: y = sums (a plain product), or y = silu(gate) * up for a
// SwiGLU pair (Glu: the gate's sums and the up projection's, side by side in their panels).
template <bool Glu>
inline void emit(const float* gate, const float* up, float* y, int64_t width) {
#pragma omp simd
  for (int64_t c = 0; c < width; ++c) {
    if constexpr (Glu) {
      y[c] = fast_silu(gate[c]) * up[c];
    } else {
      y[c] = gate[c];
    }
  }
}

// Rows [m0, m1) of x against output panel p; writes y's columns of that panel (the last one may
// be narrower than kPanel: its sums go through a buffer). Without Glu output panel p is weight
// panel p; with Glu it is silu(x @ panel 2p) * (x @ panel 2p + 1): the gate and up projections'
// panels interleaved, so the MLP's hidden activations come out of one call and the [M, 2F]
// product of the two is never written.
//
// A few row blocks (a decode step's 7 to 64 rows) take the panel in chunks of kChunk rows,
// every block over one chunk before the next, their sums kept in a buffer: the panel streams
// from memory once while the blocks compute on the chunk in L1 (block by block, all but the
// first would reread it from L2 with the memory idle). Each block of a chunk asks for its share
// of the chunk two ahead, so the memory is busy while every block computes, not only the first.
// One block, or a long run of rows (compute-bound), takes the whole panel per block, asking for
// each panel row kAhead rows before its use. Chunks go up to 64 rows: a bucket-64 decode step's
// live rows gain from them, 96-row runs do not, and a prefill's runs stay unchunked
// (docs/BENCHMARKS.md §2, "Packed projections").
//
// An int8 panel is widened to float32 (or pairs) and scaled once, a chunk at a time (or whole,
// for a long run, into a thread's scratch), however few row blocks meet it, and the blocks read
// the result: widening a vector costs about what its multiply-adds with one block do, so
// widened per block a few rows' product would be compute-bound (docs/BENCHMARKS.md §2,
// "Quantized projections").
//
// x: rows [m0, m1) as floats, or as pairs for an int8 panel where kPairDot (panel_unit).
// panels: output panel p's weight panels (kParts of them); scales (int8): their scales
// [kParts, K/group, kPanel].
template <bool Glu, typename W, typename T>
void panel_rows(Rows<T> x, const W* panels, float* y, int64_t K, int64_t N, int64_t p,
                int64_t m0, int64_t m1, const float* scales, int64_t group) {
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  constexpr int64_t kParts = Glu ? 2 : 1;  // weight panels per output panel
  const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
  const int64_t scale_rows = kInt8 ? K / group : 0;  // a panel's rows of scales
  if ((kInt8 || m1 - m0 > kRowBlock) && m1 - m0 <= kChunkRows) {
    alignas(64) float sums[kParts][kChunkRows * kPanel];
    alignas(64) T wide[kInt8 ? kChunk * kPanel : 1];
    const int64_t blocks = (m1 - m0 + kRowBlock - 1) / kRowBlock;
    for (int64_t part = 0; part < kParts; ++part) {
      const W* panel = panels + part * K * kPanel;
      for (int64_t v = 0; v < std::min(2 * kChunk, K) * kPanel; v += 64 / sizeof(W))
        __builtin_prefetch(panel + v);  // the first two chunks, before any is used
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0), next = k0 + 2 * kChunk;
        const int64_t rows = std::clamp<int64_t>(K - next, 0, kChunk);  // of the chunk ahead
        const T* chunk = widened(panel + k0 * kPanel, kc, wide,
                                 scales + part * scale_rows * kPanel, k0, group);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t m = m0 + b * kRowBlock, first = rows * b / blocks;
          row_tail(std::min(kRowBlock, m1 - m), k0 > 0, x.row(m, k0), x.ld, x.steps(kc), chunk,
                   Prefetch<W>{panel + (next + first) * kPanel, rows * (b + 1) / blocks - first},
                   sums[part] + (m - m0) * kPanel);
        }
      }
    }
    for (int64_t m = m0; m < m1; ++m)
      emit<Glu>(sums[0] + (m - m0) * kPanel, sums[kParts - 1] + (m - m0) * kPanel,
                y + m * N + n0, width);
    return;
  }
  // One block of float rows, or a long run: the whole panel per block (an int8 one widened
  // once into a thread's scratch first), each row asked for kAhead rows before its use.
  const T* whole[kParts];
  thread_local std::vector<T> scratch;  // an XLA pool thread's, reused call after call
  if constexpr (kInt8) scratch.resize(kParts * K * kPanel);
  for (int64_t part = 0; part < kParts; ++part)
    whole[part] = widened(panels + part * K * kPanel, K, scratch.data() + part * K * kPanel,
                          scales + part * scale_rows * kPanel, 0, group);
  const int64_t steps = x.steps(K);
  alignas(64) float sums[kParts][kRowBlock * kPanel];
  for (int64_t m = m0; m < m1; m += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, m1 - m);
    for (int64_t part = 0; part < kParts; ++part)
      row_tail(rows, false, x.row(m, 0), x.ld, steps, whole[part],
               Prefetch<T>{whole[part] + kAhead * kPanel, std::max<int64_t>(steps - kAhead, 0)},
               sums[part]);
    for (int64_t r = 0; r < rows; ++r)
      emit<Glu>(sums[0] + r * kPanel, sums[kParts - 1] + r * kPanel, y + (m + r) * N + n0,
                width);
  }
}

// Rows [m0, m1) of x against output panel p: x as floats, or for an int8 panel where
// kPairDot as pairs (rounded to bfloat16 once per unit: a 64th of the unit's products).
template <bool Glu, typename W>
void panel_unit(const float* x, const W* panels, float* y, int64_t K, int64_t N, int64_t p,
                int64_t m0, int64_t m1, const float* scales, int64_t group) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, int8_t>) {
    thread_local std::vector<uint32_t> pairs;  // an XLA pool thread's, reused call after call
    const int64_t ld = (K + 1) / 2;
    pairs.resize((m1 - m0) * ld);
    for (int64_t m = m0; m < m1; ++m) {
      uint16_t* row = reinterpret_cast<uint16_t*>(pairs.data() + (m - m0) * ld);
      to_bf16(x + m * K, K, row);
      if (K % 2) row[K] = 0;  // an odd K's last pair: zero in its high half
    }
    return panel_rows<Glu>(Rows<uint32_t>{pairs.data(), ld, m0}, panels, y, K, N, p, m0, m1,
                           scales, group);
  }
#endif
  panel_rows<Glu>(Rows<float>{x, K, 0}, panels, y, K, N, p, m0, m1, scales, group);
}

// Rows [m0, m1) of x against output panel p of w (every weight panel); scale is null for
// float32 panels, else int8 panels' scales [(Glu ? 2 : 1) * ceil(N/W), K/group, W], laid out as
// the panels.
template <bool Glu, typename W = float>
void unit(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t p, int64_t m0,
          int64_t m1, const float* scale, int64_t group) {
  constexpr int64_t kParts = Glu ? 2 : 1;
  const float* scales = scale ? scale + kParts * p * (K / group) * kPanel : nullptr;
  panel_unit<Glu>(x, w + kParts * p * K * kPanel, y, K, N, p, m0, m1, scales, group);
}

// y [M, N] from x [M, K] and panels [(Glu ? 2 : 1) * ceil(N/W), K, W] of float32 weights, or of
// int8 weights with their groups' scales (see unit; group: inputs per scale).
template <bool Glu, typename W>
ffi::Error Packed(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const W* w,
                  ffi::Span<const int64_t> wd, const float* scale, int64_t group, int64_t live,
                  ffi::ResultBuffer<ffi::F32>& y) {
  constexpr int64_t kParts = Glu ? 2 : 1;
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel ||
      wd[1] != xd[1] || yd[0] != xd[0] || kParts * ((yd[1] + kPanel - 1) / kPanel) != wd[0])
    return ffi::Error::InvalidArgument("packed_matmul: bad shapes");
  const int64_t K = xd[1], N = yd[1], panels = wd[0] / kParts;
  const int64_t M = std::clamp<int64_t>(live, 0, xd[0]);  // rows computed
  const float* X = x.typed_data();
  float* Y = y->typed_data();
  std::fill(Y + M * N, Y + xd[0] * N, 0.0f);
  if (M == 0 || N == 0) return ffi::Error::Success();
  parallel_for(pool, unit_count(M, panels), [&](int64_t i) {
    const Unit u = unit_at(i, panels, M);
    unit<Glu>(X, w, Y, K, N, u.panel, u.m0, u.m1, scale, group);
  });
  return ffi::Error::Success();
}

template <bool Glu>
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("packed_matmul: bad live");
  return Packed<Glu>(pool, x, w.typed_data(), w.dimensions(), nullptr, 1, live.typed_data()[0],
                     y);
}

template <bool Glu>
ffi::Error PackedInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> live,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), sd = scale.dimensions();
  if (live.element_count() != 1 || wd.size() != 3 || sd.size() != 3 || sd[0] != wd[0] ||
      sd[1] < 1 || wd[1] % sd[1] != 0 || sd[2] != wd[2])
    return ffi::Error::InvalidArgument("packed_matmul_int8: bad shapes");
  return Packed<Glu>(pool, x, w.typed_data(), wd, scale.typed_data(), wd[1] / sd[1],
                     live.typed_data()[0], y);
}

}  // namespace

// The panel width the library was built with (the packing must match it).
extern "C" int64_t PackedMatmulPanel() { return kPanel; }
// Whether int8 panels meet x in bfloat16 pairs (PairDot) in this build.
extern "C" int64_t PackedInt8Pairs() { return kPairDot; }

#define JAXENGINE_PACKED_HANDLER(name, glu)                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PackedMatmul<glu>,                 \
                                ffi::Ffi::Bind()                         \
                                    .Ctx<ffi::ThreadPool>()              \
                                    .Arg<ffi::Buffer<ffi::F32>>()        \
                                    .Arg<ffi::Buffer<ffi::F32>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::F32>>());
JAXENGINE_PACKED_HANDLER(PackedMatmulF32, false)
JAXENGINE_PACKED_HANDLER(PackedSwiGLUF32, true)

#define JAXENGINE_PACKED_INT8_HANDLER(name, glu)                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PackedInt8<glu>,                   \
                                ffi::Ffi::Bind()                         \
                                    .Ctx<ffi::ThreadPool>()              \
                                    .Arg<ffi::Buffer<ffi::F32>>()        \
                                    .Arg<ffi::Buffer<ffi::S8>>()         \
                                    .Arg<ffi::Buffer<ffi::F32>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::F32>>());
JAXENGINE_PACKED_INT8_HANDLER(PackedMatmulInt8, false)
JAXENGINE_PACKED_INT8_HANDLER(PackedSwiGLUInt8, true)
