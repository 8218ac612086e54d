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
 * (Gemma 2). Both are arguments of paged_decode_f32_ex, the call cpu_decode_step.cpp
 * makes (a window per layer); paged_decode_f32 is the plain call (no window, no cap).
 *
 * The query heads that share a KV head (GQA) are processed together, so each key and
 * value row is loaded once per group. The context is walked in chunks of up to
 * MAX_CHUNK keys that span blocks (a list of row pointers per chunk), so the softmax's
 * reductions and rescale run once per 64 keys; the next chunk's rows are prefetched.
 *
 * Where the compiler targets AVX-512 (-march=native on this project's machines), the
 * steps are written with its intrinsics, since gcc vectorized the key-by-key loops
 * badly (a horizontal sum per key and head, a scalar exp per score): scores four query
 * heads a vector (score_x4, groups of 4, 8, 12 or 16), the softmax and the weighted sum
 * of values sixteen lanes of the head dimension at a time (head dims that are multiples
 * of 16). Measured at the embedded model's shape (8 heads over 2 KV heads of 32, 200
 * keys, one thread): 1.3x faster where K/V sit in L2 (4 sequences), and the same or
 * better where the cache is far larger (64 sequences; noisy, shared host). Other
 * shapes and machines keep the portable loops; both are tested against the torch
 * reference (tests/test_ops_cpu.py). Work is split over (sequence, KV head) pairs
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

/* Up to this many context positions are scored before the running softmax is updated,
 * across blocks, so the rescale happens once per chunk, not per key. A multiple of
 * KEY_TILE. */
#define MAX_CHUNK 64

/* Keys scored at once by score_x4: eight independent FMA chains keep both FMA units busy
 * (an FMA's latency is four cycles). */
#define KEY_TILE 8

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

#ifdef __AVX512F__
#include "cpu_exp16.h" /* exp16_le0, lanes_left; includes immintrin.h */

/* Sums the four lanes of each 128-bit quarter of a, b, c and d: quarter p of the result
 * holds a's, b's, c's and d's sums of their quarter p. */
static inline __m512 sum_quarters(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}

static inline void store_quarters(__m512 r, float score[][MAX_CHUNK], int64_t h, int64_t i) {
    _mm_storeu_ps(&score[h][i], _mm512_castps512_ps128(r));
    _mm_storeu_ps(&score[h + 1][i], _mm512_extractf32x4_ps(r, 1));
    _mm_storeu_ps(&score[h + 2][i], _mm512_extractf32x4_ps(r, 2));
    _mm_storeu_ps(&score[h + 3][i], _mm512_extractf32x4_ps(r, 3));
}

static const float zero_key[MAX_HEAD_DIM] __attribute__((aligned(64)));

/* The scores of n keys (rows `row` floats apart from kb) for every head of the group, four
 * heads a vector. A score is a horizontal sum over the head dimension, which a key-by-key
 * loop reduces across lanes once per key and head; here each 128-bit quarter of a vector
 * holds one head, the key's four dimensions broadcast into every quarter (a load, not a
 * shuffle), so one FMA advances four heads at once and the lanes are reduced once per four
 * keys for all four heads (sum_quarters). qx holds the query in that layout. Keys past n
 * read zeros; their scores land in score's spare columns and are never read. */
static inline __attribute__((always_inline)) void score_x4(
    const float *qx, const float *const *kp, int64_t n, const int64_t D, const int64_t group,
    float score[][MAX_CHUNK]) {
    for (int64_t i0 = 0; i0 < n; i0 += KEY_TILE) {
        const float *const *k = kp + i0;
        for (int64_t set = 0; set < group / 4; set++) {
            const float *qv = qx + set * 4 * D;
            __m512 a[KEY_TILE];
            for (int t = 0; t < KEY_TILE; t++) a[t] = _mm512_setzero_ps();
            for (int64_t b = 0; b < D / 4; b++) {
                const __m512 q = _mm512_load_ps(qv + 16 * b);
                for (int t = 0; t < KEY_TILE; t++)
                    a[t] = _mm512_fmadd_ps(q, _mm512_broadcast_f32x4(_mm_loadu_ps(k[t] + 4 * b)),
                                           a[t]);
            }
            store_quarters(sum_quarters(a[0], a[1], a[2], a[3]), score, 4 * set, i0);
            store_quarters(sum_quarters(a[4], a[5], a[6], a[7]), score, 4 * set, i0 + 4);
        }
    }
}
/* score_x4 for groups of two heads: lanes (head, dimension) over runs of eight dimensions,
 * the key's eight broadcast into both halves, so a key costs D / 8 FMAs and no lane is
 * idle (the portable loop reduced each key's dot product across lanes once per head). Per
 * KEY_TILE keys, sum_quarters leaves each head's partial sums in two quarters, and one
 * shuffle pair adds them: quarters (head 0, keys 0-3), (head 1, 0-3), (head 0, 4-7),
 * (head 1, 4-7). qx holds the query as lanes (head, d % 8) per run of eight. */
static inline __attribute__((always_inline)) void score_x2(
    const float *qx, const float *const *kp, int64_t n, const int64_t D,
    float score[][MAX_CHUNK]) {
    for (int64_t i0 = 0; i0 < n; i0 += KEY_TILE) {
        const float *const *k = kp + i0;
        __m512 a[KEY_TILE];
        for (int t = 0; t < KEY_TILE; t++) a[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < D / 8; b++) {
            const __m512 q = _mm512_load_ps(qx + 16 * b);
            for (int t = 0; t < KEY_TILE; t++)
                a[t] = _mm512_fmadd_ps(
                    q, _mm512_broadcast_f32x8(_mm256_loadu_ps(k[t] + 8 * b)), a[t]);
        }
        const __m512 r1 = sum_quarters(a[0], a[1], a[2], a[3]);
        const __m512 r2 = sum_quarters(a[4], a[5], a[6], a[7]);
        const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(r1, r2, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(r1, r2, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm_storeu_ps(&score[0][i0], _mm512_castps512_ps128(r));
        _mm_storeu_ps(&score[1][i0], _mm512_extractf32x4_ps(r, 1));
        _mm_storeu_ps(&score[0][i0 + 4], _mm512_extractf32x4_ps(r, 2));
        _mm_storeu_ps(&score[1][i0 + 4], _mm512_extractf32x4_ps(r, 3));
    }
}

/* One head's online-softmax update over the n scores of a chunk, sixteen at a time: the
 * scores become their weights exp(s - max), m and l the running maximum and sum. Returns
 * the factor that rescales what was accumulated before the chunk. gcc left the scalar
 * loops of item_d unvectorized (the running maximum and sum are reductions): they were
 * the largest part of the kernel's time once the scores were vectorized. */
static inline float softmax16(float *score, int64_t n, float *m, float *l) {
    __m512 top = _mm512_set1_ps(*m);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        top = _mm512_mask_max_ps(top, k, top, _mm512_maskz_loadu_ps(k, score + i));
    }
    const float mx = _mm512_reduce_max_ps(top);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        const __m512 e = _mm512_maskz_mov_ps(
            k, exp16_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, score + i), vmx)));
        _mm512_mask_storeu_ps(score + i, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    const float c = exp_le0(*m - mx); /* 0 on the first chunk: m is -inf */
    *l = *l * c + _mm512_reduce_add_ps(sum);
    *m = mx;
    return c;
}

/* acc[h] = c[h] * acc[h] + sum over the chunk's keys of weight[h][i] * v_i, for every head
 * of the group, in registers for the chunk (each value row is loaded once). */
static inline __attribute__((always_inline)) void weigh_values16(
    float acc[][MAX_HEAD_DIM], const float score[][MAX_CHUNK], const float *c,
    const float *const *vp, int64_t n, const int64_t D, const int64_t group) {
    __m512 a[MAX_GROUP][MAX_HEAD_DIM / 16];
    for (int64_t h = 0; h < group; h++)
        for (int64_t b = 0; b < D / 16; b++)
            a[h][b] = _mm512_mul_ps(_mm512_loadu_ps(acc[h] + 16 * b), _mm512_set1_ps(c[h]));
    for (int64_t i = 0; i < n; i++) {
        const float *v = vp[i];
        __m512 vv[MAX_HEAD_DIM / 16];
        for (int64_t b = 0; b < D / 16; b++) vv[b] = _mm512_loadu_ps(v + 16 * b);
        for (int64_t h = 0; h < group; h++) {
            const __m512 w = _mm512_set1_ps(score[h][i]);
            for (int64_t b = 0; b < D / 16; b++) a[h][b] = _mm512_fmadd_ps(w, vv[b], a[h][b]);
        }
    }
    for (int64_t h = 0; h < group; h++)
        for (int64_t b = 0; b < D / 16; b++) _mm512_storeu_ps(acc[h] + 16 * b, a[h][b]);
}
#endif

/* The portable steps, for shapes the AVX-512 ones do not take and machines without it. */
static inline __attribute__((always_inline)) void score_plain(
    const float qs[][MAX_HEAD_DIM], const float *const *kp, int64_t n, const int64_t D,
    const int64_t group, float score[][MAX_CHUNK]) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < group; h++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) dot += qs[h][d] * kp[i][d];
            score[h][i] = dot;
        }
}

static inline __attribute__((always_inline)) void softmax_and_weigh_plain(
    float acc[][MAX_HEAD_DIM], float score[][MAX_CHUNK], float *m, float *l,
    const float *const *vp, int64_t n, const int64_t D, const int64_t group) {
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
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < group; h++) {
            const float w = score[h][i];
            for (int64_t d = 0; d < D; d++) acc[h][d] += w * vp[i][d];
        }
}

/* Asks for the next chunk's key and value rows while this one is computed. Each block
 * lies elsewhere in the cache, so the hardware prefetcher, which follows a stride within
 * a page, starts cold at every block: at 64 sequences of 200 tokens the cache is far
 * larger than L2 and those misses were a large part of the kernel's time. Into L2 (T1),
 * not L1: a chunk is 256 lines at the embedded model's shape, far more than L1 can have
 * in flight, and the lines are read once. On a Zen 4, a layer whose K/V come from
 * memory, as in a step (64 sequences of 192 keys, one thread), took 550-680 us against
 * 740-790 with T0, 1.44 against 1.83 ms at 448 keys; level where K/V sit in cache. */
static inline __attribute__((always_inline)) void prefetch_chunk(
    const job_t *j, const int32_t *table, const float *k_head, const float *v_head,
    int64_t from, int64_t len, const int64_t D) {
    const int64_t bs = j->block_size, row = j->num_kv_heads * D;
    const int64_t to = from + MAX_CHUNK < len ? from + MAX_CHUNK : len;
    for (int64_t p = from; p < to;) { /* a run of consecutive rows per block */
        const int64_t off = p % bs, run = bs - off < to - p ? bs - off : to - p;
        const float *k = k_head + ((int64_t)table[p / bs] * bs + off) * row;
        const float *v = v_head + (k - k_head);
        for (int64_t t = 0; t < run * row; t += row)
            for (int64_t d = 0; d < D; d += 16) { /* one line of 64 bytes each */
                __builtin_prefetch(k + t + d, 0, 2);
                __builtin_prefetch(v + t + d, 0, 2);
            }
        p += run;
    }
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
    const float *k_head = j->k_cache + g * D, *v_head = j->v_cache + g * D;
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float qs[MAX_GROUP][MAX_HEAD_DIM], score[MAX_GROUP][MAX_CHUNK];
    /* The chunk's key and value rows; the spare key entries point at zeros (score_x4). */
    const float *kp[MAX_CHUNK + KEY_TILE], *vp[MAX_CHUNK];

    for (int64_t h = 0; h < group; h++) {
        for (int64_t d = 0; d < D; d++) {
            qs[h][d] = q[h * D + d] * j->scale;
            acc[h][d] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
#ifdef __AVX512F__
    const int fast_scores = group % 4 == 0 && D % 4 == 0, fast_softmax = D % 16 == 0;
    const int pair_scores = group == 2 && D % 8 == 0;
    /* The query in score_x4's layout: per set of four heads, per run of four dimensions,
     * one vector of lanes (head, dimension). */
    float qx[MAX_GROUP * MAX_HEAD_DIM] __attribute__((aligned(64)));
    if (fast_scores)
        for (int64_t h = 0; h < group; h++)
            for (int64_t d = 0; d < D; d++)
                qx[(h / 4) * 4 * D + (d / 4) * 16 + (h % 4) * 4 + d % 4] = qs[h][d];
    if (pair_scores)
        for (int64_t h = 0; h < 2; h++)
            for (int64_t d = 0; d < D; d++) qx[(d / 8) * 16 + h * 8 + d % 8] = qs[h][d];
    for (int64_t t = 0; t < KEY_TILE; t++) kp[MAX_CHUNK + t] = zero_key;
#endif
    for (int64_t p0 = first; p0 < len; p0 += MAX_CHUNK) {
        /* A chunk spans blocks: the softmax's reductions and rescale, whose latency a
         * block of 16 keys did not hide, run once per MAX_CHUNK keys. */
        const int64_t n = len - p0 < MAX_CHUNK ? len - p0 : MAX_CHUNK;
        for (int64_t i = 0; i < n;) { /* a run of consecutive rows per block */
            const int64_t p = p0 + i, off = p % bs, run = bs - off < n - i ? bs - off : n - i;
            const int64_t slot = (int64_t)table[p / bs] * bs + off;
            for (int64_t t = 0; t < run; t++) {
                kp[i + t] = k_head + (slot + t) * row;
                vp[i + t] = v_head + (slot + t) * row;
            }
            i += run;
        }
        prefetch_chunk(j, table, k_head, v_head, p0 + n, len, D);
#ifdef __AVX512F__
        for (int64_t t = n; t < n + KEY_TILE && t < MAX_CHUNK; t++) kp[t] = zero_key;
        if (fast_scores)
            score_x4(qx, kp, n, D, group, score);
        else if (pair_scores)
            score_x2(qx, kp, n, D, score);
        else
#endif
            score_plain(qs, kp, n, D, group, score);
        if (capped) {
            for (int64_t h = 0; h < group; h++)
                for (int64_t i = 0; i < n; i++) score[h][i] = cap * tanhf(score[h][i] * inv_cap);
        }
#ifdef __AVX512F__
        if (fast_softmax) {
            float c[MAX_GROUP];
            for (int64_t h = 0; h < group; h++) c[h] = softmax16(score[h], n, &m[h], &l[h]);
            weigh_values16(acc, score, c, vp, n, D, group);
            continue;
        }
#endif
        softmax_and_weigh_plain(acc, score, m, l, vp, n, D, group);
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
    /* Runs of four items taken as threads come free, not fixed shares: where the team
     * shares its cores with the event loop's thread (2 cores, a forward during which the
     * Detokenizer runs) or a neighbour, a thread pushed off its core holds back only the
     * run it is in, and the others take the rest (issue 28). */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
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
