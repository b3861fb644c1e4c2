// The CPU attention kernel's units on one thread, without JAX: steadier timings than a whole
// step while tuning jaxengine_kernels/cpu/ragged_paged_attention.cc (docs/BENCHMARKS.md §4).
//
//   g++ -O3 -march=native -std=c++17 -fopenmp-simd -fno-math-errno -fno-trapping-math \
//       -w -I"$(.venv/bin/python -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
//       benchmarks/cpu_kernel_units.cc -o /tmp/cpu_kernel_units
//   /tmp/cpu_kernel_units chunk|prefills|decodes|long-decodes [block_q] [passes] [invariant]
//                         [window] [soft_cap] [f32|bf16|e4m3|e5m2]
//
// SmolLM2's heads (9 query, 3 KV, head dim 64), float32, 16-token pages shuffled over a pool;
// `chunk`: 768 tokens after 512 cached, `prefills`: 1280 + 256, `decodes`: 64 at context 300
// (29.5 MB of KV: it stays in a 32 MB L3 between passes), `long-decodes`: 64 at context 1500
// (147 MB: read from memory every pass, as the engine's 1 GiB pool is).
// `invariant` 1: the kernel's batch-invariant mode (every unit transposed, none split);
// `window` a sliding window (0: full attention), `soft_cap` a soft cap (0: none); the last,
// the cache's dtype (float32 by default; the same values rounded to bfloat16 or fp8).
// Prints the best of `passes` (200) passes over every unit, and a checksum to compare builds by.
#include "../jaxengine_kernels/cpu/ragged_paged_attention.cc"

#include <chrono>
#include <cstdio>
#include <type_traits>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "chunk";
  const int64_t block_q = argc > 2 ? std::atoi(argv[2]) : 32;
  const int passes = argc > 3 ? std::atoi(argv[3]) : 200;
  const bool invariant = argc > 4 && std::atoi(argv[4]) != 0;
  const int64_t window = argc > 5 ? std::atoi(argv[5]) : 0;
  const float soft_cap = argc > 6 ? std::atof(argv[6]) : 0.0f;
  const std::string dtype = argc > 7 ? argv[7] : "f32";
  const int64_t N = 9, K = 3, H = 64, L = 16, max_blocks = 512;
  const int64_t P = mode == "long-decodes" ? 8000 : 3000;  // pages in the pool
  std::vector<std::pair<int64_t, int64_t>> shape;  // (tokens this step, context after it)
  if (mode == "chunk") shape = {{768, 1280}};
  else if (mode == "prefills") shape = {{1280, 1280}, {256, 256}};
  else if (mode == "long-decodes") shape.assign(64, {1, 1500});
  else shape.assign(64, {1, 300});
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> uniform(-1, 1);
  int64_t T = 0;
  for (auto& [q, ctx] : shape) T += q;
  std::vector<float> cache(P * L * 2 * K * H), q(T * N * H), out(T * N * H);
  for (auto& x : cache) x = uniform(rng);
  for (auto& x : q) x = uniform(rng);
  std::vector<int32_t> pages(P), tables(shape.size() * max_blocks);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<Request> reqs;
  int64_t used = 0, start = 0;
  double flops = 0;
  for (size_t r = 0; r < shape.size(); ++r) {
    const auto [len, ctx] = shape[r];
    for (int64_t p = 0; p < (ctx + L - 1) / L; ++p) tables[r * max_blocks + p] = pages[used++];
    reqs.push_back({start, len, ctx, tables.data() + r * max_blocks});
    for (int64_t t = 0; t < len; ++t) flops += 4.0 * N * H * (ctx - len + t + 1);
    start += len;
  }
  const Geometry g{T, N, K, N / K, H, P, L, max_blocks};
  int64_t slots = 0;
  const std::vector<Unit> units = plan(reqs, g, block_q, 32, window, invariant, &slots);
  // The cache's values in `dtype`: bfloat16 truncated, fp8 the nearest value of the format
  // (looked up for [-1, 1] in steps of 1e-3).
  auto nearest = [](const Fp8Table& table, float x) {
    uint8_t best = 0;
    for (int b = 0; b < 256; ++b)
      if (std::abs(table.value[b] - x) < std::abs(table.value[best] - x)) best = uint8_t(b);
    return best;
  };
  auto run = [&](const auto* data) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(data)>>;
    PagedAttention<T> attn(g, q.data(), data, 0.125f, 1.0f, 1.0f, window, soft_cap, invariant);
    const int64_t stride = attn.slot_rows();
    std::vector<float> m(slots * stride), l(slots * stride), acc(slots * stride * H);
    Scratch sc;
    double best = 1e9;
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const Unit& u : units)
        attn.run(u, reqs[u.req], sc, out.data(), m.data() + u.slot * stride,
                 l.data() + u.slot * stride, acc.data() + u.slot * stride * H);
      for (size_t i = 0; i < units.size();) {  // split requests' states merged, as the kernel does
        size_t j = i + 1;
        while (j < units.size() && units[j].req == units[i].req && units[i].split) ++j;
        if (units[i].split)
          attn.merge(&units[i], int64_t(j - i), reqs[units[i].req], m.data(), l.data(),
                     acc.data(), out.data());
        i = j;
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                                .count());
    }
    return best;
  };
  double best = 0;
  if (dtype == "bf16") {
    std::vector<bf16> c(cache.size());
    for (size_t i = 0; i < c.size(); ++i)
      std::memcpy(&c[i], reinterpret_cast<char*>(&cache[i]) + 2, 2);  // the upper half
    best = run(c.data());
  } else if (dtype == "e4m3" || dtype == "e5m2") {
    const Fp8Table& table = dtype == "e4m3" ? kE4M3 : kE5M2;
    uint8_t lut[2001];
    for (int i = 0; i <= 2000; ++i) lut[i] = nearest(table, (i - 1000) * 1e-3f);
    std::vector<fp8_e4m3> c(cache.size());
    for (size_t i = 0; i < c.size(); ++i) c[i].bits = lut[int(std::lround((cache[i] + 1) * 1000))];
    if (dtype == "e4m3") best = run(c.data());
    else best = run(reinterpret_cast<const fp8_e5m2*>(c.data()));
  } else {
    best = run(cache.data());
  }
  std::printf("%s block_q=%ld units=%zu: %.3f ms, %.1f GFLOP/s, checksum %.6f\n", mode.c_str(),
              long(block_q), units.size(), best * 1e3, flops / best / 1e9,
              double(out[5] + out[T * N * H / 2]));
}
