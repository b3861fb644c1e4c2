// Ragged paged attention on the CPU, as an XLA FFI custom call. jaxengine_kernels/cpu/native.py
// compiles and registers it, jaxengine_kernels/cpu/kernel.py calls it, and the contract is the jnp
// reference's (jaxengine_kernels/reference.py), which the tests hold it to.
//
// Why native code: XLA's CPU backend runs this op's irregular, memory-bound shape badly. A
// decode reads each cached key and value once for a few multiply-adds, from pages scattered
// over the pool; in jnp that becomes page gathers, layout copies and thousands of tiny batched
// dots (docs/BENCHMARKS.md §4). Here every request reads its own pages in place.
//
// Layout (the reference's): q f32[T, N, H]; kv_cache [P, L, 2K, H] with key head k at head slot
// 2k and value head k at 2k+1, in float32, bfloat16, float8_e4m3fn or float8_e5m2, or u8 holding
// the bits of fp8 entries (`fp8_bits` names the format: XLA on CPU scatters the step's new rows
// into a donated u8 array in place, not into an fp8 one); block_tables i32[R, max_blocks];
// seq_lens i32[R] (context after
// the step); query_start_loc i32[R+1]; num_seqs i32[]. Query head n reads kv head n / G.
// Output f32[T, N, H]: the live tokens' rows; every other row is zero. The step's new keys and
// values are already in the cache (XLA scatters them before this call).
//
// Work is cut into units, one request's run of query tokens against a run of its pages:
//  - a request of at most kSplitTokens tokens (a decode, a speculative chunk) is one run of
//    tokens, split over runs of `pages_per_split` pages when its context is longer (split-K);
//    the partial softmax states are merged afterwards;
//  - a longer request (a prefill chunk) is cut into runs of `block_q` tokens, each reading the
//    pages up to its last token.
// XLA's intra-op threads take units from one shared counter, longest first.
// With batch_invariant, a token's output does not depend on the chunk it came in (a decode,
// a whole prompt, the tail after a cached prefix, a chunk the token budget cut): every unit
// takes the transposed path and none is split over pages. The two score paths sum a dot in
// different orders (a decode: a vector of head-dim lanes, then a tree; the transposed path:
// one lane down the head dim), and a split merges partial softmax states, which rounds
// otherwise than one pass; the softmax sums and P.V already agree row by row. It costs a
// decode the transposed path's idle lanes (one vector of rows for its G rows).
//
// Quantized caches (jaxengine_kernels/cache_dtype.py): a cached entry x stands for x * k_scale
// (keys) or x * v_scale (values), per-tensor f32[] operands. Both are folded where they are
// exact to float32 rounding: k_scale into the query scale (sm_scale * k_scale multiplies every
// query element), v_scale into the output's normalisation. Cache rows are widened to float32
// as they are read: bfloat16 by a shift, fp8 by integer vector operations (widen_fp8), a
// decode's keys once per tile for all G query rows.
//
// Numerics: float32 (narrower cache entries are widened), an online softmax per tile of kKeys keys
// (64 with AVX-512). A decode's few query rows take each key's dots a vector of keys at a
// time; a prefill chunk's rows take the tile's scores transposed, a vector of rows at a time
// (see Scratch). With a head dim under kLanes (16 with AVX-512, 8 with AVX2, 4 with SSE) the
// two paths give a token the same bits: both sum each score over h in order (group_dots's
// scalar tail, score_block), and the softmax sums and P.V in key order. From kLanes up a
// decode's dots are vectors of partial sums added by a tree, and the paths differ by float32
// rounding (under 1e-6 at head dim 64: tests/jaxengine_kernels/test_cpu_kernel.py).
// Only slots inside a request's context are read as keys or values, so whatever the other
// slots hold (NaN included) never reaches the output.
//
// Sliding windows (`sliding_window` W > 0, an operand: layers of one compiled scan differ): a
// query at position p sees the keys p - W < k <= p. A unit starts at the first key its
// earliest token sees (`begin`): plan() cuts a short request's pages from the page holding
// it, and run() walks the keys from it, so the pages before are never read (the scheduler
// may have handed them to another request). With batch_invariant the tiles stay anchored at
// multiples of kKeys, whatever chunk a token comes in: the first tile's keys before `begin`
// are masked for every row, their cache rows stood in for by `begin`'s (finite, never read
// from a page the window left). Each row masks its own keys below its window in both
// softmax paths; P.V adds their zero probabilities times finite values.
// Soft-capping (Gemma 2's `soft_cap` c > 0, an attribute; 0: none) maps each score s to
// c tanh(s / c) right after the dots.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxengine_cpu::fast_exp;
using jaxengine_cpu::fast_tanh;
using jaxengine_cpu::fvec;  // vectors as wide as the CPU's (simd.h)
using jaxengine_cpu::kLanes;
using jaxengine_cpu::loadv;
using jaxengine_cpu::parallel_for;
using jaxengine_cpu::storev;

// A tile is 4 vectors of keys. Register blocking: with AVX-512's 32 registers the transposed
// score product keeps 6 keys x 4 vectors of query rows of accumulators and P.V 4 rows x 4
// vectors. With 16 (AVX2 and below) 4 keys x 3 vectors and 3 rows x 4 vectors fill them with
// 12 sums, the loaded vectors and the broadcasts, and 3 rows are a decode's 3 query heads per
// kv head in SmolLM2 (no spare row); faster than 2 x 4 and 2 rows (docs/BENCHMARKS.md §2,
// "AVX2 builds").
#if defined(__AVX512F__)
constexpr int64_t kWideKeys = 6;      // keys whose broadcasts share each query-vector load
constexpr int64_t kWideVectors = 4;   // vectors of query rows per transposed score block
constexpr int64_t kPvRows = 4;        // query rows that share each value load in P.V
#else
constexpr int64_t kWideKeys = 4;
constexpr int64_t kWideVectors = 3;
constexpr int64_t kPvRows = 3;
#endif
constexpr int64_t kKeys = 4 * kLanes;  // keys per tile (one online-softmax step)
constexpr int64_t kAhead = 4;         // keys between a token row's prefetch and its use
constexpr int64_t kWideRows = 8;      // rows from which a tile's scores are computed transposed
constexpr int64_t kSplitTokens = 8;   // requests of at most this many tokens split over pages
constexpr float kMasked = -1e30f;     // running max before any visible key (finite: fast_exp)

using bf16 = uint16_t;  // XLA FFI's BF16 native type: the upper half of a float32
// One byte of float8_e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no inf,
// S.1111.111 is NaN) or of float8_e5m2 (IEEE-like: 5 exponent bits biased by 15, 2 mantissa
// bits). Distinct types, so that widen() and load_widened() pick the format.
struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };
inline fvec vmax(fvec a, fvec b) { return a > b ? a : b; }

typedef uint8_t u8vec __attribute__((vector_size(kLanes)));
typedef uint32_t u32vec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// kLanes fp8 bytes (M mantissa bits, exponent bias B, IEEE inf/NaN at the top exponent or
// e4m3fn's single NaN) widened exactly with integer vector operations, on every ISA level: a
// normal byte (exponent field e > 0) is the float32 whose exponent is e + 127 - B and whose
// mantissa is the byte's, shifted to the top; a subnormal one (e = 0) is m * 2^(1 - B - M),
// computed as a float (a float32 denormal would be slow to multiply, and every fp8 value is a
// normal float32).
template <int M, int B, bool kIeee>
[[gnu::always_inline]] inline fvec widen_fp8(const uint8_t* p) {
  u8vec bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  // Through 16 bits: GCC widens bytes to 32 bits in one step lane by lane, in two with vector
  // instructions (vpmovzxbw, vpmovzxwd).
  typedef uint16_t u16vec __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  const u32vec u = __builtin_convertvector(__builtin_convertvector(bytes, u16vec), u32vec);
  const u32vec mag = u & 0x7Fu, sign = (u & 0x80u) << 24;
  const u32vec exponent = mag >> M;
  u32vec bits = sign | ((mag << (23 - M)) + (uint32_t(127 - B) << 23));
  if constexpr (kIeee)  // the top exponent: inf (m = 0) or NaN
    bits = exponent == (0xFFu >> (M + 1)) ? (sign | 0x7F800000u | (mag << (23 - M))) : bits;
  else  // S.1111.111
    bits = mag == 0x7Fu ? (sign | 0x7FC00000u) : bits;
  const fvec small = __builtin_convertvector(mag, fvec) * (1.0f / float(1 << (B - 1 + M)));
  u32vec small_bits;
  std::memcpy(&small_bits, &small, sizeof small_bits);
  bits = exponent == 0u ? (small_bits | sign) : bits;
  fvec f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
[[gnu::always_inline]] inline fvec widen_e4m3(const uint8_t* p) {
  return widen_fp8<3, 7, false>(p);
}
[[gnu::always_inline]] inline fvec widen_e5m2(const uint8_t* p) {
  return widen_fp8<2, 15, true>(p);
}

// The 256 values of a format, for one element at a time (widened by the vector code above).
struct Fp8Table {
  float value[256];
  explicit Fp8Table(fvec (*widen)(const uint8_t*)) {
    uint8_t bytes[256];
    for (int b = 0; b < 256; ++b) bytes[b] = uint8_t(b);
    for (int b = 0; b < 256; b += kLanes) storev(value + b, widen(bytes + b));
  }
};
const Fp8Table kE4M3(widen_e4m3);
const Fp8Table kE5M2(widen_e5m2);

// kLanes floats from p, widened when p points at bfloat16 or fp8.
inline fvec load_widened(const float* p) { return loadv(p); }
inline fvec load_widened(const fp8_e4m3* p) {
  return widen_e4m3(reinterpret_cast<const uint8_t*>(p));
}
inline fvec load_widened(const fp8_e5m2* p) {
  return widen_e5m2(reinterpret_cast<const uint8_t*>(p));
}
inline fvec load_widened(const bf16* p) {
  typedef uint16_t hvec __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t uvec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  hvec h;
  std::memcpy(&h, p, sizeof h);
  const uvec bits = __builtin_convertvector(h, uvec) << 16;
  fvec f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Lane sums of kLanes vectors at once: lane j of transpose_sum(v) is the sum of v[j]'s lanes.
// A halving tree: at width w (kLanes/2, then /4, ... 1) vectors 2i and 2i+1 fold into one
// whose blocks of 2w lanes hold w lanes of each (lane l = block * 2w + within: a's where
// within < w, else b's; the block's first halves plus its second halves). The tree leaves
// the sum of v[bitrev(l)] in lane l, and one last shuffle puts each where it belongs.
constexpr int64_t fold_lane(int64_t l, int64_t w, bool first) {
  const int64_t base = l / (2 * w) * (2 * w), within = l % (2 * w);
  return within < w ? base + within + (first ? 0 : w) : kLanes + base + within - (first ? w : 0);
}
constexpr int64_t bit_reversed(int64_t l) {
  int64_t r = 0;
  for (int64_t bit = 1; bit < kLanes; bit <<= 1) r = (r << 1) | ((l & bit) ? 1 : 0);
  return r;
}
template <int64_t W, int64_t... I>
inline fvec fold(fvec a, fvec b, std::integer_sequence<int64_t, I...>) {
  return __builtin_shufflevector(a, b, fold_lane(I, W, true)...) +
         __builtin_shufflevector(a, b, fold_lane(I, W, false)...);
}
template <int64_t W>
inline void fold_level(fvec* v) {  // v[0, 2W) -> v[0, W)
  for (int64_t i = 0; i < 2 * W; i += 2)
    v[i / 2] = fold<W>(v[i], v[i + 1], std::make_integer_sequence<int64_t, kLanes>{});
  if constexpr (W > 1) fold_level<W / 2>(v);
}
template <int64_t... I>
inline fvec unreverse(fvec x, std::integer_sequence<int64_t, I...>) {
  return __builtin_shufflevector(x, x, bit_reversed(I)...);
}
inline fvec transpose_sum(fvec* v) {  // v[kLanes], overwritten
  fold_level<kLanes / 2>(v);
  return unreverse(v[0], std::make_integer_sequence<int64_t, kLanes>{});
}

inline float widen(float x) { return x; }
inline float widen(fp8_e4m3 x) { return kE4M3.value[x.bits]; }
inline float widen(fp8_e5m2 x) { return kE5M2.value[x.bits]; }
inline float widen(bf16 x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// n elements of a cache row, widened into dst: kLanes at a time, then one by one.
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  int64_t h = 0;
  for (; h + kLanes <= n; h += kLanes) storev(dst + h, load_widened(src + h));
  for (; h < n; ++h) dst[h] = widen(src[h]);
}

// The first key position a query at `pos` sees with window W (W keys, itself included; the
// reference's first_visible): 0 without a window.
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0;
}

struct Geometry {
  int64_t T, N, K, G, H, P, L, max_blocks;
  int64_t token_stride() const { return 2 * K * H; }  // elements between a page's tokens
  int64_t page_stride() const { return L * token_stride(); }
};

struct Request {
  int64_t q_start, q_len, ctx;  // first token row in q, tokens this step, context after it
  const int32_t* table;         // [max_blocks] its pages
};

// Tokens [tok0, tok1) of request `req` (offsets inside its chunk) against its pages
// [page0, page1). A split unit leaves its unnormalised state in scratch slot `slot`.
struct Unit {
  int64_t req, tok0, tok1, page0, page1;
  bool split;
  int64_t slot;
  int64_t cost;  // rows x keys: units are handed out longest first
};

// A unit's working set. Rows are kv-head-major: row k * rows_k + t * G + g is token tok0 + t,
// query head k * G + g, where rows_k = (tok1 - tok0) * G.
//
// A unit of few rows (a decode: rows_k < kWideRows) keeps its scores row-major, [rows, kKeys]:
// each row's dots with kLanes keys at a time. A wider unit (a prefill chunk) keeps them
// transposed, S^T [kKeys, R] with R = rows_k rounded up to whole vectors: a key row read in
// place from the cache is broadcast against the queries held transposed ([H, R]), and the
// softmax then runs down the keys a vector of rows at a time (no per-row reductions, no
// transposed copy of every tile's keys).
struct Scratch {
  std::vector<float> q;    // decode: [K, rows_k, H]; wide: [K, H, R]; scaled queries
  std::vector<float> m;    // [K * rows_k] running max
  std::vector<float> l;    // [K * rows_k] running denominator
  std::vector<float> acc;  // [K * rows_k, H] running numerator
  std::vector<float> s;    // a tile's scores, then its probabilities: [rows_k, kKeys] / [kKeys, R]
  std::vector<float> vt;   // [kKeys, H] a tile's values, widened (narrower caches only)
  std::vector<float> kt;   // [kLanes, K, H] a decode's keys of kLanes tokens, widened (fp8)
  std::vector<int64_t> visible;  // [rows] per row, keys of the tile it sees
  std::vector<float> alpha;      // [rows] per row, the softmax rescale of the tile
  std::vector<float> spare;      // [kPvRows, H] accumulators of rows past the last
  std::vector<float> zeros;      // [kKeys] the probabilities of rows past the last (decode)
  std::vector<float> token;      // wide: [R] each row's token (t, as a float; padding: the last)
  std::vector<float> wm, wl, mx; // wide: [R] one kv head's running max and sum, the tile's max
  std::vector<float> sum;        // wide: [R] the tile's probabilities summed
};

template <typename T>
class PagedAttention {
 public:
  // sm_scale * k_scale scales the queries (q . (x k_scale) = (q k_scale) . x), v_scale the
  // normalised output.
  PagedAttention(const Geometry& g, const float* q, const T* cache, float sm_scale,
                 float k_scale, float v_scale, int64_t window, float soft_cap,
                 bool batch_invariant)
      : g_(g), q_(q), cache_(cache), scale_(sm_scale * k_scale), v_scale_(v_scale),
        window_(window), cap_(soft_cap), batch_invariant_(batch_invariant) {}

  int64_t rows(const Unit& u) const { return g_.K * (u.tok1 - u.tok0) * g_.G; }
  // Rows between scratch slots: the most a split unit has.
  int64_t slot_rows() const { return kSplitTokens * g_.N; }

  // Attend one unit: a split unit's state goes to scratch (m [rows], l [rows], acc [rows, H]),
  // any other's is normalised into `out`.
  void run(const Unit& u, const Request& rq, Scratch& sc, float* out, float* m, float* l,
           float* acc) const {
    const int64_t rows_k = (u.tok1 - u.tok0) * g_.G, n = rows(u), H = g_.H;
    load_queries(u, rq, sc);
    sc.m.assign(n, kMasked);
    sc.l.assign(n, 0.0f);
    sc.acc.assign(n * H, 0.0f);
    // The unit's keys, in tiles of kKeys positions, from the first its earliest token sees (or
    // its first page); the last visible key of its last token is at ctx - q_len + tok1 - 1.
    const int64_t begin =
        std::max(u.page0 * g_.L, first_visible(rq.ctx - rq.q_len + u.tok0, window_));
    const int64_t end = std::min(u.page1 * g_.L, rq.ctx - rq.q_len + u.tok1);
    const int64_t start = batch_invariant_ ? begin / kKeys * kKeys : begin;  // the first tile
    // Token rows of this tile and the next, [2 * kKeys]: while head 0 reads key j, the row of
    // key j + kAhead is prefetched (pages are scattered over the pool, so the hardware
    // prefetcher finds each one only once it is read).
    const T* rows[2 * kKeys];
    int64_t have = token_rows(rq, start, std::max<int64_t>(std::min(2 * kKeys, end - start), 0),
                              begin, rows);
    for (int64_t j = 0; j < std::min(kAhead, have); ++j) prefetch_token(rows[j]);
    for (int64_t key0 = start; key0 < end; key0 += kKeys) {
      const int64_t nk = std::min(kKeys, end - key0);
      if (!is_wide(rows_k)) {  // every kv head's at once
        scores(sc, rows_k, rows, nk, have);
        if (cap_ > 0.0f) soft_cap(sc.s.data(), g_.K * rows_k * kKeys);
      }
      for (int64_t k = 0; k < g_.K; ++k)
        tile(sc, k, rows_k, rows, nk, key0, u, rq, have);
      // Slide: the next tile's rows move down, the one after is looked up.
      if (have > kKeys) std::copy(rows + kKeys, rows + have, rows);
      have = std::max<int64_t>(have - kKeys, 0);
      const int64_t next = key0 + kKeys + have;
      if (next < end)
        have += token_rows(rq, next, std::min(kKeys, end - next), begin, rows + have);
    }
    if (u.split) {
      std::copy(sc.m.begin(), sc.m.end(), m);
      std::copy(sc.l.begin(), sc.l.end(), l);
      std::copy(sc.acc.begin(), sc.acc.end(), acc);
      return;
    }
    for (int64_t row = 0; row < n; ++row) {
      const float inv = sc.l[row] > 0.0f ? v_scale_ / sc.l[row] : 0.0f;
      const float* a = sc.acc.data() + row * H;
      float* o = out + out_offset(u, rq, row);
      for (int64_t h = 0; h < H; ++h) o[h] = a[h] * inv;
    }
  }

  // Merge the scratch states of one split request's `count` units into `out`.
  void merge(const Unit* units, int64_t count, const Request& rq, const float* m,
             const float* l, const float* acc, float* out) const {
    const int64_t n = rows(units[0]), H = g_.H, stride = slot_rows();
    for (int64_t row = 0; row < n; ++row) {
      float mx = kMasked;
      for (int64_t i = 0; i < count; ++i) mx = std::max(mx, m[units[i].slot * stride + row]);
      float* o = out + out_offset(units[0], rq, row);
      std::fill(o, o + H, 0.0f);
      float denom = 0.0f;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t at = units[i].slot * stride + row;
        if (l[at] == 0.0f) continue;  // this run of pages held no visible key
        const float w = fast_exp(m[at] - mx);
        denom += w * l[at];
        const float* a = acc + at * H;
        for (int64_t h = 0; h < H; ++h) o[h] += w * a[h];
      }
      const float inv = denom > 0.0f ? v_scale_ / denom : 0.0f;
      for (int64_t h = 0; h < H; ++h) o[h] *= inv;
    }
  }

 private:
  // The cache rows of positions [key0, key0 + n) of a request, into `rows`; returns n. Rows
  // before `begin` (the unit's first key: the first tile of a batch-invariant unit starts
  // before it) are begin's row: their keys are masked, and their pages may be another's.
  int64_t token_rows(const Request& rq, int64_t key0, int64_t n, int64_t begin,
                     const T** rows) const {
    int64_t j = 0;
    if (key0 < begin) {
      const T* first = row_at(rq, begin);
      for (; j < std::min(n, begin - key0); ++j) rows[j] = first;
    }
    while (j < n) {
      const int64_t pos = key0 + j, page = pos / g_.L, offset = pos % g_.L;
      const T* base = cache_ + std::clamp<int64_t>(rq.table[page], 0, g_.P - 1) *
                                   g_.page_stride();
      for (int64_t o = offset; o < g_.L && j < n; ++o, ++j) rows[j] = base + o * g_.token_stride();
    }
    return n;
  }

  const T* row_at(const Request& rq, int64_t pos) const {
    const int64_t page = std::clamp<int64_t>(rq.table[pos / g_.L], 0, g_.P - 1);
    return cache_ + page * g_.page_stride() + pos % g_.L * g_.token_stride();
  }

  // s[0, n) = cap * tanh(s / cap), vectorised.
  void soft_cap(float* s, int64_t n) const {
    const float cap = cap_, inv = 1.0f / cap_;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] = cap * fast_tanh(s[i] * inv);
  }

  int64_t out_offset(const Unit& u, const Request& rq, int64_t row) const {
    const int64_t rows_k = (u.tok1 - u.tok0) * g_.G;
    const int64_t k = row / rows_k, t = row % rows_k / g_.G, gi = row % g_.G;
    return ((rq.q_start + u.tok0 + t) * g_.N + k * g_.G + gi) * g_.H;
  }

  // Whether a unit of rows_k rows per kv head takes the transposed (prefill) path: every unit
  // does when batch-invariant.
  bool is_wide(int64_t rows_k) const { return batch_invariant_ || rows_k >= kWideRows; }
  // Rows of a wide unit's transposed scores: rows_k rounded up to whole vectors.
  static int64_t wide_rows(int64_t rows_k) { return (rows_k + kLanes - 1) / kLanes * kLanes; }

  void load_queries(const Unit& u, const Request& rq, Scratch& sc) const {
    const int64_t ntok = u.tok1 - u.tok0, G = g_.G, H = g_.H, rows_k = ntok * G;
    const bool wide = is_wide(rows_k);
    const int64_t R = wide ? wide_rows(rows_k) : rows_k;  // rows per kv head in sc.q
    sc.q.assign(g_.K * R * H, 0.0f);
    for (int64_t k = 0; k < g_.K; ++k)
      for (int64_t t = 0; t < ntok; ++t)
        for (int64_t gi = 0; gi < G; ++gi) {
          const float* src = q_ + ((rq.q_start + u.tok0 + t) * g_.N + k * G + gi) * H;
          const int64_t r = t * G + gi;
          float* dst = sc.q.data() + k * R * H;
          for (int64_t h = 0; h < H; ++h)  // wide: [H, R], transposed; else [rows_k, H]
            dst[wide ? h * R + r : r * H + h] = src[h] * scale_;
        }
    sc.s.assign((wide ? R : g_.K * rows_k) * kKeys, 0.0f);
    sc.visible.assign(R, 0);
    sc.alpha.assign(R, 1.0f);
    sc.spare.assign(kPvRows * H, 0.0f);
    sc.zeros.assign(kKeys, 0.0f);
    if constexpr (!std::is_same_v<T, float>) sc.vt.assign(kKeys * H, 0.0f);
    if constexpr (sizeof(T) == 1) sc.kt.assign(kLanes * g_.K * H, 0.0f);
    if (!wide) return;
    sc.token.resize(R);
    for (int64_t r = 0; r < R; ++r) sc.token[r] = float(std::min(r, rows_k - 1) / G);
    sc.wm.resize(R);
    sc.wl.resize(R);
    sc.mx.resize(R);
    sc.sum.resize(R);
  }

  // Requests the cache lines of one token row (all its heads' keys and values).
  void prefetch_token(const T* token) const {
    const char* bytes = reinterpret_cast<const char*>(token);
    for (int64_t b = 0; b < line_count(); ++b) __builtin_prefetch(bytes + b * 64);
  }
  // 64-byte cache lines that one token row spans.
  int64_t line_count() const { return (g_.token_stride() * int64_t(sizeof(T)) + 63) / 64; }

  // A decode's scores s[k * rows_k + i, j] = q_i . key_j of every kv head k (rows_k <
  // kWideRows rows each) against the tile's nk keys, kLanes keys' dots at a time. The keys are
  // taken token by token, every head's of one token row before the next row: a page's rows
  // are read front to back, as the hardware prefetcher follows them, and the rows of each
  // block of kLanes keys, kAhead keys on, are asked for as the block starts (`tokens` has
  // `have` >= nk rows, the next tile's after). Faster than every head's pass over the whole
  // tile, than asking for the next tile's rows evenly through the tile's work, and than asking
  // for every other line (docs/BENCHMARKS.md §4, "Why the kernel is as it is").
  void scores(Scratch& sc, int64_t rows_k, const T* const* tokens, int64_t nk,
              int64_t have) const {
    const int64_t H = g_.H;
    for (int64_t j0 = 0; j0 < nk; j0 += kLanes) {
      for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + kLanes, have); ++j)
        prefetch_token(tokens[j]);
      if constexpr (sizeof(T) == 1) {  // fp8: each key widened once for its G rows
        const float* keys[kLanes];
        widen_keys(sc, tokens + j0, std::min(kLanes, nk - j0), keys);
        for (int64_t k = 0; k < g_.K; ++k)
          for (int64_t i = k * rows_k; i < (k + 1) * rows_k; ++i)
            storev(sc.s.data() + i * kKeys + j0,
                   group_dots(sc.q.data() + i * H, keys, nk - j0, k * H));
      } else {  // float32 as it lies; bfloat16 widened per row (a shift)
        for (int64_t k = 0; k < g_.K; ++k)
          for (int64_t i = k * rows_k; i < (k + 1) * rows_k; ++i)
            storev(sc.s.data() + i * kKeys + j0,
                   group_dots(sc.q.data() + i * H, tokens + j0, nk - j0, 2 * k * H));
      }
    }
  }

  // The keys of every kv head of n <= kLanes token rows, widened into sc.kt ([kLanes, K, H]);
  // keys[j] points at token j's.
  void widen_keys(Scratch& sc, const T* const* tokens, int64_t n, const float** keys) const {
    const int64_t H = g_.H;
    for (int64_t j = 0; j < n; ++j) {
      float* dst = sc.kt.data() + j * g_.K * H;
      for (int64_t k = 0; k < g_.K; ++k) widen_row(tokens[j] + 2 * k * H, dst + k * H, H);
      keys[j] = dst;
    }
  }

  // A wide unit's transposed scores s[j, r] = q_r . key_j (kv head k's rows_k rows against
  // the tile's nk keys; row stride R): blocks of kWideKeys keys x kWideVectors vectors of rows
  // in registers, each key element broadcast against a vector of queries. Head 0's pass
  // requests each token row kAhead keys before it is read.
  void wide_scores(Scratch& sc, int64_t k, int64_t rows_k, const T* const* tokens, int64_t nk,
                   int64_t have) const {
    const int64_t H = g_.H, R = wide_rows(rows_k), key_slot = 2 * k * H;
    const float* qt = sc.q.data() + k * H * R;
    for (int64_t j0 = 0; j0 < nk; j0 += kWideKeys) {
      const int64_t nj = std::min(kWideKeys, nk - j0);
      if (k == 0)
        for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + nj, have); ++j)
          prefetch_token(tokens[j]);
      for (int64_t v0 = 0; v0 < R; v0 += kWideVectors * kLanes)
        score_keys(nj, std::min(kWideVectors, (R - v0) / kLanes), tokens + j0, key_slot,
                   qt + v0, R, H, sc.s.data() + j0 * R + v0);
    }
  }

  // score_block<J, V> for nj <= kWideKeys keys and nv <= kWideVectors vectors.
  template <int64_t J = kWideKeys>
  static void score_keys(int64_t nj, int64_t nv, const T* const* keys, int64_t slot,
                         const float* qt, int64_t R, int64_t H, float* s) {
    if constexpr (J > 0) {
      if (nj < J) return score_keys<J - 1>(nj, nv, keys, slot, qt, R, H, s);
      if constexpr (kWideVectors >= 4)
        if (nv == 4) return score_block<J, 4>(keys, slot, qt, R, H, s);
      if (nv == 3) return score_block<J, 3>(keys, slot, qt, R, H, s);
      if (nv == 2) return score_block<J, 2>(keys, slot, qt, R, H, s);
      return score_block<J, 1>(keys, slot, qt, R, H, s);
    }
  }

  // J keys x V vectors of rows: s[j, v] = sum_h key_j[h] * qt[h, v].
  template <int64_t J, int64_t V>
  static void score_block(const T* const* keys, int64_t slot, const float* qt, int64_t R,
                          int64_t H, float* s) {
    static_assert(V <= kWideVectors);
    fvec acc[J][V] = {};
    const T* key[J];
    for (int64_t j = 0; j < J; ++j) key[j] = keys[j] + slot;
    for (int64_t h = 0; h < H; ++h) {
      fvec q[V];
      for (int64_t c = 0; c < V; ++c) q[c] = loadv(qt + h * R + c * kLanes);
      for (int64_t j = 0; j < J; ++j) {
        const float b = widen(key[j][h]);  // broadcast by the vector product
        for (int64_t c = 0; c < V; ++c) acc[j][c] += b * q[c];
      }
    }
    for (int64_t j = 0; j < J; ++j)
      for (int64_t c = 0; c < V; ++c) storev(s + j * R + c * kLanes, acc[j][c]);
  }

  // The dots of query row qi with the keys of min(n, kLanes) token rows, as one vector (lane
  // j: key j; zero past n). Each key's products stay a vector of partial sums; the kLanes
  // vectors are then summed lane-wise by a halving tree (transpose_sum), which costs about
  // one shuffle-add per key where a horizontal sum per key costs a dozen scalar adds, most of
  // a decode whose pages sit in L2 (docs/BENCHMARKS.md §4, "Why the kernel is as it is").
  template <typename E>
  fvec group_dots(const float* qi, const E* const* tokens, int64_t n, int64_t slot) const {
    fvec part[kLanes];
    const int64_t H = g_.H, full = H / kLanes * kLanes;
    for (int64_t j = 0; j < kLanes; ++j) {
      fvec d = {};
      if (j < n) {
        const E* key = tokens[j] + slot;
        for (int64_t h = 0; h < full; h += kLanes) d += loadv(qi + h) * load_widened(key + h);
        for (int64_t h = full; h < H; ++h) d[0] += qi[h] * widen(key[h]);
      }
      part[j] = d;
    }
    return transpose_sum(part);
  }

  // One tile of kv head k: scores, the causal and context mask, the online softmax step, then
  // acc = alpha * acc + P.V.
  void tile(Scratch& sc, int64_t k, int64_t rows_k, const T* const* tokens, int64_t nk,
            int64_t key0, const Unit& u, const Request& rq, int64_t have) const {
    const int64_t H = g_.H, value_slot = (2 * k + 1) * H;
    const bool wide = is_wide(rows_k);
    if (wide) {  // a decode's are computed already
      wide_scores(sc, k, rows_k, tokens, nk, have);
      if (cap_ > 0.0f) soft_cap(sc.s.data(), nk * wide_rows(rows_k));
    }
    const float* vals[kKeys];  // value rows of the tile's keys (widened unless float32)
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t j = 0; j < nk; ++j) vals[j] = tokens[j] + value_slot;
    } else {
      for (int64_t j = 0; j < nk; ++j) {
        const T* v = tokens[j] + value_slot;
        float* dst = sc.vt.data() + j * H;
        widen_row(v, dst, H);
        vals[j] = dst;
      }
    }
    const int64_t offset = rq.ctx - rq.q_len + u.tok0 - key0;
    if (wide)
      wide_softmax(sc, k, rows_k, nk, offset);
    else
      softmax(sc, k * rows_k, rows_k, nk, offset);
    // Probability p[r][j * stride] of row r and key j: S^T's rows are keys (a wide unit's
    // padding rows, within R, stand in for missing ones), a decode's are query rows.
    const int64_t stride = wide ? wide_rows(rows_k) : 1;
    for (int64_t i = 0; i < rows_k; i += kPvRows) {  // kPvRows rows share each value load
      const float* p[kPvRows];  // probabilities (zeros past a row's visible keys)
      float* acc[kPvRows];
      float alpha[kPvRows];
      int64_t nj = 0;
      for (int64_t r = 0; r < kPvRows; ++r) {
        const bool live = i + r < rows_k;  // a missing row adds into a spare row
        p[r] = wide ? sc.s.data() + i + r
                    : live ? sc.s.data() + (k * rows_k + i + r) * kKeys : sc.zeros.data();
        acc[r] = live ? sc.acc.data() + (k * rows_k + i + r) * H : sc.spare.data() + r * H;
        alpha[r] = live ? sc.alpha[i + r] : 1.0f;
        nj = std::max(nj, live ? sc.visible[i + r] : 0);
      }
      if (nj == 0) continue;
      int64_t h0 = 0;
      for (; h0 + 4 * kLanes <= H; h0 += 4 * kLanes)
        pv_columns<4>(h0, nj, vals, p, stride, alpha, acc);
      for (; h0 + kLanes <= H; h0 += kLanes) pv_columns<1>(h0, nj, vals, p, stride, alpha, acc);
      for (; h0 < H; ++h0) {  // the last H % kLanes columns
        for (int64_t r = 0; r < kPvRows; ++r) {
          float x = acc[r][h0] * alpha[r];
          // Fused (one rounding a key, as pv_columns's sums are where the CPU has FMA):
          // compiled for either stride, the loop then rounds alike, so a decode's P.V and a
          // prefill chunk's agree bit for bit (their outputs, where their scores do).
          for (int64_t j = 0; j < nj; ++j) x = std::fma(p[r][j * stride], vals[j][h0], x);
          acc[r][h0] = x;
        }
      }
    }
  }

  // Columns [h0, h0 + kLanes C) of kPvRows rows: acc = alpha * acc + P.V over the tile's first
  // nj keys, with kPvRows * C accumulators in registers (independent FMA chains). Written
  // with vector types: left to itself, GCC vectorises the loop over keys instead, with
  // gathers through the row pointers, at half the speed (docs/BENCHMARKS.md §4).
  template <int C>
  static void pv_columns(int64_t h0, int64_t nj, const float* const* vals,
                         const float* const* p, int64_t stride, const float* alpha,
                         float* const* acc) {
    fvec r[kPvRows][C];
    for (int64_t i = 0; i < kPvRows; ++i)
      for (int c = 0; c < C; ++c) r[i][c] = loadv(acc[i] + h0 + c * kLanes) * alpha[i];
    for (int64_t j = 0; j < nj; ++j) {
      const float* v = vals[j] + h0;
      for (int c = 0; c < C; ++c) {
        const fvec vc = loadv(v + c * kLanes);
        for (int64_t i = 0; i < kPvRows; ++i) r[i][c] += p[i][j * stride] * vc;
      }
    }
    for (int64_t i = 0; i < kPvRows; ++i)
      for (int c = 0; c < C; ++c) storev(acc[i] + h0 + c * kLanes, r[i][c]);
  }

  // A decode's online softmax step (row-major scores): rows [row0, row0 + rows_k) (kv head
  // order) over a tile of nk keys, `offset` = (position of the unit's first token) -
  // (position of the tile's first key): turns their scores into probabilities (zero for
  // invisible keys) and leaves each row's visible-key count and rescale factor in `visible`
  // and `alpha`.
  void softmax(Scratch& sc, int64_t row0, int64_t rows_k, int64_t nk, int64_t offset) const {
    for (int64_t t = 0, i = 0; i < rows_k; ++t) {
      // Keys at positions <= the token's are visible (causal inside the chunk), from its
      // window's first on: keys [first, visible) of the tile.
      const int64_t visible = std::clamp<int64_t>(offset + t + 1, 0, nk);
      const int64_t first = window_ > 0 ? std::clamp<int64_t>(offset + t + 1 - window_, 0, nk)
                                        : 0;
      for (int64_t gi = 0; gi < g_.G; ++gi, ++i) {
        float* si = sc.s.data() + (row0 + i) * kKeys;
        sc.visible[i] = first < visible ? visible : 0;
        sc.alpha[i] = 1.0f;
        if (first >= visible) {  // nothing of this tile for this row
          std::fill(si, si + kKeys, 0.0f);
          continue;
        }
        const int64_t row = row0 + i;
        const float mx = std::max(sc.m[row], max_visible(si, first, visible));
#pragma omp simd
        for (int64_t j = 0; j < kKeys; ++j)
          si[j] = (j >= first) & (j < visible) ? fast_exp(si[j] - mx) : 0.0f;
        // In key order, as wide_softmax sums (its masked keys add exact zeros first): the two
        // paths agree bit for bit where their scores do.
        float sum = 0.0f;
        for (int64_t j = first; j < visible; ++j) sum += si[j];
        sc.alpha[i] = fast_exp(sc.m[row] - mx);  // ~0 (underflow) before any visible key
        sc.m[row] = mx;
        sc.l[row] = sc.l[row] * sc.alpha[i] + sum;
      }
    }
  }

  // softmax's step for a wide unit, on S^T: kv head k's rows_k rows over a tile of nk keys,
  // a vector of rows at a time down the keys. Row r (token t) sees key j when j <= offset + t
  // and, with a window W, offset + t - W < j.
  void wide_softmax(Scratch& sc, int64_t k, int64_t rows_k, int64_t nk, int64_t offset) const {
    const int64_t R = wide_rows(rows_k);
    float *m = sc.wm.data(), *l = sc.wl.data(), *mx = sc.mx.data(), *alpha = sc.alpha.data();
    const float* token = sc.token.data();
    std::copy_n(sc.m.data() + k * rows_k, rows_k, m);
    std::copy_n(sc.l.data() + k * rows_k, rows_k, l);
    std::fill(m + rows_k, m + R, kMasked);  // padding rows: scores of zero queries, unused
    std::fill(l + rows_k, l + R, 0.0f);
    std::copy_n(m, R, mx);
    // Unless every row sees every key of the tile: the first row key nk - 1, the last key 0.
    const int64_t last_token = (rows_k - 1) / g_.G;
    const bool masked = offset < nk - 1 || (window_ > 0 && offset + last_token >= window_);
    // Token t sees key j when lo(j) <= t < hi(j) (every token when the tile is not masked).
    const float span = window_ > 0 ? float(window_) : 1e30f;
    auto lo = [&](int64_t j) { return masked ? float(j - offset) : -1.0f; };
    auto hi = [&](int64_t j) { return masked ? float(j - offset) + span : 1e30f; };
    for (int64_t j = 0; j < nk; ++j) {
      const float first = lo(j), past = hi(j);
      const float* sj = sc.s.data() + j * R;
#pragma omp simd
      for (int64_t r = 0; r < R; ++r)
        if (token[r] >= first && token[r] < past) mx[r] = std::max(mx[r], sj[r]);
    }
    float* sum = sc.sum.data();  // each row's probabilities summed in key order
    std::fill(sum, sum + R, 0.0f);
    for (int64_t j = 0; j < nk; ++j) {
      const float first = lo(j), past = hi(j);
      float* sj = sc.s.data() + j * R;
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) {
        const float p = token[r] >= first && token[r] < past ? fast_exp(sj[r] - mx[r]) : 0.0f;
        sj[r] = p;
        sum[r] += p;
      }
    }
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) {
      alpha[r] = fast_exp(m[r] - mx[r]);  // 1 for a row that sees nothing yet (kMasked twice)
      l[r] = l[r] * alpha[r] + sum[r];
    }
    for (int64_t r = 0; r < rows_k; ++r)  // keys the tile shows each row, for P.V
      sc.visible[r] = std::clamp<int64_t>(offset + int64_t(token[r]) + 1, 0, nk);
    std::copy_n(mx, rows_k, sc.m.data() + k * rows_k);
    std::copy_n(l, rows_k, sc.l.data() + k * rows_k);
  }

  // The largest of s[first, visible): lane-wise over the tile's vectors, then across lanes.
  // (A plain max loop stays scalar: GCC does not vectorise a float max reduction by itself.)
  static float max_visible(const float* s, int64_t first, int64_t visible) {
    fvec best = loadv(s);
    for (int64_t c = 1; c < kKeys / kLanes; ++c) best = vmax(best, loadv(s + c * kLanes));
    if (first > 0 || visible < kKeys) {  // an invisible key's score may exceed every visible one's
      best = fvec{} + kMasked;
      for (int64_t j = first; j < visible; ++j) best[0] = std::max(best[0], s[j]);
    }
    float mx = best[0];
    for (int64_t c = 1; c < kLanes; ++c) mx = std::max(mx, best[c]);
    return mx;
  }

  const Geometry g_;
  const float* q_;
  const T* cache_;
  const float scale_;    // sm_scale * k_scale
  const float v_scale_;
  const int64_t window_;  // W, 0: full attention
  const float cap_;       // soft cap, 0: none
  const bool batch_invariant_;  // one path for every unit (see the file comment)
};

// The units of the live requests (see the file comment); split units get scratch slots. A
// batch-invariant plan splits nothing: a split merges partial softmax states, which rounds
// otherwise than one pass over the keys.
std::vector<Unit> plan(const std::vector<Request>& reqs, const Geometry& g, int64_t block_q,
                       int64_t pages_per_split, int64_t window, bool batch_invariant,
                       int64_t* num_slots) {
  std::vector<Unit> units;
  *num_slots = 0;
  auto pages_upto = [&](int64_t tokens) {
    return std::min<int64_t>((tokens + g.L - 1) / g.L, g.max_blocks);
  };
  for (int64_t r = 0; r < int64_t(reqs.size()); ++r) {
    const Request& rq = reqs[r];
    if (rq.q_len <= 0 || rq.ctx <= 0) continue;
    if (rq.q_len <= kSplitTokens) {  // from the page of the first key its first token sees
      const int64_t page0 = first_visible(rq.ctx - rq.q_len, window) / g.L;
      const int64_t pages = pages_upto(rq.ctx);
      const bool split = !batch_invariant && pages - page0 > pages_per_split;
      const int64_t run = split ? pages_per_split : std::max<int64_t>(pages - page0, 1);
      for (int64_t p = page0; p < pages; p += run) {
        const int64_t p1 = std::min(pages, p + run);
        units.push_back({r, 0, rq.q_len, p, p1, split, split ? (*num_slots)++ : 0,
                         rq.q_len * (p1 - p)});
      }
      continue;
    }
    for (int64_t t = 0; t < rq.q_len; t += block_q) {
      const int64_t t1 = std::min(rq.q_len, t + block_q);
      const int64_t pages = pages_upto(rq.ctx - rq.q_len + t1);
      const int64_t page0 = std::min(first_visible(rq.ctx - rq.q_len + t, window) / g.L, pages);
      units.push_back({r, t, t1, page0, pages, false, 0, (t1 - t) * (pages - page0)});
    }
  }
  return units;
}

// Run the planned units over a cache of element type T, then merge the split ones.
template <typename T>
void attend(ffi::ThreadPool& pool, const Geometry& g, const float* q, const void* cache,
            float sm_scale, float k_scale, float v_scale, int64_t window, float soft_cap,
            bool batch_invariant, const std::vector<Request>& reqs,
            const std::vector<Unit>& units, int64_t num_slots, float* o) {
  PagedAttention<T> attn(g, q, static_cast<const T*>(cache), sm_scale, k_scale, v_scale,
                         window, std::max(soft_cap, 0.0f), batch_invariant);
  const int64_t stride = attn.slot_rows();
  std::vector<float> m(num_slots * stride), l(num_slots * stride), acc(num_slots * stride * g.H);
  std::vector<int64_t> order(units.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return units[a].cost > units[b].cost; });
  parallel_for(pool, int64_t(units.size()), [&](int64_t i) {
    thread_local Scratch sc;
    const Unit& u = units[order[i]];
    attn.run(u, reqs[u.req], sc, o, m.data() + u.slot * stride, l.data() + u.slot * stride,
             acc.data() + u.slot * stride * g.H);
  });
  for (size_t i = 0; i < units.size();) {  // units of one request are consecutive
    size_t j = i + 1;
    while (j < units.size() && units[j].req == units[i].req && units[i].split) ++j;
    if (units[i].split)
      attn.merge(&units[i], int64_t(j - i), reqs[units[i].req], m.data(), l.data(),
                 acc.data(), o);
    i = j;
  }
}

ffi::Error ragged_paged_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> seq_lens,
                                ffi::Buffer<ffi::S32> query_start_loc,
                                ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::S32> sliding_window,
                                ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                float sm_scale, float soft_cap, int64_t block_q,
                                int64_t pages_per_split, bool batch_invariant,
                                std::string_view fp8_bits, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = kv_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || cd[2] % 2 || qd[2] != cd[3] ||
      qd[1] % (cd[2] / 2))
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: bad shapes");
  Geometry g{qd[0], qd[1], cd[2] / 2, qd[1] / (cd[2] / 2), qd[2], cd[0], cd[1], td[1]};
  const int32_t* qsl = query_start_loc.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  const int64_t R = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, td[0]);
  const int64_t window = std::max<int64_t>(sliding_window.typed_data()[0], 0);
  std::vector<Request> reqs(R);
  for (int64_t r = 0; r < R; ++r) {  // metadata is clamped so no read or write leaves bounds
    const int64_t start = std::clamp<int64_t>(qsl[r], 0, g.T);
    const int64_t end = std::clamp<int64_t>(qsl[r + 1], start, g.T);
    reqs[r] = {start, end - start, std::max<int64_t>(lens[r], 0),
               block_tables.typed_data() + r * g.max_blocks};
  }
  float* o = out->typed_data();
  std::fill(o, o + g.T * g.N * g.H, 0.0f);
  int64_t num_slots = 0;
  std::vector<Unit> units = plan(reqs, g, std::max<int64_t>(block_q, 1),
                                 std::max<int64_t>(pages_per_split, 1), window,
                                 batch_invariant, &num_slots);
  if (units.empty()) return ffi::Error::Success();
  const float ks = k_scale.typed_data()[0], vs = v_scale.typed_data()[0];
  const void* cache = kv_cache.untyped_data();
  auto run = [&](auto element) {
    attend<decltype(element)>(pool, g, q.typed_data(), cache, sm_scale, ks, vs, window,
                              soft_cap, batch_invariant, reqs, units, num_slots, o);
    return ffi::Error::Success();
  };
  ffi::DataType entries = kv_cache.element_type();
  if (entries == ffi::U8)  // fp8 stored as its bits
    entries = fp8_bits == "float8_e4m3fn" ? ffi::F8E4M3FN
              : fp8_bits == "float8_e5m2" ? ffi::F8E5M2
                                          : ffi::U8;
  switch (entries) {
    case ffi::F32: return run(float{});
    case ffi::BF16: return run(bf16{});
    case ffi::F8E4M3FN: return run(fp8_e4m3{});
    case ffi::F8E5M2: return run(fp8_e5m2{});
    default:
      return ffi::Error::InvalidArgument(
          "ragged_paged_attention_cpu: the cache must be float32, bfloat16, float8_e4m3fn or "
          "float8_e5m2, or uint8 with fp8_bits naming one of the fp8 formats");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttention, ragged_paged_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache, any cache dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding_window
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("pages_per_split")
                                  .Attr<bool>("batch_invariant")
                                  .Attr<std::string_view>("fp8_bits")  // "": not bits
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The vector path the library was compiled for (simd.h), for native.isa() and
// native.vector_lanes(): read from the binary, so it reports what runs, whatever was asked for.
extern "C" const char* JaxengineCpuIsa() { return jaxengine_cpu::kIsa; }
extern "C" int64_t JaxengineCpuLanes() { return jaxengine_cpu::kLanes; }
