/* Paged decode attention on the CPU: one query token per sequence, fp32.
 *
 * The torch reference (actorllm/ops/torch_backend.py) gathers every sequence's whole
 * context into a padded tensor before one batched SDPA; at 64 sequences of 200 tokens
 * that copy is most of the attention time. This kernel reads K/V where they lie, block
 * by block through the block table, with an online softmax (one pass over the
 * context, no scores buffer). Layouts are those of DESIGN.md section 5:
 *
 *   q            [num_seqs, num_heads, head_dim]
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, max_blocks] int32
 *   seq_lens     [num_seqs] int32 (context length including the new token)
 *   out          [num_seqs, num_heads, head_dim]
 *
 * Two score features of some models are built in, as transformers' eager attention
 * defines them (the torch reference is the oracle): a sliding window W lets the query
 * (at position len - 1) see only the last W keys, so the walk simply starts at
 * len - W; a soft-cap c maps each scaled score s to c * tanh(s / c) before the softmax
 * (Gemma 2). Both are arguments of paged_decode_f32_ex; paged_decode_f32 is the plain
 * call (no window, no cap) that cpu_decode_step.cpp makes.
 *
 * The query heads that share a KV head (GQA) are processed together, so each key and
 * value row is loaded once per group. Work is split over (sequence, KV head) pairs
 * between `num_threads` threads of an OpenMP parallel region; the caller picks the
 * count. OpenMP rather than threads made here: the library links libgomp, which is the
 * one torch has already loaded, so the region runs on the calling thread's OpenMP team,
 * the very threads that just ran the step's matmuls. Threads of our own would have to
 * be scheduled beside that team's workers, which spin for a while after each region:
 * on 2 cores that made the kernel slower with 2 threads than with 1.
 * Built by actorllm/ops/cpu_backend.py with the machine's C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    float *out;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    int64_t window; /* 0: no sliding window */
    float softcap;  /* 0: no soft-cap */
} job_t;

/* Up to this many context positions are scored before the running softmax is updated:
 * one block of the cache at a time, so the rescale happens once per block, not per key. */
#define MAX_CHUNK 64

/* exp(x) for x <= 0 without a libm call, so the softmax loops vectorize: 2^n put in the
 * exponent bits, times a degree-6 polynomial of the remainder r = x - n ln2 (|r| <=
 * ln2/2, ln2 split in two constants so r keeps its low bits); relative error a few
 * 1e-7, like expf's. Below -87 (-inf included) it returns 0, where expf is under
 * 1.7e-38 anyway. The libm call per score was 35-40 % of the kernel's time at 64
 * sequences of 200 tokens. */
static inline float exp_le0(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = floorf(xc * 1.44269504f + 0.5f);
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s = { .i = ((int32_t)n + 127) << 23 };
    return x < -87.0f ? 0.0f : p * s.f;
}

/* `D` and `group` are constants where one_item instantiates this for the common shapes,
 * so the loops over the head dimension and the group's heads unroll and vectorize
 * fully (measured 20 % faster than a runtime group at 4 query heads per KV head).
 * `capped` is a constant too, so the plain path carries no soft-cap test in its loops. */
static inline __attribute__((always_inline)) void item_d(const job_t *j, int64_t item,
                                                         const int64_t D, const int64_t group,
                                                         const int capped) {
    const int64_t s = item / j->num_kv_heads, g = item % j->num_kv_heads;
    const int64_t len = j->seq_lens[s], bs = j->block_size;
    /* The window's first visible key; the keys before it are never read. */
    const int64_t first = j->window > 0 && len > j->window ? len - j->window : 0;
    const float cap = j->softcap, inv_cap = capped ? 1.0f / j->softcap : 0.0f;
    const int32_t *table = j->block_tables + s * j->max_blocks;
    const float *q = j->q + (s * j->num_heads + g * group) * D;
    float *out = j->out + (s * j->num_heads + g * group) * D;
    const int64_t row = j->num_kv_heads * D; /* floats between consecutive slots */
    const int64_t chunk = bs < MAX_CHUNK ? bs : MAX_CHUNK;
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_HEAD_DIM];
    float qs[MAX_GROUP][MAX_HEAD_DIM], score[MAX_GROUP][MAX_CHUNK];

    for (int64_t h = 0; h < group; h++) {
        for (int64_t d = 0; d < D; d++) {
            qs[h][d] = q[h * D + d] * j->scale;
            acc[h][d] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t p0 = first, n = 0; p0 < len; p0 += n) {
        /* A chunk never crosses a block: its keys are consecutive rows of one block. The
         * window may start mid-block, so a chunk ends at the block's end, not at the next
         * multiple of `chunk`. */
        const int64_t to_block_end = bs - p0 % bs;
        n = len - p0 < chunk ? len - p0 : chunk;
        n = n < to_block_end ? n : to_block_end;
        const int64_t slot0 = (int64_t)table[p0 / bs] * bs + p0 % bs;
        const float *kb = j->k_cache + slot0 * row + g * D;
        const float *vb = j->v_cache + slot0 * row + g * D;
        for (int64_t i = 0; i < n; i++) {
            const float *k = kb + i * row;
            for (int64_t h = 0; h < group; h++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qs[h][d] * k[d];
                score[h][i] = dot;
            }
        }
        if (capped) {
            for (int64_t h = 0; h < group; h++)
                for (int64_t i = 0; i < n; i++) score[h][i] = cap * tanhf(score[h][i] * inv_cap);
        }
        for (int64_t h = 0; h < group; h++) {
            float mx = m[h];
            for (int64_t i = 0; i < n; i++) mx = score[h][i] > mx ? score[h][i] : mx;
            const float c = exp_le0(m[h] - mx); /* 0 on the first chunk: m is -inf */
            l[h] *= c;
            for (int64_t d = 0; d < D; d++) acc[h][d] *= c;
            m[h] = mx;
            for (int64_t i = 0; i < n; i++) {
                score[h][i] = exp_le0(score[h][i] - mx);
                l[h] += score[h][i];
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const float *v = vb + i * row;
            for (int64_t h = 0; h < group; h++) {
                const float w = score[h][i];
                for (int64_t d = 0; d < D; d++) acc[h][d] += w * v[d];
            }
        }
    }
    for (int64_t h = 0; h < group; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[h * D + d] = acc[h][d] * inv;
    }
}

static void one_item(const job_t *j, int64_t item) {
    const int64_t group = j->num_heads / j->num_kv_heads;
    if (j->softcap > 0.0f) { /* soft-capped models are few: one generic instantiation */
        item_d(j, item, j->head_dim, group, 1);
        return;
    }
#define CASE(DD, GG) if (j->head_dim == DD && group == GG) { item_d(j, item, DD, GG, 0); return; }
    CASE(32, 1) CASE(32, 2) CASE(32, 4) CASE(32, 8)
    CASE(64, 1) CASE(64, 2) CASE(64, 4) CASE(64, 8)
    CASE(128, 1) CASE(128, 2) CASE(128, 4) CASE(128, 8)
#undef CASE
    item_d(j, item, j->head_dim, group, 0);
}

/* `window` > 0: each query sees only the last `window` keys; `softcap` > 0: scores are
 * soft-capped. Returns 0 on success, -1 when a shape or argument is beyond the kernel. */
int paged_decode_f32_ex(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *block_tables, const int32_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                        int64_t window, float softcap, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0
        || num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || window < 0
        || !(softcap >= 0.0f))
        return -1;
    const int64_t items = num_seqs * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    if (num_threads > items) num_threads = (int)(items > 0 ? items : 1);
    const job_t job = {q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs,
                       num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale,
                       window, softcap};
    /* Static contiguous shares: each thread walks its own run of sequences. */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < items; i++) one_item(&job, i);
    return 0;
}

/* The plain call: no window, no soft-cap (the signature cpu_decode_step.cpp binds). */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *seq_lens, float *out,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                     int num_threads) {
    return paged_decode_f32_ex(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs,
                               num_heads, num_kv_heads, head_dim, block_size, max_blocks,
                               scale, 0, 0.0f, num_threads);
}
