// Device helpers shared by the paged-attention kernels (DESIGN.md section 5).
//
// Compiled by NVRTC at run time (actorllm/ops/cuda_backend.py pastes this file in place
// of its #include, so CuPy's source-keyed disk cache sees every change) and by nvcc in
// tests/test_kernels_compile.py. It therefore includes no header at all: 16-bit floats are
// carried as raw `unsigned short` / packed `u32` bits and converted with PTX, and
// tensor-core work goes through inline PTX (ldmatrix, mma.sync, cp.async). Everything here
// needs sm_80 or newer (bf16 mma, cp.async, cvt.rn.bf16x2).
//
// Layout contract (all element offsets, 16-bit elements):
//   cache [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]: slot s = block * BLOCK_SIZE + off,
//         kv head h, dim d  ->  (s * num_kv_heads + h) * HEAD_DIM + d
//   q / out [tokens, num_heads, HEAD_DIM] with a token stride; heads x dims dense.
#pragma once

typedef unsigned int u32;
typedef long long i64;

#define ACTORLLM_DEVICE __device__ __forceinline__

// Expand the arguments (e.g. ACTORLLM_DT below) before M pastes them into a kernel name.
#define ACTORLLM_EXPAND(M, ...) M(__VA_ARGS__)

// The run-time loader compiles one configuration per module by defining
// ACTORLLM_ONE_CONFIG, ACTORLLM_DT (f16|bf16), ACTORLLM_IS_BF16 (false|true),
// ACTORLLM_HEAD_DIM and ACTORLLM_BLOCK_SIZE; without it every configuration is built.

// NVRTC has no math.h, so no INFINITY: build -inf from its bits.
ACTORLLM_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// 2^x with the SFU (the softmax below works in base 2; -inf -> +0).
ACTORLLM_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x with the SFU (+inf -> +0).
ACTORLLM_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------ 16-bit conversions
// IS_BF16 selects bfloat16, else IEEE half. Packing puts `lo` in the low 16 bits, which is
// the element with the lower index in memory and in mma fragments.

template <bool IS_BF16>
ACTORLLM_DEVICE u32 pack2(float lo, float hi) {
  u32 r;
  if (IS_BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

template <bool IS_BF16>
ACTORLLM_DEVICE unsigned short to_16bit(float x) {
  unsigned short r;
  if (IS_BF16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  }
  return r;
}

// ------------------------------------------------------------------ PTX wrappers

ACTORLLM_DEVICE u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte global->shared copy; src_bytes == 0 writes zeros and reads nothing.
ACTORLLM_DEVICE void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
ACTORLLM_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
ACTORLLM_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l/8, row l%8. Thread t
// receives row t/4, columns 2*(t%4) and 2*(t%4)+1 of each matrix (of its transpose with
// .trans).
ACTORLLM_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
ACTORLLM_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A * B for one m16n8k16 tile, fp32 accumulators.
template <bool IS_BF16>
ACTORLLM_DEVICE void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if (IS_BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ------------------------------------------------------------------ shared-memory tiles
// A tile is ROWS rows of HEAD_DIM 16-bit elements, i.e. HEAD_DIM / 8 chunks of 16 bytes.
// Chunk c of row r is stored at chunk position c ^ (r % 8): the 8 rows an ldmatrix reads
// at one logical chunk then hit 8 different bank groups (HEAD_DIM >= 64 keeps the XOR
// inside the row).

template <int HEAD_DIM>
ACTORLLM_DEVICE u32 tile_addr(u32 base, int row, int chunk) {
  return base + row * (HEAD_DIM * 2) + ((chunk ^ (row & 7)) << 4);
}

// Copy TOKENS consecutive positions [pos0, pos0 + TOKENS) of one kv head from the paged
// cache into a swizzled tile; positions >= end are zero-filled (never read), so neither a
// garbage block-table entry nor uninitialised cache memory can reach the math.
template <int HEAD_DIM, int BLOCK_SIZE, int TOKENS, int THREADS>
ACTORLLM_DEVICE void load_kv_tile(u32 dst, const unsigned short* __restrict__ cache,
                                  const int* __restrict__ block_table, int pos0, int end,
                                  int num_kv_heads, int kv_head) {
  constexpr int CHUNKS = HEAD_DIM / 8;
  static_assert((TOKENS * CHUNKS) % THREADS == 0, "tile must split evenly over threads");
#pragma unroll
  for (int i = 0; i < TOKENS * CHUNKS / THREADS; ++i) {
    const int idx = threadIdx.x + i * THREADS;
    const int t = idx / CHUNKS;
    const int c = idx % CHUNKS;
    const int pos = pos0 + t;
    const unsigned short* src = cache;
    int bytes = 0;
    if (pos < end) {
      const i64 block = block_table[pos / BLOCK_SIZE];
      const i64 slot = block * BLOCK_SIZE + pos % BLOCK_SIZE;
      src = cache + (slot * num_kv_heads + kv_head) * HEAD_DIM + c * 8;
      bytes = 16;
    }
    cp_async_16(tile_addr<HEAD_DIM>(dst, t, c), src, bytes);
  }
}

// ------------------------------------------------------------------ one warp's attention step
// Online-softmax state of one warp: 16 query rows x HEAD_DIM. Thread t owns rows t/4 and
// t/4 + 8 (index 0 and 1) and, of each 8-wide column tile, columns 2*(t%4) and 2*(t%4)+1.
// Scores are kept in base 2: s2 = q.k * scale * log2(e).
template <int HEAD_DIM>
struct WarpState {
  float o[HEAD_DIM / 8][4];  // unnormalised output, mma C layout
  float m[2];                // running max of s2 per row
  float l[2];                // running sum of 2^(s2 - m), this thread's columns only

  ACTORLLM_DEVICE void init() {
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) o[i][j] = 0.f;
    }
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
  }

  // Sum l over the 4 threads sharing each row (call once, after the last step).
  ACTORLLM_DEVICE void reduce_l() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
  }
};

// Byte offsets, within a swizzled tile, of the rows this lane hands to ldmatrix_x4.
// Every ldmatrix below reads rows r0 + 16*n + {0..15} with r0 a multiple of 16, so the
// lane's row is known up to a multiple of 16 and (row & 7) == lane & 7; logical chunk
// 8*hi + lo (lo < 8) then lives at byte hi * 128 + (lo ^ (lane & 7)) * 16. Four offsets per
// lane (lo = 2*kl + {0,1}) cover any chunk with an immediate added, which keeps the
// addresses of a fully unrolled step out of the register file.
template <int HEAD_DIM>
struct LaneOffsets {
  u32 row_lo[4];   // matrices ordered (rows 0-7 | rows 8-15) x (chunk lo | chunk lo + 1)
  u32 chunk_lo[4]; // matrices ordered (chunk lo | chunk lo + 1) x (rows 0-7 | rows 8-15)

  ACTORLLM_DEVICE LaneOffsets() {
    const int lane = threadIdx.x & 31;
    const int mat = lane >> 3;  // which of the four 8x8 matrices this lane addresses
    const int mrow = lane & 7;  // which row of it
#pragma unroll
    for (int kl = 0; kl < 4; ++kl) {
      row_lo[kl] = ((mat & 1) * 8 + mrow) * (HEAD_DIM * 2) + (((2 * kl + (mat >> 1)) ^ mrow) << 4);
      chunk_lo[kl] = ((mat >> 1) * 8 + mrow) * (HEAD_DIM * 2) + (((2 * kl + (mat & 1)) ^ mrow) << 4);
    }
  }
  // Address of the x4 load at tile rows [row0, row0 + 16), chunks [2 * step, 2 * step + 2).
  ACTORLLM_DEVICE u32 rows_first(u32 base, int row0, int step) const {
    return base + row0 * (HEAD_DIM * 2) + row_lo[step & 3] + (step >> 2) * 128;
  }
  ACTORLLM_DEVICE u32 chunks_first(u32 base, int row0, int step) const {
    return base + row0 * (HEAD_DIM * 2) + chunk_lo[step & 3] + (step >> 2) * 128;
  }
};

// The two optional score features of an attention call, as transformers' eager attention
// defines them (the torch reference in actorllm/ops/torch_backend.py is the oracle):
//  * a sliding window W: the query at position p sees keys at positions > p - W only;
//  * a soft-cap c: a scaled score s becomes c * tanh(s / c) before the mask and softmax.
// Scores stay in base 2 here, so the cap is applied to s2 = s * log2(e) as
// cap_out * tanh(s2_raw * cap_in / 2) with tanh(y) = 1 - 2 / (e^(2y) + 1), all in ex2:
// cap_in = 2 * log2(e) * scale / c and cap_out = c * log2(e) (cap_in == 0: no cap).
struct ScoreFeatures {
  int window;    // 0: none
  float cap_in;  // 0: no soft-cap
  float cap_out;
};

// The base-2 score of a raw dot product q.k.
ACTORLLM_DEVICE float score2(float dot, float scale_log2, const ScoreFeatures& f) {
  if (f.cap_in == 0.f) return dot * scale_log2;
  // e = 2^(2 * (s / c) * log2 e) = e^(2 s / c); +inf for large s gives tanh = 1, 0 gives -1.
  const float e = fast_exp2(dot * f.cap_in);
  return f.cap_out * (1.f - 2.f * fast_rcp(e + 1.f));
}

// Attend the warp's 16 query rows (tile rows q_row0..q_row0+15 of the Q tile at q_base) to
// KEYS keys, tile rows k_row0.. of the K and V tiles. Key j sits at absolute position
// kpos0 + j; with MASK, a key is dropped for row r when its position exceeds qpos[r] or,
// under a sliding window, is not above qpos[r] - window.
// q_row0 and k_row0 must be multiples of 16.
template <bool IS_BF16, int HEAD_DIM, int KEYS, bool MASK>
ACTORLLM_DEVICE void warp_attend(WarpState<HEAD_DIM>& st, const LaneOffsets<HEAD_DIM>& off,
                                 u32 q_base, int q_row0, u32 k_base, u32 v_base, int k_row0,
                                 int kpos0, const int (&qpos)[2], float scale_log2,
                                 const ScoreFeatures& feat) {
  static_assert(KEYS % 16 == 0, "keys come in k16 steps");
  const int lane = threadIdx.x & 31;

  // S = Q K^T: 16 x KEYS, fp32.
  float s[KEYS / 8][4];
#pragma unroll
  for (int i = 0; i < KEYS / 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
  }
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
    // A fragment: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), ...
    u32 a[4];
    ldmatrix_x4(a, off.rows_first(q_base, q_row0, ks));
#pragma unroll
    for (int nt = 0; nt < KEYS / 16; ++nt) {
      // B = K^T ("col"): matrices (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), ...
      u32 b[4];
      ldmatrix_x4(b, off.chunks_first(k_base, k_row0 + nt * 16, ks));
      mma_16816<IS_BF16>(s[2 * nt], a, b[0], b[1]);
      mma_16816<IS_BF16>(s[2 * nt + 1], a, b[2], b[3]);
    }
  }

  // Scale (and cap), mask, and the row max of this step. Without a window the lower bound
  // is -1, below every position.
  const int col0 = 2 * (lane & 3);
  const int qlo[2] = {feat.window > 0 ? qpos[0] - feat.window : -1,
                      feat.window > 0 ? qpos[1] - feat.window : -1};
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < KEYS / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = score2(s[nt][e], scale_log2, feat);
      const int kpos = kpos0 + nt * 8 + col0 + (e & 1);
      if (MASK && (kpos > qpos[e >> 1] || kpos <= qlo[e >> 1])) v = neg_inf();
      s[nt][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }

  // Online softmax: rescale what we have, exponentiate this step.
  float base[2], alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(st.m[r], mx[r]);
    // A row with nothing unmasked yet keeps m = -inf; subtract 0 so 2^(-inf - base) = 0
    // instead of NaN.
    base[r] = m_new == neg_inf() ? 0.f : m_new;
    alpha[r] = fast_exp2(st.m[r] - base[r]);
    st.m[r] = m_new;
    st.l[r] *= alpha[r];
  }
#pragma unroll
  for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
    st.o[dt][0] *= alpha[0];
    st.o[dt][1] *= alpha[0];
    st.o[dt][2] *= alpha[1];
    st.o[dt][3] *= alpha[1];
  }
#pragma unroll
  for (int nt = 0; nt < KEYS / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = fast_exp2(s[nt][e] - base[e >> 1]);
      s[nt][e] = p;
      st.l[e >> 1] += p;
    }
  }

  // O += P V. The C layout of two adjacent 8-key score tiles is the A layout of one
  // k16 step, so P goes from registers straight into the mma.
#pragma unroll
  for (int ks = 0; ks < KEYS / 16; ++ks) {
    u32 a[4];
    a[0] = pack2<IS_BF16>(s[2 * ks][0], s[2 * ks][1]);
    a[1] = pack2<IS_BF16>(s[2 * ks][2], s[2 * ks][3]);
    a[2] = pack2<IS_BF16>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    a[3] = pack2<IS_BF16>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 16; ++dt) {
      // B = V (k = keys, n = dims), stored key-major: transpose on load. Matrices
      // (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, dims 8-15), ...
      u32 b[4];
      ldmatrix_x4_trans(b, off.rows_first(v_base, k_row0 + ks * 16, dt));
      mma_16816<IS_BF16>(st.o[2 * dt], a, b[0], b[1]);
      mma_16816<IS_BF16>(st.o[2 * dt + 1], a, b[2], b[3]);
    }
  }
}
