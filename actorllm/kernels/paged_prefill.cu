// Paged prefill attention: packed variable-length query chunks over a cached prefix.
//
// Grid (row_tiles, num_kv_heads, num_seqs), 128 threads (4 warps x 16 query rows).
// The query rows of one sequence and one KV head are its (token, head-of-the-group) pairs,
// flattened token-major: row = token * group + g. A CTA takes 64 consecutive rows, so every
// K/V tile it loads serves all the query heads that share the KV head (GQA), and walks the
// keys [0, last query position] in tiles of PREFILL_KEYS: cp.async double buffering,
// ldmatrix + mma.sync m16n8k16 with fp32 accumulators, online softmax in fp32 (base 2).
// Query token i of a sequence sits at position seq_len - q_len + i and sees keys at
// positions <= its own; only tiles that reach past a warp's first query position are
// masked. Row tiles run heaviest-first (most keys) to shorten the tail.
//
// A sliding window W: query position p sees keys in (p - W, p]. The CTA starts its walk at
// the first key its first row can see, a warp skips tiles wholly before its rows' windows,
// and tiles that straddle a window's edge are masked like the diagonal ones. A soft-cap
// bends the scores (common.cuh, score2).
//
// Sequences with one query token are left to paged_decode (split-K serves them better).
//
// Dynamic shared memory: Q (64 rows) + 2 stages x (K + V) x PREFILL_KEYS rows, all
// HEAD_DIM wide: see prefill_smem_bytes in actorllm/ops/cuda_backend.py.
#include "common.cuh"

#define PREFILL_THREADS 128
#define PREFILL_ROWS 64  // query rows per CTA: 4 warps x 16

template <int HEAD_DIM>
struct PrefillKeys {
  // 64 keys per tile, 32 at head_dim 256 to keep the fp32 output (128 registers a thread
  // there) and the scores within the register file.
  static constexpr int value = HEAD_DIM == 256 ? 32 : 64;
};

template <bool IS_BF16, int HEAD_DIM, int BLOCK_SIZE>
ACTORLLM_DEVICE void paged_prefill(const unsigned short* __restrict__ q, i64 q_stride,
                                   const unsigned short* __restrict__ k_cache,
                                   const unsigned short* __restrict__ v_cache,
                                   const int* __restrict__ block_tables, int bt_stride,
                                   const int* __restrict__ seq_lens,
                                   const int* __restrict__ cu_seqlens_q,
                                   unsigned short* __restrict__ out, int num_heads,
                                   int num_kv_heads, float scale_log2, ScoreFeatures feat) {
  constexpr int KEYS = PrefillKeys<HEAD_DIM>::value;
  constexpr int CHUNKS = HEAD_DIM / 8;
  constexpr int TILE_BYTES = KEYS * HEAD_DIM * 2;
  extern __shared__ __align__(128) unsigned char smem[];

  const int group = num_heads / num_kv_heads;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int q_start = cu_seqlens_q[seq];
  const int q_len = cu_seqlens_q[seq + 1] - q_start;
  if (q_len <= 1) return;
  const int rows_total = q_len * group;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * PREFILL_ROWS;
  if (row0 >= rows_total) return;
  const int last_row = min(row0 + PREFILL_ROWS, rows_total) - 1;
  const int prefix = seq_lens[seq] - q_len;  // cached positions before this chunk
  const int kv_end = prefix + last_row / group + 1;
  // The first key the CTA's first row sees; later rows' windows start later still.
  const int kv_start = feat.window > 0 ? max(0, prefix + row0 / group - feat.window + 1) : 0;
  const int* block_table = block_tables + (i64)seq * bt_stride;

  // Shared memory: [Q | K stage 0 | V stage 0 | K stage 1 | V stage 1].
  const u32 q_base = smem_u32(smem);
  const u32 kv_base = q_base + PREFILL_ROWS * HEAD_DIM * 2;

  // Rows past the end repeat the last real row: finite, and never written out.
#pragma unroll
  for (int i = 0; i < PREFILL_ROWS * CHUNKS / PREFILL_THREADS; ++i) {
    const int idx = threadIdx.x + i * PREFILL_THREADS;
    const int r = idx / CHUNKS;
    const int c = idx % CHUNKS;
    const int row = min(row0 + r, last_row);
    const int head = kv_head * group + row % group;
    cp_async_16(tile_addr<HEAD_DIM>(q_base, r, c),
                q + (i64)(q_start + row / group) * q_stride + (i64)head * HEAD_DIM + c * 8, 16);
  }
  load_kv_tile<HEAD_DIM, BLOCK_SIZE, KEYS, PREFILL_THREADS>(kv_base, k_cache, block_table,
                                                            kv_start, kv_end, num_kv_heads,
                                                            kv_head);
  load_kv_tile<HEAD_DIM, BLOCK_SIZE, KEYS, PREFILL_THREADS>(
      kv_base + TILE_BYTES, v_cache, block_table, kv_start, kv_end, num_kv_heads, kv_head);
  cp_async_commit();

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int wrow0 = row0 + warp * PREFILL_ROWS / 4;  // this warp's first row
  // Rows are token-major, so positions grow with the row: the warp's first and last rows
  // bound the positions of all 16.
  const int qpos[2] = {prefix + min(wrow0 + g, last_row) / group,
                       prefix + min(wrow0 + g + 8, last_row) / group};
  const int warp_first = prefix + min(wrow0, last_row) / group;
  const int warp_last = prefix + min(wrow0 + 15, last_row) / group;
  const LaneOffsets<HEAD_DIM> off;
  WarpState<HEAD_DIM> st;
  st.init();

  // Under a window, keys at or below these positions are outside every row of the warp
  // (first) or outside some row's (last); without one, both are below every key.
  const int warp_lo_first = feat.window > 0 ? warp_first - feat.window : -1;
  const int warp_lo_last = feat.window > 0 ? warp_last - feat.window : -1;
  const int num_tiles = (kv_end - kv_start + KEYS - 1) / KEYS;
  for (int i = 0; i < num_tiles; ++i) {
    const int pos0 = kv_start + i * KEYS;
    if (i + 1 < num_tiles) {  // prefetch the next tile into the other stage
      const u32 next = kv_base + ((i + 1) & 1) * 2 * TILE_BYTES;
      load_kv_tile<HEAD_DIM, BLOCK_SIZE, KEYS, PREFILL_THREADS>(
          next, k_cache, block_table, pos0 + KEYS, kv_end, num_kv_heads, kv_head);
      load_kv_tile<HEAD_DIM, BLOCK_SIZE, KEYS, PREFILL_THREADS>(
          next + TILE_BYTES, v_cache, block_table, pos0 + KEYS, kv_end, num_kv_heads, kv_head);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile i (and Q) have landed...
    __syncthreads();     // ...and so have everyone else's

    const u32 k_base = kv_base + (i & 1) * 2 * TILE_BYTES;
    if (pos0 + KEYS - 1 <= warp_lo_first) {
      // wholly before every row's window: skipped
    } else if (pos0 + KEYS - 1 <= warp_first && pos0 > warp_lo_last) {
      // every key visible to every row of the warp
      warp_attend<IS_BF16, HEAD_DIM, KEYS, false>(st, off, q_base, warp * 16, k_base,
                                                  k_base + TILE_BYTES, 0, pos0, qpos, scale_log2,
                                                  feat);
    } else if (pos0 <= warp_last) {  // on the diagonal or a window's edge; past it: skipped
      warp_attend<IS_BF16, HEAD_DIM, KEYS, true>(st, off, q_base, warp * 16, k_base,
                                                 k_base + TILE_BYTES, 0, pos0, qpos, scale_log2,
                                                 feat);
    }
    __syncthreads();  // stage (i & 1) is free for the prefetch of tile i + 2
  }
  cp_async_wait<0>();

  // Every real row saw its own position (key 0 without a window), so l > 0.
  st.reduce_l();
  const int c0 = 2 * (lane & 3);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wrow0 + g + 8 * r;
    if (row > last_row) continue;
    const float inv = 1.f / st.l[r];
    u32* dst = reinterpret_cast<u32*>(
        out + ((i64)(q_start + row / group) * num_heads + kv_head * group + row % group) * HEAD_DIM +
        c0);
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
      dst[dt * 4] = pack2<IS_BF16>(st.o[dt][2 * r] * inv, st.o[dt][2 * r + 1] * inv);
    }
  }
}

// ------------------------------------------------------------------ entry points
// paged_prefill_{f16,bf16}_d{64,128,256}_b{16,32}.

#define ACTORLLM_PREFILL(DT, IS_BF16, D, BS)                                                   \
  extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, 2)                             \
      paged_prefill_##DT##_d##D##_b##BS(                                                       \
          const unsigned short* q, i64 q_stride, const unsigned short* k_cache,                \
          const unsigned short* v_cache, const int* block_tables, int bt_stride,               \
          const int* seq_lens, const int* cu_seqlens_q, unsigned short* out, int num_heads,    \
          int num_kv_heads, float scale_log2, int window, float cap_in, float cap_out) {       \
    paged_prefill<IS_BF16, D, BS>(q, q_stride, k_cache, v_cache, block_tables, bt_stride,      \
                                  seq_lens, cu_seqlens_q, out, num_heads, num_kv_heads,        \
                                  scale_log2, ScoreFeatures{window, cap_in, cap_out});         \
  }

#define ACTORLLM_PREFILL_DTYPE(DT, IS_BF16) \
  ACTORLLM_PREFILL(DT, IS_BF16, 64, 16)     \
  ACTORLLM_PREFILL(DT, IS_BF16, 64, 32)     \
  ACTORLLM_PREFILL(DT, IS_BF16, 128, 16)    \
  ACTORLLM_PREFILL(DT, IS_BF16, 128, 32)    \
  ACTORLLM_PREFILL(DT, IS_BF16, 256, 16)    \
  ACTORLLM_PREFILL(DT, IS_BF16, 256, 32)

#ifdef ACTORLLM_ONE_CONFIG
ACTORLLM_EXPAND(ACTORLLM_PREFILL, ACTORLLM_DT, ACTORLLM_IS_BF16, ACTORLLM_HEAD_DIM, ACTORLLM_BLOCK_SIZE)
#else
ACTORLLM_PREFILL_DTYPE(f16, false)
ACTORLLM_PREFILL_DTYPE(bf16, true)
#endif
