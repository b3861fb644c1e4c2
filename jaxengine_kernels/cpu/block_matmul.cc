// A float32 matmul over GGUF blocks read as the file stores them, as XLA FFI custom calls:
// y = x @ dequantize(blocks).T for x f32[M, K] and blocks u8[N, K / 32 * B], row n holding
// output n's blocks along K (B bytes per block of 32 weights: Q4_1 20, Q8_0 34), and live i32[],
// the rows of x to compute (the rest come out zero, as the packed matmul's). The SwiGLU variant
// takes the gate's and up's blocks and gives silu(x @ gate.T) * (x @ up.T).
// jaxengine_kernels/cpu/native.py compiles and registers them, jaxengine_kernels/cpu/
// block_matmul.py calls them, and the tests hold them to gguf's own dequantization.
//
// Why: a decode step reads every weight once for a few rows, and a Q4_1 block is 0.625 bytes a
// weight against float32's 4 (Q8_0: 1.06), so the step reads fewer bytes; the blocks are
// dequantized on the way, in the kernel (docs/BENCHMARKS.md §2, "Quantized projections").
//
// Work: units of a few output rows x a run of kRunRows rows of x (run by run, as the packed
// matmul's, so that a prefill's run of x stays in L2 while the weights stream past), taken by
// XLA's intra-op threads from a shared counter. A decode's few rows (at most kRows) take the
// blocks in registers: kGroup output rows' blocks dequantized a block at a time and multiplied
// into kRows x kGroup vectors of partial sums. More rows go through a scratch: the unit's
// kUnitRows rows dequantized once into float32 rows [kUnitRows, K] (in L2), then every block of
// kRows rows of x (in L1) meets each group of kGroup rows of it in registers as above. The
// scratch path runs at about 0.7x the float32 packed loop's rate on long prefill runs (each
// x vector meets kGroup rows where the packed loop broadcasts x against a 64-column panel;
// docs/BENCHMARKS.md §2, "Quantized projections").
// Numerics: each output is kLanes float32 partial sums over K (lane l: k = l, l + kLanes, ...)
// added in lane_sum's fixed order at the end, whatever the row count or path: a row's result does not depend on the
// rows beside it. The dequantized weights are the file's values d * q + m (Q4_1) and d * q
// (Q8_0) in float32 (one rounding where the compiler fuses Q4_1's multiply-add, two in gguf's
// numpy), so the product equals the float32 matmul over the dequantized file to float32
// rounding.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxengine_cpu::fast_silu;
using jaxengine_cpu::fvec;
using jaxengine_cpu::kLanes;
using jaxengine_cpu::lane_sum;
using jaxengine_cpu::loadv;
using jaxengine_cpu::parallel_for;
using jaxengine_cpu::storev;
using jaxengine_cpu::widen;

constexpr int64_t kBlock = 32;              // weights per block (Q4_1, Q8_0)
constexpr int64_t kVecs = kBlock / kLanes;  // vectors per block

// The IEEE half at p (little-endian, as GGUF stores it) as a float: exact for every half.
// Without F16C (baseline x86-64, other machines) by its bits: a normal's exponent rebiased, a
// subnormal's mantissa times 2^-24, infinities and NaNs kept.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * float(man) * 5.9604644775390625e-8f;
  const uint32_t bits = sign | (exp == 0x1f ? 0x7f800000u : (exp + 112) << 23) | man << 13;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Each format's dequantize(block, out) writes the block's 32 weights as kVecs vectors.
// Q4_1: f16 d, f16 m, 16 bytes of 4-bit q (weight j < 16 in byte j's low nibble, weight 16 + j
// in its high nibble); weight = d * q + m.
struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static void dequantize(const uint8_t* block, fvec* out) {
    typedef uint8_t bytes __attribute__((vector_size(kBlock / 2)));
    const float d = half_at(block), m = half_at(block + 2);
    bytes q;
    std::memcpy(&q, block + 4, sizeof q);
    alignas(16) const bytes nibbles[2] = {q & 15, q >> 4};  // weights 0-15, then 16-31
    const uint8_t* n = reinterpret_cast<const uint8_t*>(nibbles);
    for (int64_t j = 0; j < kVecs; ++j) out[j] = widen(n + j * kLanes) * d + m;
  }
};

// Q8_0: f16 d, 32 int8 q; weight = d * q.
struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static void dequantize(const uint8_t* block, fvec* out) {
    const float d = half_at(block);
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int64_t j = 0; j < kVecs; ++j) out[j] = widen(q + j * kLanes) * d;
  }
};

// kRows x kGroup vectors of sums, kGroup weight vectors and one of x fill the registers
// (32 with AVX-512, 16 otherwise).
#if defined(__AVX512F__)
constexpr int64_t kGroup = 4, kRows = 6;  // 24 + 4 + 1 of 32
#else
constexpr int64_t kGroup = 4, kRows = 2;  // 8 + 4 + 1 of 16
#endif
// Output rows per unit: a decode's units are small, to spread a projection's few rows of blocks
// over the threads evenly; longer runs of x take more, each x row block (in L1) then meeting
// more dequantized rows before the next is read from L2.
constexpr int64_t kDecodeUnitRows = 4 * kGroup, kUnitRows = 16 * kGroup;
constexpr int64_t kRunRows = 96;           // rows of x per unit

// R rows of x [R, K] against the dequantized rows w [kGroup, K]: out[r * ldo + g] for g < width.
template <int64_t R>
inline void dot_block(const float* x, const float* w, int64_t K, float* out, int64_t ldo,
                      int64_t width) {
  fvec acc[R][kGroup] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    fvec wv[kGroup];
    for (int64_t g = 0; g < kGroup; ++g) wv[g] = loadv(w + g * K + k);
    for (int64_t r = 0; r < R; ++r) {
      const fvec xv = loadv(x + r * K + k);
      for (int64_t g = 0; g < kGroup; ++g) acc[r][g] += xv * wv[g];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < width; ++g) out[r * ldo + g] = lane_sum(acc[r][g]);
}

template <int64_t R = kRows>
inline void dot_tail(int64_t rows, const float* x, const float* w, int64_t K, float* out,
                     int64_t ldo, int64_t width) {
  if constexpr (R > 0) {
    if (rows == R) return dot_block<R>(x, w, K, out, ldo, width);
    dot_tail<R - 1>(rows, x, w, K, out, ldo, width);
  }
}

// R rows of x [R, K] against output rows [n0, n0 + width) of `blocks` (row stride
// `row_bytes`), dequantized block by block in registers: out[r * ldo + g] for g < width. A
// decode step's few rows take this way, where a store and load of each weight through the
// scratch would cost as much as the dot products. Rows past width repeat the last one (summed,
// never written), so that the register blocks stay whole.
template <typename Fmt, int64_t R>
inline void dot_blocks(const float* x, const uint8_t* blocks, int64_t row_bytes, int64_t K,
                       int64_t n0, int64_t width, float* out, int64_t ldo) {
  const uint8_t* row[kGroup];
  for (int64_t g = 0; g < kGroup; ++g) row[g] = blocks + (n0 + std::min(g, width - 1)) * row_bytes;
  fvec acc[R][kGroup] = {};
  for (int64_t b = 0; b < K / kBlock; ++b)
    for (int64_t g = 0; g < kGroup; ++g) {
      fvec w[kVecs];
      Fmt::dequantize(row[g] + b * Fmt::kBytes, w);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < kVecs; ++j)
          acc[r][g] += loadv(x + r * K + b * kBlock + j * kLanes) * w[j];
    }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < width; ++g) out[r * ldo + g] = lane_sum(acc[r][g]);
}

template <typename Fmt, int64_t R = kRows>
inline void blocks_tail(int64_t rows, const float* x, const uint8_t* blocks, int64_t row_bytes,
                        int64_t K, int64_t n0, int64_t width, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return dot_blocks<Fmt, R>(x, blocks, row_bytes, K, n0, width, out, ldo);
    blocks_tail<Fmt, R - 1>(rows, x, blocks, row_bytes, K, n0, width, out, ldo);
  }
}

// Rows [m0, m1) of x against output rows [n0, n0 + width) (width <= kUnitRows) of `blocks`:
// the sums to out [m1 - m0, ldo]. At most kRows rows take the blocks in registers, a group of
// kGroup output rows at a time. More rows go through w [kUnitRows, K] (the scratch, in L2),
// each weight dequantized once for all of them; then each block of kRows rows of x (in L1)
// meets every group of the unit's rows in turn.
template <typename Fmt>
void rows(const float* x, const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t n0,
          int64_t width, int64_t m0, int64_t m1, float* w, float* out, int64_t ldo) {
  if (m1 - m0 <= kRows) {
    for (int64_t g = 0; g < width; g += kGroup)
      blocks_tail<Fmt>(m1 - m0, x + m0 * K, blocks, row_bytes, K, n0 + g,
                       std::min(kGroup, width - g), out + g, ldo);
    return;
  }
  for (int64_t g = 0; g < width; ++g)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      fvec v[kVecs];
      Fmt::dequantize(blocks + (n0 + g) * row_bytes + b * Fmt::kBytes, v);
      for (int64_t j = 0; j < kVecs; ++j) storev(w + g * K + b * kBlock + j * kLanes, v[j]);
    }
  const int64_t padded = (width + kGroup - 1) / kGroup * kGroup;
  std::fill(w + width * K, w + padded * K, 0.0f);  // rows past N: summed, never written
  for (int64_t m = m0; m < m1; m += kRows)
    for (int64_t g = 0; g < width; g += kGroup)
      dot_tail(std::min(kRows, m1 - m), x + m * K, w + g * K, K, out + (m - m0) * ldo + g, ldo,
               std::min(kGroup, width - g));
}

// Rows [m0, m1) of x against output rows [n0, n1): y's columns n0 ... n1 - 1 (with Glu,
// silu(gate) * up of the two weights' rows).
template <typename Fmt, bool Glu>
void unit(const float* x, const uint8_t* gate, const uint8_t* up, int64_t row_bytes, float* y,
          int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  // An XLA pool thread's, reused call after call: the dequantized rows [kUnitRows, K], then
  // with Glu the gate's and up's sums [kRunRows, kUnitRows] each.
  thread_local std::vector<float> scratch;
  scratch.resize(kUnitRows * K + (Glu ? 2 * kRunRows * kUnitRows : 0));
  float* w = scratch.data();
  const int64_t width = n1 - n0;
  if constexpr (Glu) {
    float* gs = w + kUnitRows * K;
    float* us = gs + kRunRows * kUnitRows;
    rows<Fmt>(x, gate, row_bytes, K, n0, width, m0, m1, w, gs, kUnitRows);
    rows<Fmt>(x, up, row_bytes, K, n0, width, m0, m1, w, us, kUnitRows);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < width; ++n) {
        const int64_t i = (m - m0) * kUnitRows + n;
        y[m * N + n0 + n] = fast_silu(gs[i]) * us[i];
      }
  } else {
    rows<Fmt>(x, gate, row_bytes, K, n0, width, m0, m1, w, y + m0 * N + n0, N);
  }
}

// y [M, N] from x [M, K] and blocks u8[N, K / 32 * Fmt::kBytes] (with Glu, the gate's and up's).
template <typename Fmt, bool Glu>
ffi::Error BlockMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> gate,
                       ffi::Buffer<ffi::U8> up, ffi::Buffer<ffi::S32> live,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), gd = gate.dimensions(), ud = up.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || gd.size() != 2 || yd.size() != 2 || xd[1] % kBlock != 0 ||
      gd[1] != xd[1] / kBlock * Fmt::kBytes || gd[0] != yd[1] || yd[0] != xd[0] ||
      (Glu && (ud.size() != 2 || ud[0] != gd[0] || ud[1] != gd[1])) || live.element_count() != 1)
    return ffi::Error::InvalidArgument("block_matmul: bad shapes");
  const int64_t K = xd[1], N = yd[1], row_bytes = gd[1];
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, xd[0]);  // rows computed
  const float* X = x.typed_data();
  float* Y = y->typed_data();
  std::fill(Y + M * N, Y + xd[0] * N, 0.0f);
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t span = M <= kRows ? kDecodeUnitRows : kUnitRows;  // output rows per unit
  const int64_t groups = (N + span - 1) / span;
  parallel_for(pool, groups * ((M + kRunRows - 1) / kRunRows), [&](int64_t i) {
    const int64_t n0 = i % groups * span, m0 = i / groups * kRunRows;
    unit<Fmt, Glu>(X, gate.typed_data(), up.typed_data(), row_bytes, Y, K, N, n0,
                   std::min(N, n0 + span), m0, std::min(M, m0 + kRunRows));
  });
  return ffi::Error::Success();
}

}  // namespace

// The plain product takes its blocks twice (as gate and up) so that one signature serves both.
#define JAXENGINE_BLOCK_HANDLER(name, fmt, glu)                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (BlockMatmul<fmt, glu>),          \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<ffi::U8>>()        \
                                    .Arg<ffi::Buffer<ffi::U8>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Ret<ffi::Buffer<ffi::F32>>());
JAXENGINE_BLOCK_HANDLER(BlockMatmulQ4_1, Q4_1, false)
JAXENGINE_BLOCK_HANDLER(BlockMatmulQ8_0, Q8_0, false)
JAXENGINE_BLOCK_HANDLER(BlockSwiGLUQ4_1, Q4_1, true)
JAXENGINE_BLOCK_HANDLER(BlockSwiGLUQ8_0, Q8_0, true)
