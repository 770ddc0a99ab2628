/* fastspec's CPU attention over a dense padded plan (cpu_fused.attend and the layer stack in cpu_fused.c call it;
 * cpu_fused.py holds its torch twin): float32 math over a float32, bfloat16, float16 or float8 KV cache, each
 * token's keys in chunks whose softmaxes merge in order, split between torch's OpenMP threads once there is enough
 * work. Built with -ffast-math (vectorised expf): nothing relies on infinities or NaN. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

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

#define TILE 4 /* tokens that share a chunk's K and V loads when they see the same keys in it (a prefill, a verify) */

/* One chunk for R <= TILE tokens that see the same n <= CHUNK keys (slots) in it, each with the `group` query heads
 * qs[r] [group, D] of KV head g: per token r and head h, the keys' scores, their top score, the sum of exp(score -
 * top) and the weighted sum of V (the first Dv <= D values of its row), into top / sum [heads[r] + h * stride] and
 * part [(heads[r] + h * stride) * Dv].
 * scores: scratch [R * group, CHUNK]. Scores go LANES (token, key) pairs at a time (RP tokens x KP keys, an
 * accumulator in a register each, summed across lanes together: sum_lanes), the weighted sum of V several (head,
 * token) rows at a time (weighted_v). Each (token, head, key) product and each sum runs in the same order whatever R
 * is, so a token computes bit for bit what it computes alone. */
static inline __attribute__((always_inline)) void chunk_tile(
    const float *const *qs, const int R, int64_t group, int64_t D, int64_t Dv, const char *k_cache,
    const char *v_cache, const int kv, int64_t Hkv, int64_t g, const int64_t *slots, int64_t n, float scale,
    float *scores, float *part, float *top, float *sum, const int64_t *heads, int64_t stride) {
    const int RP = R == 3 ? 4 : R, KP = LANES / RP; /* a pass: RP tokens (the last again past R) x KP keys */
    const char *rows[CHUNK];
    int64_t padded = (n + LANES - 1) / LANES * LANES, body = D / LANES * LANES;
    int64_t bytes = D * code_size(kv), v_bytes = Dv * code_size(kv); /* a row's; the part of a V row read */
    for (int64_t a = 0; a < padded; a++) /* past n: the last key again, its scores dropped below */
        rows[a] = k_cache + (slots[a < n ? a : n - 1] * Hkv + g) * bytes;
    /* float8 keys are widened to float32 once a pass for all the heads (16-bit ones widen cheaper as they load) */
    const int kk = kv >= 3 ? 0 : kv; /* the keys' code as the scores read them */
    float wide[kv >= 3 ? LANES * D : 1];
    for (int64_t a0 = 0; a0 < padded; a0 += KP) {
        for (int64_t a = a0 + AHEAD; a < a0 + KP + AHEAD && a < n; a++) prefetch_row(rows[a], bytes);
        const char *keys[LANES];
        for (int j = 0; j < KP; j++) {
            if (kv >= 3) widen_row(rows[a0 + j], D, kv, wide + j * D);
            keys[j] = kv >= 3 ? (const char *)(wide + j * D) : rows[a0 + j];
        }
        for (int64_t h = 0; h < group; h++) {
            const float *qh[TILE];
            for (int r = 0; r < RP; r++) qh[r] = qs[r < R ? r : R - 1] + h * D;
            vec acc[LANES] = {{0}}; /* [r * KP + j]: token r, key a0 + j */
            for (int64_t d = 0; d < body; d += LANES)
                for (int r = 0; r < RP; r++) {
                    vec x = LOAD(qh[r] + d);
                    for (int j = 0; j < KP; j++) acc[r * KP + j] += x * load_kv(keys[j], d, kk);
                }
            vec dots = sum_lanes(acc);
            for (int64_t d = body; d < D; d++) /* a head dim that is not a multiple of LANES: the last columns */
                for (int r = 0; r < RP; r++)
                    for (int j = 0; j < KP; j++) dots[r * KP + j] += qh[r][d] * kv_at(keys[j], d, kk);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < KP; j++) scores[(r * group + h) * CHUNK + a0 + j] = dots[r * KP + j] * scale;
        }
    }
    for (int64_t a = 0; a < n; a++) rows[a] = v_cache + (slots[a] * Hkv + g) * bytes; /* V rows: K's stride */
    for (int64_t a = 0; a < n && a < AHEAD; a++) prefetch_row(rows[a], v_bytes);
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
            top[at] = best, sum[at] = s, p[j] = pr, o[j] = part + at * Dv;
        }
        weighted_v(mb, p, o, rows, n, Dv, kv, m0 == 0 ? v_bytes : 0);
    }
}

/* chunk_tile for R and the KV dtype code kv known at compile time (its registers: R tokens' accumulators) */
static void attend_chunk(const float *const *qs, int R, int64_t group, int64_t D, int64_t Dv, const char *k_cache,
                         const char *v_cache, int kv, int64_t Hkv, int64_t g, const int64_t *slots, int64_t n,
                         float scale, float *scores, float *part, float *top, float *sum, const int64_t *heads,
                         int64_t stride) {
#define TILE_OF(r, c) chunk_tile(qs, r, group, D, Dv, k_cache, v_cache, c, Hkv, g, slots, n, scale, scores, part, \
                                 top, sum, heads, stride)
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
    } else if (kv == 3) {
        TILES_OF(3)
    } else if (kv == 4) {
        TILES_OF(4)
    } else {
        TILES_OF(0)
    }
#undef TILES_OF
#undef TILE_OF
}

/* Attention of a dense padded plan (fastspec.attention.torch_backend.TorchAttnPlan): token t is query row
 * out_index[t] = b * max_qo + i; it sees key column j of request b (KV slot kv_slots[b, j]) where
 * mask[b, i, j] (mask NULL: every column). q float32 [T, Hq, D]; caches [num_slots, Hkv, D] in dtype code kv, of
 * which V's rows are read to Dv <= D (MLA's latent pool: V is the first Dv values of K's row, v_cache = k_cache);
 * out [T, Hq, Dv] in `out_act`, times out_mul (a cache's V scale, else 1). Query head h reads KV head h / (Hq / Hkv).
 * Batch-invariant: a token's output depends only on the keys it sees, in column order, not on the padding, the
 * masked columns or the other tokens, so a tree verify computes bit for bit what a decode step of the same token
 * would (the seen keys are gathered into a list first; its chunks and every sum over them run in a fixed order).
 * Work items are (KV head, chunk, TILE consecutive tokens): tokens that see the same keys in the chunk (a prefill's
 * full chunks, a verify's prefix) go through it together, sharing each K / V load (chunk_tile). */
void attend(const float *q, const void *k_cache, const void *v_cache, int kv, int64_t T, int64_t Hq, int64_t Hkv,
            int64_t D, int64_t Dv, const int64_t *out_index, const int64_t *kv_slots, const uint8_t *mask,
            int64_t max_qo, int64_t max_kv, float scale, float out_mul, void *out, int out_act) {
    int64_t group = Hq / Hkv, chunks = max_kv > 0 ? (max_kv + CHUNK - 1) / CHUNK : 1, width = max_kv > 0 ? max_kv : 1;
    int64_t slab = T < SLAB ? T : SLAB;
    float *o_all = (float *)malloc(T * Hq * Dv * sizeof(float));
    float *part = (float *)malloc(slab * Hq * chunks * (Dv + 2) * sizeof(float));
    float *top = part + slab * Hq * chunks * Dv, *sum = top + slab * Hq * chunks; /* [slab, Hq, chunks] */
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
                        attend_chunk(qs, R, group, D, Dv, (const char *)k_cache, (const char *)v_cache, kv, Hkv, g,
                                     run, run_n, scale, scores, part, top, sum, heads, chunks);
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
                float m = MASKED, total = 0.f, *o = o_all + (t0 * Hq + uh) * Dv;
                const float *tp = top + uh * chunks, *sp = sum + uh * chunks, *pp = part + uh * chunks * Dv;
                for (int64_t c = 0; c < used; c++) m = tp[c] > m ? tp[c] : m;
                memset(o, 0, Dv * sizeof(float));
                for (int64_t c = 0; c < used; c++) {
                    float w = expf(tp[c] - m);
                    total += w * sp[c];
                    for (int64_t d = 0; d < Dv; d++) o[d] += w * pp[c * Dv + d];
                }
                float inv = used ? 1.f / total : 0.f; /* total >= 1 (the top chunk's exp(0) x its sum >= 1) */
                for (int64_t d = 0; d < Dv; d++) o[d] *= inv;
                if (out_mul != 1.f)
                    for (int64_t d = 0; d < Dv; d++) o[d] *= out_mul;
            }
            free(scores);
        }
    }
    for (int64_t t = 0; t < T; t++)
        store_row(o_all + t * Hq * Dv, Hq * Dv, (char *)out + t * Hq * Dv * (out_act ? 2 : 4), out_act);
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
