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
// product there, rounded otherwise.

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

// R rows of x (row stride ldx) against kc rows of a float panel (an int8 one widened first);
// the sums go to out [R, kPanel], added to what it holds when Add.
template <int64_t R, bool Add, typename PW>
inline void row_block(const float* x, int64_t ldx, int64_t kc, const float* panel,
                      Prefetch<PW> pf, float* out) {
  constexpr int64_t line = 64 / sizeof(PW);  // prefetched weights per cache line
  fvec acc[R][kVectors];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v)
      acc[r][v] = Add ? loadv(out + r * kPanel + v * kLanes) : fvec{};
  for (int64_t k = 0; k < kc; ++k) {
    const float* row = panel + k * kPanel;
    if (k < pf.rows)
      for (int64_t v = 0; v < kPanel; v += line) __builtin_prefetch(pf.at + k * kPanel + v);
    fvec w[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) w[v] = loadv(row + v * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float b = x[r * ldx + k];  // broadcast by the vector product
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += w[v] * b;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v) storev(out + r * kPanel + v * kLanes, acc[r][v]);
}

template <int64_t R = kRowBlock, typename PW>
inline void row_tail(int64_t rows, bool add, const float* x, int64_t ldx, int64_t kc,
                     const float* panel, Prefetch<PW> pf, float* out) {
  if constexpr (R > 0) {
    if (rows == R)
      return add ? row_block<R, true>(x, ldx, kc, panel, pf, out)
                 : row_block<R, false>(x, ldx, kc, panel, pf, out);
    row_tail<R - 1>(rows, add, x, ldx, kc, panel, pf, out);
  }
}

// Panel rows [k0, k0 + rows) as floats: src (the first of them) itself for a float panel; an
// int8 one widened into dst [rows, kPanel], each row times its group's scales (scale: the
// panel's scales [K/group, kPanel]).
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
// An int8 panel is widened to float32 and scaled once, a chunk at a time (or whole, for a long
// run, into a thread's scratch), however few row blocks meet it, and the blocks read the floats:
// widening a vector costs about what its multiply-adds with one block do, so widened per block
// a few rows' product would be compute-bound (docs/BENCHMARKS.md §2, "Quantized projections").
//
// panels: output panel p's weight panels (kParts of them); scales (int8): their scales
// [kParts, K/group, kPanel].
template <bool Glu, typename W>
void panel_unit(const float* x, const W* panels, float* y, int64_t K, int64_t N, int64_t p,
                int64_t m0, int64_t m1, const float* scales, int64_t group) {
  constexpr bool kInt8 = !std::is_same_v<W, float>;
  constexpr int64_t kParts = Glu ? 2 : 1;  // weight panels per output panel
  const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
  const int64_t scale_rows = kInt8 ? K / group : 0;  // a panel's rows of scales
  if ((kInt8 || m1 - m0 > kRowBlock) && m1 - m0 <= kChunkRows) {
    alignas(64) float sums[kParts][kChunkRows * kPanel];
    alignas(64) float wide[kInt8 ? kChunk * kPanel : 1];
    const int64_t blocks = (m1 - m0 + kRowBlock - 1) / kRowBlock;
    for (int64_t part = 0; part < kParts; ++part) {
      const W* panel = panels + part * K * kPanel;
      for (int64_t v = 0; v < std::min(2 * kChunk, K) * kPanel; v += 64 / sizeof(W))
        __builtin_prefetch(panel + v);  // the first two chunks, before any is used
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0), next = k0 + 2 * kChunk;
        const int64_t rows = std::clamp<int64_t>(K - next, 0, kChunk);  // of the chunk ahead
        const float* chunk = widened(panel + k0 * kPanel, kc, wide,
                                     scales + part * scale_rows * kPanel, k0, group);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t m = m0 + b * kRowBlock, first = rows * b / blocks;
          row_tail(std::min(kRowBlock, m1 - m), k0 > 0, x + m * K + k0, K, kc, chunk,
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
  if constexpr (kInt8) {  // a long run: the panels widened once, then read as floats
    thread_local std::vector<float> scratch;  // an XLA pool thread's, reused call after call
    scratch.resize(kParts * K * kPanel);
    for (int64_t part = 0; part < kParts; ++part)
      widened(panels + part * K * kPanel, K, scratch.data() + part * K * kPanel,
              scales + part * scale_rows * kPanel, 0, group);
    panel_unit<Glu>(x, scratch.data(), y, K, N, p, m0, m1, nullptr, 0);
  } else {
    alignas(64) float sums[kParts][kRowBlock * kPanel];
    for (int64_t m = m0; m < m1; m += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, m1 - m);
      for (int64_t part = 0; part < kParts; ++part) {
        const float* panel = panels + part * K * kPanel;
        row_tail(rows, false, x + m * K, K, K, panel,
                 Prefetch<float>{panel + kAhead * kPanel, std::max<int64_t>(K - kAhead, 0)},
                 sums[part]);
      }
      for (int64_t r = 0; r < rows; ++r)
        emit<Glu>(sums[0] + r * kPanel, sums[kParts - 1] + r * kPanel, y + (m + r) * N + n0,
                  width);
    }
  }
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
