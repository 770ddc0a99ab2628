/* A speculative round's tree bookkeeping on CPU in one call each: building an EAGLE tree's verify inputs from the
 * drafted candidates, and the greedy walk down it. Twins: fastspec/kernels/tree_build.py
 * (build_tree_kernel_efficient, QLEN_ONLY mask) and fastspec/kernels/verify.py (verify_tree_greedy); tested equal
 * to them. A tree is a few dozen nodes, so every loop here is plain and single-threaded: what it saves is the ~100
 * torch ops (each a few microseconds of dispatch) the vectorised twins take.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* Node p >= 1 is candidate g = selected[p - 1] (ascending ids); its parent candidate is parent_list[g / topk], the
 * root where g / topk == 0, none (an orphan hanging under the root only) where that candidate was not selected. */
static int64_t parent_position(const int64_t *parent_list, int64_t P, const int64_t *selected, int64_t n, int64_t g,
                               int64_t topk) {
    int64_t pidx = g >= 0 ? g / topk : -((topk - 1 - g) / topk); /* floor, as torch's // */
    if (pidx == 0) return 0;
    if (P == 0) return -1;
    int64_t want = parent_list[pidx < 0 ? 0 : pidx >= P ? P - 1 : pidx];
    for (int64_t j = 0; j < n - 1; j++)
        if (selected[j] == want) return j + 1;
    return -1;
}

/* Per request b (parent_list [bs, P], selected [bs, n-1], seq_lens [bs]): mask bool [bs, n, n] (row t: the root,
 * t's ancestors and t), positions [bs*n] (seq_len + depth), index [bs, n] (flat row b*n + t), next_token (first
 * child, -1 for a leaf) and next_sibling (next position with the same parent, -1 for the last) [bs, n]. */
void eagle_tree(const int64_t *parent_list, int64_t P, const int64_t *selected, const int64_t *seq_lens, int64_t bs,
                int64_t n, int64_t topk, bool *mask, int64_t *positions, int64_t *index, int64_t *next_token,
                int64_t *next_sibling) {
    int64_t parent[n];
    for (int64_t b = 0; b < bs; b++) {
        const int64_t *sel = selected + b * (n - 1);
        parent[0] = -1;
        for (int64_t p = 1; p < n; p++) parent[p] = parent_position(parent_list + b * P, P, sel, n, sel[p - 1], topk);
        bool *rows = mask + b * n * n;
        memset(rows, 0, (size_t)(n * n));
        for (int64_t t = 0; t < n; t++) {
            int64_t depth = 0;
            rows[t * n] = true;
            for (int64_t a = t, hops = 0; a >= 0 && hops < n; a = parent[a], hops++) { /* bounded: any input ends */
                depth += a > 0 && !rows[t * n + a];
                rows[t * n + a] = true;
            }
            positions[b * n + t] = seq_lens[b] + depth;
            index[b * n + t] = b * n + t;
            next_token[b * n + t] = next_sibling[b * n + t] = -1;
            for (int64_t c = n - 1; c >= 0; c--) {
                if (parent[c] == t) next_token[b * n + t] = c;
                if (c > t && parent[t] >= 0 && parent[c] == parent[t]) next_sibling[b * n + t] = c;
            }
        }
    }
}

/* The greedy walk (candidates, index, next_token, next_sibling [bs, n] as eagle_tree writes them; predict [bs*n] the
 * target's token after each flat verify row): from the root, accept the first child in sibling order whose token is
 * the target's next token, up to S levels. accept_index / emitted int64 [bs, S+1] (-1 past the run): the accepted
 * nodes' flat rows, root first, and the token the target emits after each (the last is the bonus); accept_len [bs]
 * the accepted draft tokens. */
void greedy_walk(const int64_t *candidates, const int64_t *index, const int64_t *next_token,
                 const int64_t *next_sibling, const int64_t *predict, int64_t bs, int64_t n, int64_t S,
                 int64_t *accept_index, int64_t *accept_len, int64_t *emitted) {
    for (int64_t b = 0; b < bs; b++) {
        const int64_t *tok = candidates + b * n, *idx = index + b * n;
        const int64_t *first = next_token + b * n, *sibling = next_sibling + b * n;
        int64_t *ai = accept_index + b * (S + 1), *em = emitted + b * (S + 1);
        for (int64_t j = 0; j <= S; j++) ai[j] = em[j] = -1;
        int64_t cur = 0, last = idx[0], num = 0;
        ai[0] = last;
        for (int64_t step = 1; step <= S; step++) {
            int64_t want = predict[last], child = first[cur];
            for (int64_t hops = 0; child >= 0 && hops < n && tok[child] != want; hops++) child = sibling[child];
            if (child < 0 || tok[child] != want) break;
            em[num++] = want;
            cur = child;
            last = ai[step] = idx[child];
        }
        em[num] = predict[last];
        accept_len[b] = num;
    }
}
