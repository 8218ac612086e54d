// Paged decode attention: one query token per sequence, split-K ("flash decoding").
//
// Grid (num_kv_heads * head_tiles, num_seqs, num_splits), 128 threads (4 warps).
// A CTA takes one sequence, one KV head and up to 16 of the query heads that share it
// (GQA: each K/V tile is read once for all of them; they are the 16 rows of the mma), and
// one partition of the context: positions [split * partition, (split + 1) * partition).
// Within the CTA, each 64-key tile is split over the 4 warps, 16 keys each; every warp
// keeps its own online-softmax state and the warps are merged through shared memory at
// the end. With num_splits == 1 the CTA writes the output; otherwise it writes its
// unnormalised partial output, max and sum, and paged_decode_reduce merges the splits.
//
// Sequences whose query length is not 1 are skipped (the prefill kernel serves them), so
// one launch can cover the decode sequences of a mixed batch.
//
// A sliding window W narrows the context to its last W positions: the partitions then
// start at seq_len - W instead of 0 (the host plans the splits over min(context, W)), and
// no key outside the window is read. A soft-cap bends the scores (common.cuh, score2).
//
// Dynamic shared memory: DECODE_SMEM_BYTES(HEAD_DIM) = 2 stages x (K + V) x 64 keys, + Q.
#include "common.cuh"

#define DECODE_THREADS 128
#define DECODE_WARPS 4
#define DECODE_KEYS 64  // keys per CTA tile: DECODE_WARPS x 16
#define DECODE_ROWS 16  // query heads per CTA: one mma row tile

template <bool IS_BF16, int HEAD_DIM, int BLOCK_SIZE>
ACTORLLM_DEVICE void paged_decode(
    const unsigned short* __restrict__ q, i64 q_stride, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    int bt_stride, const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens_q,
    unsigned short* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ tmp_m,
    float* __restrict__ tmp_l, int num_heads, int num_kv_heads, int partition, int num_splits,
    float scale_log2, ScoreFeatures feat) {
  constexpr int CHUNKS = HEAD_DIM / 8;
  constexpr int TILE_BYTES = DECODE_KEYS * HEAD_DIM * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red_m[DECODE_WARPS][DECODE_ROWS];
  __shared__ float red_l[DECODE_WARPS][DECODE_ROWS];

  const int group = num_heads / num_kv_heads;
  const int head_tiles = (group + DECODE_ROWS - 1) / DECODE_ROWS;
  const int kv_head = blockIdx.x / head_tiles;
  const int head0 = kv_head * group + (blockIdx.x % head_tiles) * DECODE_ROWS;
  const int rows = min(DECODE_ROWS, kv_head * group + group - head0);  // live heads here
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int q_tok = cu_seqlens_q[seq];
  if (cu_seqlens_q[seq + 1] - q_tok != 1) return;
  const int seq_len = seq_lens[seq];
  const int lo = feat.window > 0 ? max(0, seq_len - feat.window) : 0;  // first visible key
  const int start = lo + split * partition;
  if (start >= seq_len) return;
  const int end = min(seq_len, start + partition);
  const int* block_table = block_tables + (i64)seq * bt_stride;

  // Shared memory: [K stage 0 | V stage 0 | K stage 1 | V stage 1 | Q (16 rows)].
  const u32 base = smem_u32(smem);
  const u32 q_base = base + 4 * TILE_BYTES;

  // Q rows past the live heads repeat the last live head: finite, and never written out.
#pragma unroll
  for (int i = 0; i < DECODE_ROWS * CHUNKS / DECODE_THREADS; ++i) {
    const int idx = threadIdx.x + i * DECODE_THREADS;
    const int r = idx / CHUNKS;
    const int c = idx % CHUNKS;
    const int head = head0 + min(r, rows - 1);
    cp_async_16(tile_addr<HEAD_DIM>(q_base, r, c),
                q + (i64)q_tok * q_stride + (i64)head * HEAD_DIM + c * 8, 16);
  }
  load_kv_tile<HEAD_DIM, BLOCK_SIZE, DECODE_KEYS, DECODE_THREADS>(base, k_cache, block_table,
                                                                   start, end, num_kv_heads,
                                                                   kv_head);
  load_kv_tile<HEAD_DIM, BLOCK_SIZE, DECODE_KEYS, DECODE_THREADS>(
      base + TILE_BYTES, v_cache, block_table, start, end, num_kv_heads, kv_head);
  cp_async_commit();

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int qpos[2] = {seq_len - 1, seq_len - 1};  // the one query is the last position
  const LaneOffsets<HEAD_DIM> off;
  WarpState<HEAD_DIM> st;
  st.init();
  // The window is the partition range itself: inside it every key is visible.
  const ScoreFeatures tile_feat = {0, feat.cap_in, feat.cap_out};

  const int num_tiles = (end - start + DECODE_KEYS - 1) / DECODE_KEYS;
  for (int i = 0; i < num_tiles; ++i) {
    const int pos0 = start + i * DECODE_KEYS;
    if (i + 1 < num_tiles) {  // prefetch the next tile into the other stage
      const u32 next = base + ((i + 1) & 1) * 2 * TILE_BYTES;
      load_kv_tile<HEAD_DIM, BLOCK_SIZE, DECODE_KEYS, DECODE_THREADS>(
          next, k_cache, block_table, pos0 + DECODE_KEYS, end, num_kv_heads, kv_head);
      load_kv_tile<HEAD_DIM, BLOCK_SIZE, DECODE_KEYS, DECODE_THREADS>(
          next + TILE_BYTES, v_cache, block_table, pos0 + DECODE_KEYS, end, num_kv_heads,
          kv_head);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile i (and Q) have landed...
    __syncthreads();     // ...and so have everyone else's

    const u32 k_base = base + (i & 1) * 2 * TILE_BYTES;
    const int kpos0 = pos0 + warp * 16;
    if (kpos0 + 16 <= end) {
      warp_attend<IS_BF16, HEAD_DIM, 16, false>(st, off, q_base, 0, k_base, k_base + TILE_BYTES,
                                                warp * 16, kpos0, qpos, scale_log2,
                                                tile_feat);
    } else if (kpos0 < end) {  // the sequence ends inside this warp's 16 keys
      warp_attend<IS_BF16, HEAD_DIM, 16, true>(st, off, q_base, 0, k_base, k_base + TILE_BYTES,
                                               warp * 16, kpos0, qpos, scale_log2,
                                               tile_feat);
    }
    __syncthreads();  // stage (i & 1) is free for the prefetch of tile i + 2
  }
  cp_async_wait<0>();

  // Merge the 4 warps. Their partial outputs overlay the (now idle) K/V stages:
  // DECODE_WARPS x 16 x HEAD_DIM floats = 256 * HEAD_DIM bytes <= 4 * TILE_BYTES.
  st.reduce_l();
  float* red_o = reinterpret_cast<float*>(smem);
  const int g = lane >> 2;
  const int c0 = 2 * (lane & 3);
  if ((lane & 3) == 0) {
    red_m[warp][g] = st.m[0];
    red_m[warp][g + 8] = st.m[1];
    red_l[warp][g] = st.l[0];
    red_l[warp][g + 8] = st.l[1];
  }
#pragma unroll
  for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
    float* row = red_o + (warp * DECODE_ROWS + g) * HEAD_DIM + dt * 8 + c0;
    row[0] = st.o[dt][0];
    row[1] = st.o[dt][1];
    row[8 * HEAD_DIM] = st.o[dt][2];
    row[8 * HEAD_DIM + 1] = st.o[dt][3];
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < rows * HEAD_DIM; idx += DECODE_THREADS) {
    const int r = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) m = fmaxf(m, red_m[w][r]);
    // Warp 0 always saw position `start`, so m is finite; idle warps have m = -inf and
    // weigh 0.
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) {
      const float f = fast_exp2(red_m[w][r] - m);
      acc += f * red_o[(w * DECODE_ROWS + r) * HEAD_DIM + d];
      l += f * red_l[w][r];
    }
    const int head = head0 + r;
    if (num_splits == 1) {
      out[((i64)q_tok * num_heads + head) * HEAD_DIM + d] = to_16bit<IS_BF16>(acc / l);
    } else {
      const i64 part = ((i64)seq * num_heads + head) * num_splits + split;
      tmp_out[part * HEAD_DIM + d] = acc;
      if (d == 0) {
        tmp_m[part] = m;
        tmp_l[part] = l;
      }
    }
  }
}

// Merge the splits of paged_decode: grid (num_heads, num_seqs), HEAD_DIM threads.
template <bool IS_BF16, int HEAD_DIM>
ACTORLLM_DEVICE void paged_decode_reduce(const float* __restrict__ tmp_out,
                                         const float* __restrict__ tmp_m,
                                         const float* __restrict__ tmp_l,
                                         const int* __restrict__ seq_lens,
                                         const int* __restrict__ cu_seqlens_q,
                                         unsigned short* __restrict__ out, int num_heads,
                                         int partition, int num_splits, int window) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int d = threadIdx.x;
  const int q_tok = cu_seqlens_q[seq];
  if (cu_seqlens_q[seq + 1] - q_tok != 1) return;
  const int seq_len = seq_lens[seq];
  const int span = window > 0 ? min(seq_len, window) : seq_len;  // the partitioned keys
  const int used = min(num_splits, (span + partition - 1) / partition);
  const i64 part0 = ((i64)seq * num_heads + head) * num_splits;
  float m = neg_inf();
  for (int s = 0; s < used; ++s) m = fmaxf(m, tmp_m[part0 + s]);
  float acc = 0.f, l = 0.f;
  for (int s = 0; s < used; ++s) {
    const float f = fast_exp2(tmp_m[part0 + s] - m);
    acc += f * tmp_out[(part0 + s) * HEAD_DIM + d];
    l += f * tmp_l[part0 + s];
  }
  out[((i64)q_tok * num_heads + head) * HEAD_DIM + d] = to_16bit<IS_BF16>(acc / l);
}

// ------------------------------------------------------------------ entry points
// paged_decode_{f16,bf16}_d{64,128,256}_b{16,32} and paged_decode_reduce_{f16,bf16}_d{...}.

#define ACTORLLM_DECODE(DT, IS_BF16, D, BS)                                                   \
  extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_decode_##DT##_d##D##_b##BS( \
      const unsigned short* q, i64 q_stride, const unsigned short* k_cache,                   \
      const unsigned short* v_cache, const int* block_tables, int bt_stride,                  \
      const int* seq_lens, const int* cu_seqlens_q, unsigned short* out, float* tmp_out,       \
      float* tmp_m, float* tmp_l, int num_heads, int num_kv_heads, int partition,             \
      int num_splits, float scale_log2, int window, float cap_in, float cap_out) {             \
    paged_decode<IS_BF16, D, BS>(q, q_stride, k_cache, v_cache, block_tables, bt_stride,      \
                                 seq_lens, cu_seqlens_q, out, tmp_out, tmp_m, tmp_l,          \
                                 num_heads, num_kv_heads, partition, num_splits, scale_log2,  \
                                 ScoreFeatures{window, cap_in, cap_out});                     \
  }

#define ACTORLLM_DECODE_REDUCE(DT, IS_BF16, D)                                                 \
  extern "C" __global__ void __launch_bounds__(D) paged_decode_reduce_##DT##_d##D(             \
      const float* tmp_out, const float* tmp_m, const float* tmp_l, const int* seq_lens,       \
      const int* cu_seqlens_q, unsigned short* out, int num_heads, int partition,              \
      int num_splits, int window) {                                                            \
    paged_decode_reduce<IS_BF16, D>(tmp_out, tmp_m, tmp_l, seq_lens, cu_seqlens_q, out,        \
                                    num_heads, partition, num_splits, window);                 \
  }

#define ACTORLLM_DECODE_DTYPE(DT, IS_BF16) \
  ACTORLLM_DECODE(DT, IS_BF16, 64, 16)     \
  ACTORLLM_DECODE(DT, IS_BF16, 64, 32)     \
  ACTORLLM_DECODE(DT, IS_BF16, 128, 16)    \
  ACTORLLM_DECODE(DT, IS_BF16, 128, 32)    \
  ACTORLLM_DECODE(DT, IS_BF16, 256, 16)    \
  ACTORLLM_DECODE(DT, IS_BF16, 256, 32)    \
  ACTORLLM_DECODE_REDUCE(DT, IS_BF16, 64)  \
  ACTORLLM_DECODE_REDUCE(DT, IS_BF16, 128) \
  ACTORLLM_DECODE_REDUCE(DT, IS_BF16, 256)

#ifdef ACTORLLM_ONE_CONFIG
ACTORLLM_EXPAND(ACTORLLM_DECODE, ACTORLLM_DT, ACTORLLM_IS_BF16, ACTORLLM_HEAD_DIM, ACTORLLM_BLOCK_SIZE)
ACTORLLM_EXPAND(ACTORLLM_DECODE_REDUCE, ACTORLLM_DT, ACTORLLM_IS_BF16, ACTORLLM_HEAD_DIM)
#else
ACTORLLM_DECODE_DTYPE(f16, false)
ACTORLLM_DECODE_DTYPE(bf16, true)
#endif
