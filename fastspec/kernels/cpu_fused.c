/* fastspec's fused CPU kernels for one decoder layer's work between its GEMMs (see cpu_fused.py, which holds a torch
 * twin of every function; cpu_library builds this file with the system C compiler), attention aside
 * (cpu_attention.c). Float32 math; `act` names the dtype of a GEMM-side tensor (cpu_rows.h). Single-threaded; the
 * GEMMs and attention split between torch's OpenMP threads (libgomp is already loaded by torch). Built with
 * -ffast-math (vectorised expf and reductions): nothing relies on infinities or NaN; a NaN is not kept. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_rows.h"

static inline int is_nan(float f) { /* by its bits: -ffast-math lets the compiler assume f == f */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
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
 * (k_cache, v_cache [num_slots, Hkv, D] in dtype code `kv`, as cpu_rows.h rounds), the rotated q to q_out float32
 * [T, Hq, D]. cos, sin float32 [T, D]: sin's first half negated, so rotated[d] = x[d] cos[d] + x[(d + D/2) % D] sin[d].
 * kv_mul: NULL, or float32 [2]: K and V are multiplied by kv_mul[0] / kv_mul[1] before they are rounded (1 / the
 * checkpoint's k_scale / v_scale of an fp8 cache; fastspec.memory.kv_pool).
 */
void rope_write(const void *qkv, int act, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos,
                const float *sin, const int64_t *slots, void *k_cache, void *v_cache, int kv, const float *kv_mul,
                float *q_out) {
    int64_t width = (Hq + 2 * Hkv) * D, half = D / 2, size = code_size(kv);
    float *row = (float *)malloc((width + Hkv * D) * sizeof(float)), *k = row + width, *v = row + (Hq + Hkv) * D;
    for (int64_t t = 0; t < T; t++) {
        load_row((const char *)qkv + t * width * (act ? 2 : 4), act, width, row);
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            const float *x = row + h * D;
            float *dst = h < Hq ? q_out + (t * Hq + h) * D : k + (h - Hq) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = x[d] * c[d] + x[(d + half) % D] * s[d];
        }
        if (kv_mul)
            for (int64_t e = 0; e < Hkv * D; e++) k[e] *= kv_mul[0], v[e] *= kv_mul[1];
        store_row(k, Hkv * D, (char *)k_cache + slots[t] * Hkv * D * size, kv);
        store_row(v, Hkv * D, (char *)v_cache + slots[t] * Hkv * D * size, kv);
    }
    free(row);
}

/* The indices of the k largest values of each row of x [M, V] (rows `stride` floats apart) into out int64 [M, k], in
 * no particular order (a min-heap of k per row, one pass; a tie goes to the lower index; a NaN is never taken). Once
 * the heap is full, runs of 16 values none of which beats its smallest are passed over at once. */
void top_k(const float *x, int64_t M, int64_t V, int64_t stride, int64_t k, int64_t *out) {
#pragma omp parallel for schedule(static) if (M > 1 && M * V >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * stride;
        int64_t *heap = out + m * k, n = 0; /* heap[0]: the smallest kept value's index */
        for (int64_t j = 0; j < V; j++) {
            if (n == k && j % 16 == 0 && j + 16 <= V) { /* (a NaN may read as larger here: it is then looked at) */
                float floor = row[heap[0]];
                int larger = 0;
                for (int i = 0; i < 16; i++) larger |= row[j + i] > floor;
                if (!larger) {
                    j += 15;
                    continue;
                }
            }
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

/* The index of each row's largest value into out int64 [M] (rows `stride` floats apart): the first of equal ones,
 * and, as torch's argmax, the first NaN where a row has one. */
void argmax_rows(const float *x, int64_t M, int64_t V, int64_t stride, int64_t *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * stride;
        const uint32_t *bits = (const uint32_t *)row;
        uint32_t worst = 0; /* the largest magnitude's bits: above an infinity's only for a NaN */
        for (int64_t j = 0; j < V; j++) worst = (bits[j] & 0x7fffffffu) > worst ? bits[j] & 0x7fffffffu : worst;
        int64_t at = 0;
        if (worst > 0x7f800000u) {
            while (!is_nan(row[at])) at++;
        } else {
            float best = row[0];
            for (int64_t j = 1; j < V; j++) best = row[j] > best ? row[j] : best;
            while (row[at] != best) at++;
        }
        out[m] = at;
    }
}

/* out [M, k] = each row of x [M, H] dotted with the k table rows ids [M, k] names, each row dequantised as w = q *
 * scale + offset per group of g values (q int8 [V, H], scale / offset float32 [V, H / g]): a vocabulary table's
 * exact logits for a few tokens. */
void rescore(const int8_t *q, const float *scale, const float *offset, int64_t H, int64_t g, const int64_t *ids,
             int64_t M, int64_t k, const float *x, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < k; i++) {
            int64_t id = ids[m * k + i];
            const int8_t *row = q + id * H;
            const float *xs = x + m * H;
            float acc = 0.f;
            for (int64_t c = 0; c < H / g; c++) {
                float sc = scale[id * (H / g) + c], off = offset[id * (H / g) + c], part = 0.f;
                for (int64_t e = c * g; e < (c + 1) * g; e++) part += ((float)row[e] * sc + off) * xs[e];
                acc += part;
            }
            out[m * k + i] = acc;
        }
}

int block_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, int64_t N, float *y,
               int64_t bits, int64_t group, const int8_t *levels);
void attend(const float *q, const void *k_cache, const void *v_cache, int kv, int64_t T, int64_t Hq, int64_t Hkv,
            int64_t D, int64_t Dv, const int64_t *out_index, const int64_t *kv_slots, const uint8_t *mask,
            int64_t max_qo, int64_t max_kv, float scale, float out_mul, void *out, int out_act); /* cpu_attention.c */

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

/* A Llama-family layer stack on 4- / 8-bit weights (cpu_q4.c) in one call: per layer the four GEMMs, the kernels
 * above and attend (cpu_attention.c), in the order fastspec.models.fused_cpu.fused_layers runs them (its Python loop
 * is this function's twin, bit for bit). All float32 but the KV caches.
 * layers int64 [L, 29]: addresses of qkv's packed weight and scales, o's, gate_up's, down's, the post-attention
 * norm's weight and the next layer's input norm's weight (0 after the last layer), the four linears' bit widths (4,
 * 5, 6 or 8: which of cpu_q4.c's kernels runs each), the addresses of their input orders (int64 [K], 0: in order),
 * of their 4-bit levels (int8 [16], 0: none), of qkv's bias (float32 [width], 0: none: Qwen2's) and of the q and k
 * head norms' weights (float32 [D] each, 0: none: Qwen3's), then the four linears' weight groups (values per scale:
 * 16 or 32); k, v: the KV pool's [L, num_slots, Hkv, D] caches in dtype code kv
 * (layer i's at i * layer_stride elements). x [T, H]: the residual stream entering layer 0, replaced by the last
 * layer's output; h [T, H]: layer 0's normed input. capture_at int64 [L]: for layer i > 0, the row of `captured`
 * [n, T, H] receiving the stream entering it, or -1. kv_scales: NULL, or float32 [L, 4] for a cache with a
 * checkpoint's KV scales: per layer attend's scale and rope_write's kv_mul[2] and attend's out_mul (in place of
 * `scale`, none and 1). The rest as rope_write and attend take them.
 * Returns 0, or -1 where memory could not be had. */
int decoder_stack(int64_t L, const int64_t *layers, void *k, void *v, int kv, int64_t layer_stride, float *x,
                  const float *h0, int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, float eps,
                  const float *cos, const float *sin, const int64_t *slots, const int64_t *out_index,
                  const int64_t *kv_slots, const uint8_t *mask, int64_t max_qo, int64_t max_kv, float scale,
                  const float *kv_scales, const int64_t *capture_at, float *captured) {
    int64_t width = (Hq + 2 * Hkv) * D, layer_bytes = layer_stride * code_size(kv);
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
        char *k_cache = (char *)k + i * layer_bytes, *v_cache = (char *)v + i * layer_bytes;
        status |= layer_gemm(w, 0, h, T, H, width, qkv, scratch);
        if (w[22])
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = 0; c < width; c++) qkv[t * width + c] += ((const float *)w[22])[c];
        if (w[23]) head_norms(qkv, 0, T, Hq, Hkv, D, (const float *)w[23], (const float *)w[24], eps);
        const float *ks = kv_scales ? kv_scales + 4 * i : NULL; /* (attend's scale, K's and V's muls, out_mul) */
        rope_write(qkv, 0, T, Hq, Hkv, D, cos, sin, slots, k_cache, v_cache, kv, ks ? ks + 1 : NULL, q);
        attend(q, k_cache, v_cache, kv, T, Hq, Hkv, D, D, out_index, kv_slots, mask, max_qo, max_kv,
               ks ? ks[0] : scale, ks ? ks[3] : 1.f, o, 0);
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
