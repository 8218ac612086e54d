// KV write: scatter the new tokens' K and V into the paged caches (DESIGN.md section 5).
//
// Token i's [num_kv_heads, head_dim] row goes to flat slot slot_mapping[i]
// (= block * block_size + offset); slot -1 is skipped. Because a slot's row in the cache
// [num_blocks, block_size, num_kv_heads, head_dim] is contiguous, this is a row copy, and
// the copy does not care whether the 16-bit elements are fp16 or bf16: one kernel serves
// every dtype, head size and block size.
//
// Launch: grid = num_tokens, block = 128 threads, no shared memory.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128)
    reshape_and_cache(const unsigned short* __restrict__ key,    // [tokens, Hkv, D], row stride
                      const unsigned short* __restrict__ value,  // [tokens, Hkv, D], row stride
                      unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache,
                      const i64* __restrict__ slot_mapping,
                      i64 key_stride,    // elements between tokens of key
                      i64 value_stride,  // elements between tokens of value
                      int row_elems) {       // num_kv_heads * head_dim, a multiple of 8
  const i64 token = blockIdx.x;
  const i64 slot = slot_mapping[token];
  if (slot < 0) return;

  // 16-byte vectors: the host checks that pointers are 16-byte aligned and strides are
  // multiples of 8 elements.
  const uint4* k_src = reinterpret_cast<const uint4*>(key + token * key_stride);
  const uint4* v_src = reinterpret_cast<const uint4*>(value + token * value_stride);
  uint4* k_dst = reinterpret_cast<uint4*>(k_cache + slot * row_elems);
  uint4* v_dst = reinterpret_cast<uint4*>(v_cache + slot * row_elems);
  for (int i = threadIdx.x; i < row_elems / 8; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}
