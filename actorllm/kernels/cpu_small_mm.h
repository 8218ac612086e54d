// x @ w by the op's own AVX2 GEMM, for packed_linear in cpu_decode_step.cpp (included
// there, inside its anonymous namespace, after cpu_sample_rows.h, whose AVX2 target and
// lanes8 it uses): a few rows of an [in, out] weight (small_mm), and any rows of a weight
// laid out in panels (panel_mm). Taken where own_gemm() holds: a CPU without AVX-512, and
// an AVX-512 CPU that is not Intel's, on which MKL runs its generic kernels (a Zen 4 at
// stop 58: the LM heads 1.1-1.7x faster here at 8 to 240 rows; docs/architecture.md).
//
// Why: on a CPU without AVX-512 (an AMD EPYC, Zen 3) MKL's sgemm at 2-32 rows cost far
// more than the arithmetic: a whole decode step of the embedded model (the op, one
// thread, logits and greedy tokens) took 3.2 ms at 2 rows, 4.3 ms at 9 and 5.5 ms at 16
// against 1.3-1.5 ms at one row (MKL's gemv). Steps of a few rows are a lone row's verify
// step (a token and its drafts) and decode at low concurrency, so speculation paid much
// less there than on an AVX-512 host (issue 28, stop 50; docs/architecture.md "CPUs
// without AVX-512"). With this GEMM: 1.4, 2.5 and 3.6 ms; at 24 and 32 rows 15 % and 4 %
// less than MKL, at 48 and 64 the same (so 32 is the limit).
//
// y[m, n] = sum over k of x[m, k] * w[k, n], in the order k = 0, 1, ... with one FMA each,
// then + bias[n]: every element the same chain of operations whatever the row count, the
// tile or the thread, so a row's result does not depend on the rows beside it (and the
// LM head's blocks of rows give what one call on all of them gives). Tiles of up to 6
// rows by 16 columns (12 accumulators, two weight vectors and a broadcast). A tile's
// columns are one 64-byte line of each weight row (where N is a multiple of 16); the
// weight's [K, 16] slice is read from memory once for the first 6 rows and from L1 or L2
// for the next. Each weight row lies in another 4 KiB page (N >= 1024) or close to it, so
// the hardware prefetchers, which follow a stream within a page, did not help: the tile
// asks for the line two tiles on in each row it reads (kPrefetch), which took a 6-row step
// from 4.9 to 1.9 ms (one tile on: 2.2; four: 3.3). Tiles of 24 columns, whose lines the
// next tile shared, ran no faster than MKL.
#pragma once

// Columns of a panel, and of a tile (the layout's, so outside the AVX2 body: packed_linear
// checks a weight's panels against it on any build).
constexpr int64_t kPanel = 16;

#ifdef ACTORLLM_AVX2
constexpr int64_t kSmallRowsMin = 2, kSmallRowsMax = 32;
// Floats ahead in a weight row that a tile prefetches: two tiles of 16 columns.
constexpr int64_t kPrefetch = 32;
// Bytes of x a pass over the weight reads: rows past that take another pass (the weight
// again, from L3 or memory) rather than x from memory for every tile. At the shapes above
// the block's size moved nothing between 96 rows and all 2,048.
constexpr int64_t kRowBlockBytes = int64_t{1} << 20;

// A tile of R rows by V vectors of 8 columns: w is its first column at k = 0 and the
// next k is `ldw` floats on (the weight's width N in [in, out], kPanel in a panel).
template <int R, int V, bool TAIL, bool STRIDED>
ACTORLLM_AVX2 void mm_tile(const float* x, int64_t K, const float* w, int64_t ldw,
                           __m256i tail, const float* bias, float* y, int64_t ldy) {
  // The small loops are unrolled (the op is built at -O2, which keeps them, and the
  // accumulators then live on the stack, not in registers).
  __m256 acc[R][V];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* wk = w;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    // A panel is one stream, which the prefetchers follow; rows of [in, out] are not.
    if (STRIDED) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch), _MM_HINT_T0);
    __m256 wv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      wv[v] = TAIL && v == V - 1 ? _mm256_maskload_ps(wk + 8 * v, tail) : _mm256_loadu_ps(wk + 8 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      const bool last = TAIL && v == V - 1;
      __m256 out = acc[r][v];
      if (bias != nullptr)
        out = _mm256_add_ps(out, last ? _mm256_maskload_ps(bias + 8 * v, tail)
                                      : _mm256_loadu_ps(bias + 8 * v));
      if (last)
        _mm256_maskstore_ps(y + r * ldy + 8 * v, tail, out);
      else
        _mm256_storeu_ps(y + r * ldy + 8 * v, out);
    }
}

// R rows of the tile of `cols` (1 to 16) columns whose weight starts at w.
template <int R, bool STRIDED>
ACTORLLM_AVX2 void mm_rows(const float* x, int64_t K, const float* w, int64_t ldw,
                           int64_t cols, const float* bias, float* y, int64_t ldy) {
  const __m256i tail = lanes8(cols - 8 * ((cols - 1) / 8));
  const bool partial = cols % 8 != 0;
  if (cols > 8) {
    if (partial) mm_tile<R, 2, true, STRIDED>(x, K, w, ldw, tail, bias, y, ldy);
    else mm_tile<R, 2, false, STRIDED>(x, K, w, ldw, tail, bias, y, ldy);
  } else {
    if (partial) mm_tile<R, 1, true, STRIDED>(x, K, w, ldw, tail, bias, y, ldy);
    else mm_tile<R, 1, false, STRIDED>(x, K, w, ldw, tail, bias, y, ldy);
  }
}

// y [M, N] = x [M, K] @ the weight (+ bias [N]), all contiguous fp32: the weight [K, N]
// (STRIDED) or panels [N / 16, K, 16] (N a multiple of 16). Column tiles are split
// between the OpenMP team where the work is large enough to pay for its region; each
// thread goes over its tiles once per block of rows.
template <bool STRIDED>
ACTORLLM_AVX2 void tiled_mm(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                            const float* bias, float* y) {
  const int64_t tiles = (N + kPanel - 1) / kPanel;
  const int64_t block = std::max<int64_t>(6, kRowBlockBytes / (4 * std::max<int64_t>(1, K)));
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K * std::min(M, block)));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t b0 = 0; b0 < M; b0 += block) {
      const int64_t b1 = std::min(M, b0 + block);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = kPanel * t, cols = std::min<int64_t>(kPanel, N - n0);
        const float* wt = STRIDED ? w + n0 : w + t * kPanel * K;
        const int64_t ldw = STRIDED ? N : kPanel;
        const float* b = bias != nullptr ? bias + n0 : nullptr;
        for (int64_t m0 = b0; m0 < b1; m0 += 6) {
          const float* xr = x + m0 * K;
          float* yr = y + m0 * N + n0;
          switch (std::min<int64_t>(6, b1 - m0)) {
            case 1: mm_rows<1, STRIDED>(xr, K, wt, ldw, cols, b, yr, N); break;
            case 2: mm_rows<2, STRIDED>(xr, K, wt, ldw, cols, b, yr, N); break;
            case 3: mm_rows<3, STRIDED>(xr, K, wt, ldw, cols, b, yr, N); break;
            case 4: mm_rows<4, STRIDED>(xr, K, wt, ldw, cols, b, yr, N); break;
            case 5: mm_rows<5, STRIDED>(xr, K, wt, ldw, cols, b, yr, N); break;
            default: mm_rows<6, STRIDED>(xr, K, wt, ldw, cols, b, yr, N); break;
          }
        }
      }
    }
  });
}

// y = x @ w (+ bias), w [K, N], M in [kSmallRowsMin, kSmallRowsMax].
ACTORLLM_AVX2 void small_mm(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                            const float* bias, float* y) {
  tiled_mm<true>(x, M, K, w, N, bias, y);
}

// y = x @ the weight in panels p [N / 16, K, 16] (+ bias), any M.
ACTORLLM_AVX2 void panel_mm(const float* x, int64_t M, int64_t K, const float* p, int64_t N,
                            const float* bias, float* y) {
  tiled_mm<false>(x, M, K, p, N, bias, y);
}
#endif
