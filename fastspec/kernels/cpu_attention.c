/* fastspec's CPU attention over a dense padded plan (cpu_fused.attend and the layer stack in cpu_fused.c call it;
 * cpu_fused.py holds its torch twin): float32 math over a float32, bfloat16 or float16 KV cache, each token's keys
 * in chunks whose softmaxes merge in order, split between torch's OpenMP threads once there is enough work. Built
 * with -ffast-math (vectorised expf): nothing relies on infinities or NaN. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_rows.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* query rows x heads x keys below which attention runs on the calling thread (a decode step of 9 heads splits from
 * 57 keys on: waking the other threads costs less than that much work) */
#define PARALLEL_WORK 512
#define MASKED (-1e30f) /* below every score: finite, since the library is built with -ffast-math (vector expf) */

/* A token's keys split into chunks of CHUNK (by their place in its own list of seen keys, so a chunk holds the same
 * keys whatever else is in the batch): each chunk's softmax is taken apart and the chunks merged in order, as a
 * flash-decoding split, so a long context's keys split between threads even for one decode token. */
#define CHUNK 128
#define SLAB 64 /* tokens whose chunk partials are held at once (a long prefill runs in slabs) */

/* The KV slots token t sees (its columns where the mask allows, in column order) into seen; returns how many. */
static int64_t seen_keys(int64_t t, const int64_t *out_index, const int64_t *kv_slots, const uint8_t *mask,
                         int64_t max_qo, int64_t max_kv, int64_t *seen) {
    int64_t b = out_index[t] / max_qo, i = out_index[t] % max_qo, n = 0;
    const uint8_t *allowed = mask ? mask + (b * max_qo + i) * max_kv : NULL;
    for (int64_t j = 0; j < max_kv; j++)
        if (!allowed || allowed[j]) seen[n++] = kv_slots[b * max_kv + j];
    return n;
}

/* Attention's vectors: LANES floats, as wide as the CPU's registers hold 16 accumulators and a query (AVX-512: 16
 * floats, else 8: AVX2's 16 registers; wider ones spill), loaded from any float address. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t halves __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t words __attribute__((vector_size(LANES * 4), aligned(4)));
typedef _Float16 f16s __attribute__((vector_size(LANES * 2), aligned(2)));
#define LOAD(p) (*(const vec *)(p))

/* LANES values of a KV row (dtype code kv, as cpu_rows.h: 0 float32, 1 bfloat16, 2 float16) from element d on, as
 * floats: a bfloat16 is a float's top half, a float16 widens exactly. kv is a constant where it is inlined. */
static inline __attribute__((always_inline)) vec load_kv(const char *row, int64_t d, int kv) {
    const void *at = (const uint16_t *)row + d;
    if (kv == 1) { /* widen to 32 bits, shift into the top half (the intrinsics: GCC's generic vectors do worse) */
#if LANES == 16
        return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(at)), 16));
#elif defined(__AVX2__)
        return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(at)), 16));
#else
        words w = __builtin_convertvector(*(const halves *)at, words) << 16;
        vec f;
        memcpy(&f, &w, sizeof f);
        return f;
#endif
    }
    if (kv == 2) { /* the CPU's half -> float conversion (GCC widens vectors of _Float16 lane by lane) */
#if LANES == 16
        return (vec)_mm512_cvtph_ps(_mm256_loadu_si256(at));
#elif defined(__F16C__)
        return (vec)_mm256_cvtph_ps(_mm_loadu_si128(at));
#else
        return __builtin_convertvector(*(const f16s *)at, vec);
#endif
    }
    return LOAD((const float *)row + d);
}

/* element d of a KV row as a float */
static inline __attribute__((always_inline)) float kv_at(const char *row, int64_t d, int kv) {
    return kv == 1 ? bf16_to_f32(((const uint16_t *)row)[d]) : kv == 2 ? (float)((const _Float16 *)row)[d]
                                                                       : ((const float *)row)[d];
}

/* r[j] = the sum of x[j]'s lanes, for LANES vectors at once: each level adds lane halves of two vectors. E.g. with 8
 * lanes, level 1 puts x0's lanes 0-3 + 4-7 in lanes 0-3 and x1's in lanes 4-7; after the last level lane j holds the
 * sum of x[j]. */
static inline vec sum_lanes(const vec *x) {
#if LANES == 16
    vec y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vec y[4], z[2];
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

#define AHEAD 16 /* keys ahead whose K / V rows are fetched early: a token's slots may be scattered over the pool */

static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
}

/* Rows of weights that share each load of a V row (weighted_v): as many as the registers hold with their 4 vectors of
 * accumulators each (AVX-512's 32: 6 rows; else 2) */
#if LANES == 16
#define VROWS 6
#else
#define VROWS 2
#endif

/* o[j][0, D) = the sum over keys a < n of p[j][a] x V row a, for MB rows j at once: one load of a V row serves them
 * all, and their 4 x MB accumulators are independent chains. Each row's sum over the keys runs in key order whatever
 * else is batched with it. prefetch: the bytes of a V row to fetch AHEAD keys on (0: none). */
static inline __attribute__((always_inline)) void weighted_v_rows(const int MB, const float *const *p, float *const *o,
                                                                  const char *const *rows, int64_t n, int64_t D,
                                                                  const int kv, int64_t prefetch) {
    const int64_t block = 4 * LANES;
    int64_t d = 0;
    for (; d + block <= D; d += block) {
        vec acc[VROWS][4];
        for (int j = 0; j < MB; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = (vec){0};
        for (int64_t a = 0; a < n; a++) {
            const char *v = rows[a];
            if (prefetch && d == 0 && a + AHEAD < n) prefetch_row(rows[a + AHEAD], prefetch);
            vec v0 = load_kv(v, d, kv), v1 = load_kv(v, d + LANES, kv), v2 = load_kv(v, d + 2 * LANES, kv),
                v3 = load_kv(v, d + 3 * LANES, kv);
            for (int j = 0; j < MB; j++) {
                float w = p[j][a];
                acc[j][0] += w * v0, acc[j][1] += w * v1, acc[j][2] += w * v2, acc[j][3] += w * v3;
            }
        }
        for (int j = 0; j < MB; j++)
            for (int i = 0; i < 4; i++) *(vec *)(o[j] + d + i * LANES) = acc[j][i];
    }
    for (; d + LANES <= D; d += LANES)
        for (int j = 0; j < MB; j++) {
            vec acc = {0};
            for (int64_t a = 0; a < n; a++) acc += p[j][a] * load_kv(rows[a], d, kv);
            *(vec *)(o[j] + d) = acc;
        }
    for (; d < D; d++)
        for (int j = 0; j < MB; j++) {
            float acc = 0.f;
            for (int64_t a = 0; a < n; a++) acc += p[j][a] * kv_at(rows[a], d, kv);
            o[j][d] = acc;
        }
}

/* weighted_v_rows for MB (<= VROWS) and kv known at compile time */
static void weighted_v(int MB, const float *const *p, float *const *o, const char *const *rows, int64_t n, int64_t D,
                       int kv, int64_t prefetch) {
#define ROWS_OF(mb)                                                                                                   \
    (kv == 1   ? weighted_v_rows(mb, p, o, rows, n, D, 1, prefetch)                                                     \
     : kv == 2 ? weighted_v_rows(mb, p, o, rows, n, D, 2, prefetch)                                                     \
               : weighted_v_rows(mb, p, o, rows, n, D, 0, prefetch))
    switch (MB) {
    case 1: ROWS_OF(1); break;
#if VROWS > 2
    case 3: ROWS_OF(3); break;
    case 4: ROWS_OF(4); break;
    case 5: ROWS_OF(5); break;
    case 6: ROWS_OF(6); break;
#endif
    default: ROWS_OF(2); break;
    }
#undef ROWS_OF
}

#define TILE 4 /* tokens that share a chunk's K and V loads when they see the same keys in it (a prefill, a verify) */

/* One chunk for R <= TILE tokens that see the same n <= CHUNK keys (slots) in it, each with the `group` query heads
 * qs[r] [group, D] of KV head g: per token r and head h, the keys' scores, their top score, the sum of exp(score -
 * top) and the weighted sum of V, into top / sum [heads[r] + h * stride] and part [(heads[r] + h * stride) * D].
 * scores: scratch [R * group, CHUNK]. Scores go LANES (token, key) pairs at a time (RP tokens x KP keys, an
 * accumulator in a register each, summed across lanes together: sum_lanes), the weighted sum of V 4 vectors of
 * columns at a time for every token. Each (token, head, key) product and each sum runs in the same order whatever R
 * is, so a token computes bit for bit what it computes alone. */
static inline __attribute__((always_inline)) void chunk_tile(
    const float *const *qs, const int R, int64_t group, int64_t D, const char *k_cache, const char *v_cache,
    const int kv, int64_t Hkv, int64_t g, const int64_t *slots, int64_t n, float scale, float *scores, float *part,
    float *top, float *sum, const int64_t *heads, int64_t stride) {
    const int RP = R == 3 ? 4 : R, KP = LANES / RP; /* a pass: RP tokens (the last again past R) x KP keys */
    const char *rows[CHUNK];
    int64_t padded = (n + LANES - 1) / LANES * LANES, body = D / LANES * LANES;
    int64_t bytes = D * (kv ? 2 : 4); /* a row's */
    for (int64_t a = 0; a < padded; a++) /* past n: the last key again, its scores dropped below */
        rows[a] = k_cache + (slots[a < n ? a : n - 1] * Hkv + g) * bytes;
    for (int64_t a0 = 0; a0 < padded; a0 += KP) {
        for (int64_t a = a0 + AHEAD; a < a0 + KP + AHEAD && a < n; a++) prefetch_row(rows[a], bytes);
        for (int64_t h = 0; h < group; h++) {
            const float *qh[TILE];
            for (int r = 0; r < RP; r++) qh[r] = qs[r < R ? r : R - 1] + h * D;
            vec acc[LANES] = {{0}}; /* [r * KP + j]: token r, key a0 + j */
            for (int64_t d = 0; d < body; d += LANES)
                for (int r = 0; r < RP; r++) {
                    vec x = LOAD(qh[r] + d);
                    for (int j = 0; j < KP; j++) acc[r * KP + j] += x * load_kv(rows[a0 + j], d, kv);
                }
            vec dots = sum_lanes(acc);
            for (int64_t d = body; d < D; d++) /* a head dim that is not a multiple of LANES: the last columns */
                for (int r = 0; r < RP; r++)
                    for (int j = 0; j < KP; j++) dots[r * KP + j] += qh[r][d] * kv_at(rows[a0 + j], d, kv);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < KP; j++) scores[(r * group + h) * CHUNK + a0 + j] = dots[r * KP + j] * scale;
        }
    }
    for (int64_t a = 0; a < n; a++) rows[a] = v_cache + (slots[a] * Hkv + g) * bytes;
    for (int64_t a = 0; a < n && a < AHEAD; a++) prefetch_row(rows[a], bytes);
    const int64_t M = R * group; /* (head, token) rows of weights: m = h * R + r */
    for (int64_t m0 = 0; m0 < M; m0 += VROWS) {
        const float *p[VROWS];
        float *o[VROWS];
        int mb = M - m0 < VROWS ? (int)(M - m0) : VROWS;
        for (int j = 0; j < mb; j++) {
            int64_t h = (m0 + j) / R, r = (m0 + j) % R;
            float *pr = scores + (r * group + h) * CHUNK, best = MASKED;
            for (int64_t a = 0; a < n; a++) best = pr[a] > best ? pr[a] : best;
#pragma omp simd
            for (int64_t a = 0; a < n; a++) pr[a] = expf(pr[a] - best);
            for (int64_t a = n; a < padded; a++) pr[a] = 0.f;
            vec lanes = {0};
            for (int64_t a = 0; a < padded; a += LANES) lanes += LOAD(pr + a);
            float s = 0.f;
            for (int l = 0; l < LANES; l++) s += lanes[l];
            int64_t at = heads[r] + h * stride;
            top[at] = best, sum[at] = s, p[j] = pr, o[j] = part + at * D;
        }
        weighted_v(mb, p, o, rows, n, D, kv, m0 == 0 ? bytes : 0);
    }
}

/* chunk_tile for R and the KV dtype code kv known at compile time (its registers: R tokens' accumulators) */
static void attend_chunk(const float *const *qs, int R, int64_t group, int64_t D, const char *k_cache,
                         const char *v_cache, int kv, int64_t Hkv, int64_t g, const int64_t *slots, int64_t n,
                         float scale, float *scores, float *part, float *top, float *sum, const int64_t *heads,
                         int64_t stride) {
#define TILE_OF(r, c) chunk_tile(qs, r, group, D, k_cache, v_cache, c, Hkv, g, slots, n, scale, scores, part, top, \
                                 sum, heads, stride)
#define TILES_OF(c)              \
    switch (R) {                 \
    case 1: TILE_OF(1, c); break; \
    case 2: TILE_OF(2, c); break; \
    case 3: TILE_OF(3, c); break; \
    default: TILE_OF(4, c); break; \
    }
    if (kv == 1) {
        TILES_OF(1)
    } else if (kv == 2) {
        TILES_OF(2)
    } else {
        TILES_OF(0)
    }
#undef TILES_OF
#undef TILE_OF
}

/* Attention of a dense padded plan (fastspec.attention.torch_backend.TorchAttnPlan): token t is query row
 * out_index[t] = b * max_qo + i; it sees key column j of request b (KV slot kv_slots[b, j]) where
 * mask[b, i, j] (mask NULL: every column). q float32 [T, Hq, D]; caches [num_slots, Hkv, D] in dtype code kv;
 * out [T, Hq, D] in `out_act`. Query head h reads KV head h / (Hq / Hkv).
 * Batch-invariant: a token's output depends only on the keys it sees, in column order, not on the padding, the
 * masked columns or the other tokens, so a tree verify computes bit for bit what a decode step of the same token
 * would (the seen keys are gathered into a list first; its chunks and every sum over them run in a fixed order).
 * Work items are (KV head, chunk, TILE consecutive tokens): tokens that see the same keys in the chunk (a prefill's
 * full chunks, a verify's prefix) go through it together, sharing each K / V load (chunk_tile). */
void attend(const float *q, const void *k_cache, const void *v_cache, int kv, int64_t T, int64_t Hq, int64_t Hkv,
            int64_t D, const int64_t *out_index, const int64_t *kv_slots, const uint8_t *mask, int64_t max_qo,
            int64_t max_kv, float scale, void *out, int out_act) {
    int64_t group = Hq / Hkv, chunks = max_kv > 0 ? (max_kv + CHUNK - 1) / CHUNK : 1, width = max_kv > 0 ? max_kv : 1;
    int64_t slab = T < SLAB ? T : SLAB;
    float *o_all = (float *)malloc(T * Hq * D * sizeof(float));
    float *part = (float *)malloc(slab * Hq * chunks * (D + 2) * sizeof(float));
    float *top = part + slab * Hq * chunks * D, *sum = top + slab * Hq * chunks; /* [slab, Hq, chunks] */
    int64_t *seen = (int64_t *)malloc(slab * (width + 1) * sizeof(int64_t)), *count = seen + slab * width;
    for (int64_t t0 = 0; t0 < T; t0 += slab) {
        int64_t tokens = T - t0 < slab ? T - t0 : slab;
        /* split between torch's OpenMP threads once there is enough work to pay for waking them */
#pragma omp parallel if (tokens * Hq * max_kv >= PARALLEL_WORK)
        {
            float *scores = (float *)malloc(TILE * group * CHUNK * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t u = 0; u < tokens; u++)
                count[u] = seen_keys(t0 + u, out_index, kv_slots, mask, max_qo, max_kv, seen + u * width);
            int64_t tiles = (tokens + TILE - 1) / TILE;
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < Hkv * chunks * tiles; item++) {
                /* KV heads vary fastest: the items running at once read the same slots' rows, whose heads lie side
                 * by side in the cache ([num_slots, Hkv, D]), so each slot's lines come from memory once */
                int64_t g = item % Hkv, c = item / Hkv / tiles, u1 = item / Hkv % tiles * TILE + TILE;
                int64_t lo = c * CHUNK, heads[TILE], run_n = 0;
                const float *qs[TILE];
                const int64_t *run = NULL; /* the keys in this chunk of the run of tokens gathered so far */
                int R = 0;
                for (int64_t u = u1 - TILE; u <= u1 && u <= tokens; u++) { /* runs of tokens seeing the same keys */
                    const int64_t *mine = seen + u * width + lo;
                    int64_t n = u < u1 && u < tokens ? count[u] - lo : 0; /* past the tile: 0, the last run ends */
                    n = n < CHUNK ? n : CHUNK;
                    if (R && (n != run_n || memcmp(mine, run, n * sizeof(int64_t)))) { /* the run ends here */
                        attend_chunk(qs, R, group, D, (const char *)k_cache, (const char *)v_cache, kv, Hkv, g, run,
                                     run_n, scale, scores, part, top, sum, heads, chunks);
                        R = 0;
                    }
                    if (n <= 0) continue;
                    if (R == 0) run = mine, run_n = n;
                    qs[R] = q + ((t0 + u) * Hq + g * group) * D;
                    heads[R++] = (u * Hq + g * group) * chunks + c; /* (u, g's first head, c) in [slab, Hq, chunks] */
                }
            }
#pragma omp for schedule(static)
            for (int64_t uh = 0; uh < tokens * Hq; uh++) { /* merge the chunks in order: a fixed sum per token */
                int64_t used = (count[uh / Hq] + CHUNK - 1) / CHUNK;
                float m = MASKED, total = 0.f, *o = o_all + (t0 * Hq + uh) * D;
                const float *tp = top + uh * chunks, *sp = sum + uh * chunks, *pp = part + uh * chunks * D;
                for (int64_t c = 0; c < used; c++) m = tp[c] > m ? tp[c] : m;
                memset(o, 0, D * sizeof(float));
                for (int64_t c = 0; c < used; c++) {
                    float w = expf(tp[c] - m);
                    total += w * sp[c];
                    for (int64_t d = 0; d < D; d++) o[d] += w * pp[c * D + d];
                }
                float inv = used ? 1.f / total : 0.f; /* total >= 1 (the top chunk's exp(0) x its sum >= 1) */
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
            free(scores);
        }
    }
    for (int64_t t = 0; t < T; t++) store_row(o_all + t * Hq * D, Hq * D, (char *)out + t * Hq * D * (out_act ? 2 : 4),
                                              out_act);
    free(o_all), free(part), free(seen);
}

/* A paged plan as the dense padded one attend reads (attention/paged.py twin_plan, tested equal): kv_slots int64
 * [bs, W + X] = request b's first prefix_lens[b] slots of its table row (slot 0 past them), then its block slots
 * [bs, X]; mask bool [bs, Q, W + X] = the prefix columns below prefix_lens[b], then block_mask [bs, Q, X] (and the
 * diagonal where self_visible). */
void paged_dense_plan(const int32_t *table, int64_t table_stride, const int64_t *rows, const int64_t *prefix_lens,
                      const int64_t *block_slots, const uint8_t *block_mask, int64_t bs, int64_t Q, int64_t X,
                      int64_t W, int self_visible, int64_t *kv_slots, uint8_t *mask) {
    for (int64_t b = 0; b < bs; b++) {
        const int32_t *row = table + rows[b] * table_stride;
        int64_t len = prefix_lens[b], *s = kv_slots + b * (W + X);
        for (int64_t j = 0; j < W; j++) s[j] = j < len ? row[j] : 0;
        memcpy(s + W, block_slots + b * X, (size_t)X * sizeof(int64_t));
        for (int64_t i = 0; i < Q; i++) {
            uint8_t *m = mask + (b * Q + i) * (W + X);
            const uint8_t *block = block_mask + (b * Q + i) * X;
            for (int64_t j = 0; j < W; j++) m[j] = j < len;
            for (int64_t x = 0; x < X; x++) m[W + x] = block[x] || (self_visible && x == i);
        }
    }
}
