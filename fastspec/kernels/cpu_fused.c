/* fastspec's fused CPU kernels for one decoder layer's work between its GEMMs (see cpu_fused.py, which builds this
 * file with the system C compiler and holds a torch twin of every function). Float32 math; `act` names the dtype
 * of a GEMM-side tensor: 0 float32, 1 bfloat16 (rounded to nearest even, as torch's .to(torch.bfloat16)).
 * Single-threaded, but attention over enough keys (on torch's OpenMP runtime: libgomp is already loaded by torch).
 * Built with -ffast-math (vectorised expf and reductions): nothing relies on infinities or NaN; a NaN is not kept. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* query rows x heads x keys below which attention runs on the calling thread (a decode step of 9 heads splits from
 * 57 keys on: waking the other threads costs less than that much work) */
#define PARALLEL_WORK 512
#define MASKED (-1e30f) /* below every score: finite, since the library is built with -ffast-math (vector expf) */

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int is_nan(float f) { /* by its bits: -ffast-math lets the compiler assume f == f */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void load_row(const void *src, int act, int64_t n, float *dst) {
    if (act) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

static void store_row(const float *src, int64_t n, void *dst, int act) {
    if (act) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

/* x_out = x (+ y); normed = w * (x_out * rsqrt(mean(x_out^2) + eps)), stored in `out_act`.
 * x, x_out float32 [T, H]; y [T, H] in y_act (NULL: no addend); w float32 [H]; normed [T, H]. */
void add_rms_norm(const float *x, const void *y, int y_act, const float *w, float eps, int64_t T, int64_t H,
                  float *x_out, void *normed, int out_act) {
    float *row = (float *)malloc(H * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *xo = x_out + t * H;
        if (y) {
            load_row((const char *)y + t * H * (y_act ? 2 : 4), y_act, H, row);
            for (int64_t i = 0; i < H; i++) xo[i] = xr[i] + row[i];
        } else if (xo != xr) {
            memcpy(xo, xr, H * sizeof(float));
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += xo[i] * xo[i];
        float r = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) row[i] = w[i] * (xo[i] * r);
        store_row(row, H, (char *)normed + t * H * (out_act ? 2 : 4), out_act);
    }
    free(row);
}

/* out = silu(gate) * up for gate_up [T, 2I] = [gate | up] in `act`; out [T, I] in `out_act`. */
void silu_mul(const void *gate_up, int act, int64_t T, int64_t I, void *out, int out_act) {
    float *g = (float *)malloc(2 * I * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        load_row((const char *)gate_up + t * 2 * I * (act ? 2 : 4), act, 2 * I, g);
        for (int64_t i = 0; i < I; i++) { /* sigmoid from exp(-|x|) <= 1: no overflow to infinity */
            float e = expf(-fabsf(g[i])), sigmoid = (g[i] >= 0.f ? 1.f : e) / (1.f + e);
            g[i] = g[i] * sigmoid * g[I + i];
        }
        store_row(g, I, (char *)out + t * I * (out_act ? 2 : 4), out_act);
    }
    free(g);
}

/* RMSNorm of each head of q and of k (Qwen3's q_norm / k_norm) in qkv [T, (Hq + 2 Hkv) * D] (in `act`), in place:
 * q's heads scaled by qw [D], k's by kw [D], as add_rms_norm scales a row. */
void head_norms(void *qkv, int act, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *qw, const float *kw,
                float eps) {
    int64_t width = (Hq + 2 * Hkv) * D;
    float *row = (float *)malloc((Hq + Hkv) * D * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        char *src = (char *)qkv + t * width * (act ? 2 : 4);
        load_row(src, act, (Hq + Hkv) * D, row);
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *x = row + h * D, ss = 0.f;
            const float *w = h < Hq ? qw : kw;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < D; d++) ss += x[d] * x[d];
            float r = 1.f / sqrtf(ss / (float)D + eps);
            for (int64_t d = 0; d < D; d++) x[d] = w[d] * (x[d] * r);
        }
        store_row(row, (Hq + Hkv) * D, src, act);
    }
    free(row);
}

/* Rotate-half rope on q and k of qkv [T, (Hq + 2 Hkv) * D] (in `act`), K and V written to the cache rows `slots`
 * (k_cache, v_cache float32 [num_slots, Hkv, D]), the rotated q to q_out float32 [T, Hq, D].
 * cos, sin float32 [T, D]: sin's first half negated, so rotated[d] = x[d] cos[d] + x[(d + D/2) % D] sin[d]. */
void rope_write(const void *qkv, int act, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos,
                const float *sin, const int64_t *slots, float *k_cache, float *v_cache, float *q_out) {
    int64_t width = (Hq + 2 * Hkv) * D, half = D / 2;
    float *row = (float *)malloc(width * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        load_row((const char *)qkv + t * width * (act ? 2 : 4), act, width, row);
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            const float *x = row + h * D;
            float *dst = h < Hq ? q_out + (t * Hq + h) * D : k_cache + (slots[t] * Hkv + h - Hq) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = x[d] * c[d] + x[(d + half) % D] * s[d];
        }
        memcpy(v_cache + slots[t] * Hkv * D, row + (Hq + Hkv) * D, Hkv * D * sizeof(float));
    }
    free(row);
}

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
#define LOAD(p) (*(const vec *)(p))

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

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d);
}

/* One chunk of one token for the `group` query heads q [group, D] of KV head g: its n <= CHUNK keys' (slots) scores,
 * their top score top[h], sum[h] = sum of exp(score - top) and part[h] [D] = sum of exp(score - top) v; heads h
 * `stride` floats apart in part, top and sum. scores: scratch [group, CHUNK]. Scores go LANES keys at a time (an
 * accumulator in a register each, summed across lanes together: sum_lanes), the weighted sum of V 4 vectors of
 * columns at a time; either way every key's K and V rows are read from cache once per head. */
static void attend_chunk(const float *q, int64_t group, int64_t D, const float *k_cache, const float *v_cache,
                         int64_t Hkv, int64_t g, const int64_t *slots, int64_t n, float scale, float *scores,
                         float *part, float *top, float *sum, int64_t stride) {
    const float *rows[CHUNK];
    int64_t padded = (n + LANES - 1) / LANES * LANES, body = D / LANES * LANES, block = 4 * LANES;
    for (int64_t a = 0; a < padded; a++) /* past n: the last key again, its scores dropped below */
        rows[a] = k_cache + (slots[a < n ? a : n - 1] * Hkv + g) * D;
    for (int64_t a0 = 0; a0 < padded; a0 += LANES) {
        for (int64_t a = a0 + AHEAD; a < a0 + LANES + AHEAD && a < n; a++) prefetch_row(rows[a], D);
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + h * D;
            vec acc[LANES] = {{0}};
            for (int64_t d = 0; d < body; d += LANES) {
                vec x = LOAD(qh + d);
                for (int j = 0; j < LANES; j++) acc[j] += x * LOAD(rows[a0 + j] + d);
            }
            vec dots = sum_lanes(acc);
            for (int64_t d = body; d < D; d++) /* a head dim that is not a multiple of LANES: the last columns */
                for (int j = 0; j < LANES; j++) dots[j] += qh[d] * rows[a0 + j][d];
            *(vec *)(scores + h * CHUNK + a0) = dots * scale;
        }
    }
    for (int64_t a = 0; a < n; a++) rows[a] = v_cache + (slots[a] * Hkv + g) * D;
    for (int64_t a = 0; a < n && a < AHEAD; a++) prefetch_row(rows[a], D);
    for (int64_t h = 0; h < group; h++) {
        float *p = scores + h * CHUNK, best = MASKED, *o = part + h * stride * D;
        for (int64_t a = 0; a < n; a++) best = p[a] > best ? p[a] : best;
#pragma omp simd
        for (int64_t a = 0; a < n; a++) p[a] = expf(p[a] - best);
        for (int64_t a = n; a < padded; a++) p[a] = 0.f;
        vec lanes = {0};
        for (int64_t a = 0; a < padded; a += LANES) lanes += LOAD(p + a);
        float s = 0.f;
        for (int l = 0; l < LANES; l++) s += lanes[l];
        top[h * stride] = best, sum[h * stride] = s;
        int64_t d = 0;
        for (; d + block <= D; d += block) {
            vec o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
            for (int64_t a = 0; a < n; a++) {
                const float *v = rows[a] + d;
                if (h == 0 && d == 0 && a + AHEAD < n) prefetch_row(rows[a + AHEAD], D);
                o0 += p[a] * LOAD(v), o1 += p[a] * LOAD(v + LANES);
                o2 += p[a] * LOAD(v + 2 * LANES), o3 += p[a] * LOAD(v + 3 * LANES);
            }
            *(vec *)(o + d) = o0, *(vec *)(o + d + LANES) = o1;
            *(vec *)(o + d + 2 * LANES) = o2, *(vec *)(o + d + 3 * LANES) = o3;
        }
        for (; d + LANES <= D; d += LANES) {
            vec o0 = {0};
            for (int64_t a = 0; a < n; a++) o0 += p[a] * LOAD(rows[a] + d);
            *(vec *)(o + d) = o0;
        }
        for (; d < D; d++) {
            float o0 = 0.f;
            for (int64_t a = 0; a < n; a++) o0 += p[a] * rows[a][d];
            o[d] = o0;
        }
    }
}

/* Attention of a dense padded plan (fastspec.attention.torch_backend.TorchAttnPlan): token t is query row
 * out_index[t] = b * max_qo + i; it sees key column j of request b (KV slot kv_slots[b, j]) where
 * mask[b, i, j] (mask NULL: every column). q float32 [T, Hq, D]; caches float32 [num_slots, Hkv, D];
 * out [T, Hq, D] in `out_act`. Query head h reads KV head h / (Hq / Hkv).
 * Batch-invariant: a token's output depends only on the keys it sees, in column order, not on the padding, the
 * masked columns or the other tokens, so a tree verify computes bit for bit what a decode step of the same token
 * would (the seen keys are gathered into a list first; its chunks and every sum over them run in a fixed order).
 * Work items are (KV head, chunk, token), tokens innermost: a verify's tokens share their prefix's chunks, which
 * are still in cache for the next token. */
void attend(const float *q, const float *k_cache, const float *v_cache, int64_t T, int64_t Hq, int64_t Hkv,
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
            float *scores = (float *)malloc(group * CHUNK * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t u = 0; u < tokens; u++)
                count[u] = seen_keys(t0 + u, out_index, kv_slots, mask, max_qo, max_kv, seen + u * width);
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < Hkv * chunks * tokens; item++) {
                int64_t g = item / (chunks * tokens), c = item / tokens % chunks, u = item % tokens;
                int64_t lo = c * CHUNK, n = count[u] - lo < CHUNK ? count[u] - lo : CHUNK;
                if (n <= 0) continue;
                int64_t head = (u * Hq + g * group) * chunks + c; /* (u, g's first head, c) in [slab, Hq, chunks] */
                attend_chunk(q + ((t0 + u) * Hq + g * group) * D, group, D, k_cache, v_cache, Hkv, g,
                             seen + u * width + lo, n, scale, scores, part + head * D, top + head, sum + head,
                             chunks);
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

/* The indices of the k largest values of each row of x [M, V] (rows `stride` floats apart) into out int64 [M, k], in
 * no particular order (a min-heap of k per row, one pass; a tie goes to the lower index; a NaN is never taken). */
void top_k(const float *x, int64_t M, int64_t V, int64_t stride, int64_t k, int64_t *out) {
#pragma omp parallel for schedule(static) if (M > 1 && M * V >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * stride;
        int64_t *heap = out + m * k, n = 0; /* heap[0]: the smallest kept value's index */
        for (int64_t j = 0; j < V; j++) {
            float v = row[j];
            if (is_nan(v)) continue;
            if (n < k) { /* sift up */
                int64_t c = n++;
                while (c > 0 && row[heap[(c - 1) / 2]] > v) {
                    heap[c] = heap[(c - 1) / 2];
                    c = (c - 1) / 2;
                }
                heap[c] = j;
            } else if (v > row[heap[0]]) { /* replace the smallest, sift down */
                int64_t c = 0;
                for (;;) {
                    int64_t l = 2 * c + 1, r = l + 1, s = c;
                    float sv = v;
                    if (l < k && row[heap[l]] < sv) s = l, sv = row[heap[l]];
                    if (r < k && row[heap[r]] < sv) s = r;
                    if (s == c) break;
                    heap[c] = heap[s];
                    c = s;
                }
                heap[c] = j;
            }
        }
        for (int64_t j = 0; n < k; j++) /* fewer than k numbers (NaNs): the first indices not taken */
            if (is_nan(row[j])) heap[n++] = j;
    }
}

int block_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, int64_t N, float *y,
               int64_t bits, int64_t group, const int8_t *levels);

/* y = x @ w.T for linear j (0 qkv, 1 o, 2 gate_up, 3 down) of a decoder_stack layer row (see below); where the
 * row names an input order (a GPTQ desc_act weight), x's columns are gathered into `scratch` [M, K] in it first */
static int layer_gemm(const int64_t *row, int j, const float *x, int64_t M, int64_t K, int64_t N, float *y,
                      float *scratch) {
    const uint16_t *scales = (const uint16_t *)row[2 * j + 1];
    const int64_t *perm = (const int64_t *)row[14 + j];
    if (perm) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t c = 0; c < K; c++) scratch[m * K + c] = x[m * K + perm[c]];
        x = scratch;
    }
    return block_gemm(x, M, K, (const uint8_t *)row[2 * j], scales, N, y, row[10 + j], row[25 + j],
                      (const int8_t *)row[18 + j]);
}

/* A Llama-family layer stack on 4- / 8-bit weights (cpu_q4.c) in one call: per layer the four GEMMs and the four
 * kernels above, in the order fastspec.models.fused_cpu.fused_layers runs them (its Python loop is this function's
 * twin, bit for bit). All float32.
 * layers int64 [L, 29]: addresses of qkv's packed weight and scales, o's, gate_up's, down's, the post-attention
 * norm's weight and the next layer's input norm's weight (0 after the last layer), the four linears' bit widths (4,
 * 5, 6 or 8: which of cpu_q4.c's kernels runs each), the addresses of their input orders (int64 [K], 0: in order),
 * of their 4-bit levels (int8 [16], 0: none), of qkv's bias (float32 [width], 0: none: Qwen2's) and of the q and k
 * head norms' weights (float32 [D] each, 0: none: Qwen3's), then the four linears' weight groups (values per scale:
 * 16 or 32); k, v: the KV pool's [L, num_slots, Hkv, D] caches
 * (layer i's at i * layer_stride floats). x [T, H]: the residual stream entering layer 0, replaced by the last
 * layer's output; h [T, H]: layer 0's normed input. capture_at int64 [L]: for layer i > 0, the row of `captured`
 * [n, T, H] receiving the stream entering it, or -1. The rest as rope_write and attend take them.
 * Returns 0, or -1 where memory could not be had. */
int decoder_stack(int64_t L, const int64_t *layers, float *k, float *v, int64_t layer_stride, float *x,
                  const float *h0, int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, float eps,
                  const float *cos, const float *sin, const int64_t *slots, const int64_t *out_index,
                  const int64_t *kv_slots, const uint8_t *mask, int64_t max_qo, int64_t max_kv, float scale,
                  const int64_t *capture_at, float *captured) {
    int64_t width = (Hq + 2 * Hkv) * D;
    float *h = (float *)malloc(T * H * sizeof(float)), *qkv = (float *)malloc(T * width * sizeof(float));
    float *q = (float *)malloc(T * Hq * D * sizeof(float)), *o = (float *)malloc(T * Hq * D * sizeof(float));
    float *gate_up = (float *)malloc(T * 2 * I * sizeof(float)), *act = (float *)malloc(T * I * sizeof(float));
    float *y = (float *)malloc(T * H * sizeof(float));
    int64_t widest = H > Hq * D ? H : Hq * D;
    float *scratch = (float *)malloc(T * (widest > I ? widest : I) * sizeof(float));
    int status = (h && qkv && q && o && gate_up && act && y && scratch) ? 0 : -1;
    if (status == 0) memcpy(h, h0, T * H * sizeof(float));
    for (int64_t i = 0; i < L && status == 0; i++) {
        const int64_t *w = layers + 29 * i;
        float *k_cache = k + i * layer_stride, *v_cache = v + i * layer_stride;
        status |= layer_gemm(w, 0, h, T, H, width, qkv, scratch);
        if (w[22])
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = 0; c < width; c++) qkv[t * width + c] += ((const float *)w[22])[c];
        if (w[23]) head_norms(qkv, 0, T, Hq, Hkv, D, (const float *)w[23], (const float *)w[24], eps);
        rope_write(qkv, 0, T, Hq, Hkv, D, cos, sin, slots, k_cache, v_cache, q);
        attend(q, k_cache, v_cache, T, Hq, Hkv, D, out_index, kv_slots, mask, max_qo, max_kv, scale, o, 0);
        status |= layer_gemm(w, 1, o, T, Hq * D, H, y, scratch);
        add_rms_norm(x, y, 0, (const float *)w[8], eps, T, H, x, h, 0);
        status |= layer_gemm(w, 2, h, T, H, 2 * I, gate_up, scratch);
        silu_mul(gate_up, 0, T, I, act, 0);
        status |= layer_gemm(w, 3, act, T, I, H, y, scratch);
        if (i + 1 == L) {
            for (int64_t e = 0; e < T * H; e++) x[e] += y[e];
        } else {
            add_rms_norm(x, y, 0, (const float *)w[9], eps, T, H, x, h, 0);
            if (capture_at[i + 1] >= 0) memcpy(captured + capture_at[i + 1] * T * H, x, T * H * sizeof(float));
        }
    }
    free(h), free(qkv), free(q), free(o), free(gate_up), free(act), free(y), free(scratch);
    return status;
}
