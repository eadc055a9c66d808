/* One decode step's token choice per row of fp32 logits: the native rollout's cpu_sampling.py.
 *
 * Without top-k or top-p (sample_rows_f32), per row two passes over the vocabulary and a third over one block of it:
 *   1. m = max of the scaled logits s = z / temperature (and, greedy, the first index holding it);
 *   2. the exp(s - m) summed in fp64 per block of BLOCK tokens (kept) and over the row: lse = m + log(total);
 *   3. sampling: the inverse CDF in block order: the first block whose running sum passes u * total, then the first
 *      token in it whose running sum does (a token of zero probability never raises the sum, so it is never drawn).
 * The reported log-prob is s[token] - lse in fp64, rounded once to fp32.
 *
 * The exp of a block is always the one function below (not inlined, every call BLOCK elements, a short block padded
 * with -inf), so passes 2 and 3 see the same bits whatever the compiler vectorised. Rows holding a NaN or a +inf, or
 * only -inf, are counted and left undecided; the caller reports them (sampling.py).
 *
 * Rows are independent: a row's result does not depend on the other rows or on the thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* glibc's vector expf (libmvec), which math.h declares only under -ffast-math: this file is built without it
 * (infinities and NaNs are checked, and s = z / temperature is a true division, as torch's), so it declares it */
#if defined(__x86_64__) && defined(__GLIBC__)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

#define BLOCK 64
#define PARALLEL_FROM 65536L /* logits from which a call splits its rows over threads */

/* out[i] = exp(s[i] - m), s = z * 1 or z / temperature, for BLOCK values */
__attribute__((noinline)) static void exp_block(const float *z, float temperature, int scaled, float m, float *out) {
    if (scaled) {
#pragma omp simd
        for (int i = 0; i < BLOCK; i++) out[i] = expf(z[i] / temperature - m);
    } else {
#pragma omp simd
        for (int i = 0; i < BLOCK; i++) out[i] = expf(z[i] - m);
    }
}

/* the max of s = z or z / temperature over V values (NaNs skipped: they show in the sum of pass 2) */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static float row_max(const float *z, long V, float temperature, int scaled) {
    v16 acc = (v16){0} - INFINITY;
    long i = 0;
    for (; i + 16 <= V; i += 16) {
        v16 x;
        __builtin_memcpy(&x, z + i, sizeof x);
        if (scaled) x = x / temperature;
        const v16i greater = x > acc;
        acc = (v16)(((v16i)x & greater) | ((v16i)acc & ~greater));
    }
    float m = -INFINITY;
    for (int j = 0; j < 16; j++) m = acc[j] > m ? acc[j] : m;
    for (; i < V; i++) {
        const float x = scaled ? z[i] / temperature : z[i];
        m = x > m ? x : m;
    }
    return m;
}

/* the exp of block b of a row of V logits into e[BLOCK], 0 past V. A short block's missing values are its first one
 * (exp of which is then dropped): a lane of -inf would take the vector expf's slow path for special inputs. */
static void row_block_exp(const float *z, long V, long b, float temperature, int scaled, float m, float *e) {
    long lo = b * BLOCK, n = V - lo < BLOCK ? V - lo : BLOCK;
    if (n == BLOCK) {
        exp_block(z + lo, temperature, scaled, m, e);
        return;
    }
    float pad[BLOCK];
    for (long i = 0; i < BLOCK; i++) pad[i] = z[lo + (i < n ? i : 0)];
    exp_block(pad, temperature, scaled, m, e);
    for (long i = n; i < BLOCK; i++) e[i] = 0.f;
}

/* the fp64 sum of a block's BLOCK exps in an order the source fixes (eight running sums, lane j taking elements
 * j, j + 8, ..., then added pairwise as written; this file has no fast math, so the compiler keeps that order however
 * it vectorises), so that every caller (the draws and the training engine's log-probs below) gets the same
 * normaliser for a row, bit for bit */
static inline __attribute__((always_inline)) double block_sum(const float *e) {
    double a[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (int i = 0; i < BLOCK; i += 8)
        for (int j = 0; j < 8; j++) a[j] += (double)e[i + j];
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* logits [R, V] (row stride ld); u [R] in [0, 1) (ignored when greedy); tokens [R]; log_probs [R]; block_sums
 * [R, ceil(V / BLOCK)] of scratch. Returns the number of rows left undecided (NaN, +inf, only -inf). */
long sample_rows_f32(long R, long V, const float *logits, long ld, float temperature, int greedy, const double *u,
                     int64_t *tokens, float *log_probs, double *block_sums, int nthreads) {
    const long blocks = (V + BLOCK - 1) / BLOCK;
    const int scaled = !greedy && temperature != 1.0f;
    long bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad) if (R > 1 && R * V >= PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        const float *z = logits + r * ld;
        double *sums = block_sums + r * blocks;
        float e[BLOCK];
        /* pass 1: the max; greedy: the first index holding it */
        const float m = row_max(z, V, temperature, scaled);
        long token = 0;
        if (greedy && !isnan(m))
            while (token < V - 1 && z[token] != m) token++;
        /* pass 2: per-block sums of exp(s - m) in fp64, and their total in block order */
        double total = 0.0;
        for (long b = 0; b < blocks; b++) {
            row_block_exp(z, V, b, temperature, scaled, m, e);
            const double acc = block_sum(e);
            sums[b] = acc;
            total += acc;
        }
        /* a NaN anywhere makes the total NaN; a +inf makes the max +inf; only -inf, the max -inf */
        if (isnan(total) || isnan(m) || isinf(m)) {
            bad++;
            continue;
        }
        const double lse = (double)m + log(total);
        if (!greedy) {
            /* pass 3: the first block where the running sum passes u * total, then the token in it; where u * total
             * reaches the total in rounding, the last drawable token */
            const double target = u[r] * total;
            double run = 0.0;
            long b = 0;
            while (b < blocks && run + sums[b] <= target) run += sums[b++];
            const int past_end = b == blocks;
            if (past_end)
                for (b = blocks - 1; sums[b] == 0.0; b--) {
                }
            row_block_exp(z, V, b, temperature, scaled, m, e);
            long last = -1, pick = -1;
            for (long i = 0; i < BLOCK && b * BLOCK + i < V; i++) {
                if (e[i] == 0.f) continue;
                last = i;
                run += (double)e[i];
                if (!past_end && run > target) {
                    pick = i;
                    break;
                }
            }
            /* the in-block running sum may round below the block's (vectorised) sum: its last drawable token */
            token = b * BLOCK + (pick >= 0 ? pick : last);
        }
        const float s = scaled ? z[token] / temperature : z[token];
        tokens[r] = token;
        log_probs[r] = (float)((double)s - lse);
    }
    return bad;
}

/* ---- Top-k and top-p: the same tokens as sorting the row, without sorting it ----
 *
 * sampling.py's filtered draw sorts the probabilities in descending order (equal values in index order), keeps the
 * first top_k, then the shortest prefix of those whose mass reaches top_p of theirs (of the whole row's without top-k),
 * and draws by inverse CDF in that order. Each of the three steps finds the first position, in that order, where a
 * running weight (a count for top-k, a mass for top-p and the draw) passes a target, among the positions up to the
 * previous step's cut. Here that position is found without a sort: e = exp(s - m) is in [0, 1], where a float's bits
 * order as its value, so
 *   1. one pass computes every e and a histogram of count and fp64 mass over its top bits (NB bins);
 *   2. the bins are walked from the top to the one where the running weight passes the target;
 *   3. that bin's elements (gathered once from the candidates, in index order) are walked the same way by their
 *      next bits, then their last bits; elements of equal value (all bits equal) are walked in index order.
 * Only the elements of the first step's bin and above are gathered (the candidates); later steps stay among them.
 * The masses are summed in a different order from the sorted cumulative sum, so a cut or a draw within rounding of
 * a boundary may land on the neighbouring token, as in the unfiltered kernel. */
#include <stdlib.h>
#include <string.h>

#define NB 2048        /* bins of e's bits 30..19 (e <= 1 has bits <= 0x3F800000: bin <= 2032) */
#define SHIFT1 19
#define NB2 2048       /* bits 18..8 */
#define NB3 256        /* bits 7..0 */

static inline uint32_t fbits(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
}
static inline float bitsf(uint32_t b) {
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* a cut: the element (bits, index) at which a step stopped; the set up to it is every element preceding it in
 * (value descending, index ascending) order and itself */
typedef struct {
    int set;
    uint32_t bits;
    long idx;
} Cut;

static inline int within(uint32_t bits, long idx, Cut lim) {
    return !lim.set || bits > lim.bits || (bits == lim.bits && idx <= lim.idx);
}

/* Among list[0..n) (elements as (bits << 32 | index), index order, all inside the limit, their bits equal above
 * the ones this level reads: 18..8 at level 1, 7..0 at level 2, none at level 3), the first element in sorted order
 * whose running weight (cum + its own) exceeds X. Returns 1 and the element, or 0 and cum advanced by the whole list
 * (rounding: the bin's sum said it crosses, its elements summed otherwise). */
static int walk_list(uint64_t *list, long n, uint64_t *tmp, int level, double X, int by_count, double *cum,
                     Cut *out, double *wsum, long *count) {
    if (level == 3) { /* equal values: index order */
        for (long i = 0; i < n; i++) {
            const uint32_t b = (uint32_t)(list[i] >> 32);
            const double w = by_count ? 1.0 : (double)bitsf(b);
            if (*cum + w > X) {
                *cum += w;
                *out = (Cut){1, b, (long)(list[i] & 0xffffffffu)};
                return 1;
            }
            *cum += w;
        }
        return 0;
    }
    /* wsum, count: this level's histogram, then the next level's (NB2 + NB3 entries from the row's scratch) */
    const int nb = level == 1 ? NB2 : NB3, shift = level == 1 ? 8 : 0, mask = nb - 1;
    for (int b = 0; b < nb; b++) wsum[b] = 0.0, count[b] = 0;
    for (long i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)(list[i] >> 32);
        const int b = (int)((bits >> shift) & mask);
        count[b]++;
        wsum[b] += (double)bitsf(bits);
    }
    for (int b = nb - 1; b >= 0; b--) {
        if (!count[b]) continue;
        const double w = by_count ? (double)count[b] : wsum[b];
        if (!(*cum + w > X)) {
            *cum += w;
            continue;
        }
        long m = 0;
        for (long i = 0; i < n; i++)
            if ((int)(((uint32_t)(list[i] >> 32) >> shift) & mask) == b) tmp[m++] = list[i];
        const double before = *cum;
        if (walk_list(tmp, m, tmp + m, level + 1, X, by_count, cum, out, wsum + nb, count + nb)) return 1;
        *cum = before + w; /* not crossed in rounding: on with the bin's own sum */
    }
    return 0;
}

typedef struct {
    const float *e;
    long V;
    const double *mass;
    const long *count;
    uint64_t *cand, *work;
    double *level_mass; /* walk_list's histograms */
    long *level_count;
    long ncand;
    int cand_bin; /* candidates: every element of bin >= cand_bin */
} RowState;

/* the first element, in sorted order among those within `lim`, whose running weight exceeds X: 1 and *out, or 0 */
static int find(RowState *st, Cut lim, double X, int by_count, Cut *out) {
    const int lbin = lim.set ? (int)(lim.bits >> SHIFT1) : 0;
    double cum = 0.0;
    for (int b = NB - 1; b >= lbin; b--) {
        if (!st->count[b]) continue;
        const int partial = lim.set && b == lbin;
        if (!partial) {
            const double w = by_count ? (double)st->count[b] : st->mass[b];
            if (!(cum + w > X)) {
                cum += w;
                continue;
            }
        }
        if (st->cand_bin < 0 || b < st->cand_bin) { /* gather this bin and every bin above it, once a row (a
                                                        * bin that does not cross in rounding may send a walk lower) */
            long n = 0;
            for (long i = 0; i < st->V; i++) {
                const uint32_t bits = fbits(st->e[i]);
                if ((int)(bits >> SHIFT1) >= b) st->cand[n++] = ((uint64_t)bits << 32) | (uint64_t)i;
            }
            st->ncand = n;
            st->cand_bin = b;
        }
        long m = 0;
        for (long i = 0; i < st->ncand; i++) {
            const uint32_t bits = (uint32_t)(st->cand[i] >> 32);
            const long idx = (long)(st->cand[i] & 0xffffffffu);
            if ((int)(bits >> SHIFT1) == b && within(bits, idx, lim)) st->work[m++] = st->cand[i];
        }
        const double before = cum;
        if (walk_list(st->work, m, st->work + m, 1, X, by_count, &cum, out, st->level_mass, st->level_count))
            return 1;
        if (!partial) cum = before + (by_count ? (double)st->count[b] : st->mass[b]);
    }
    return 0;
}

/* the mass of the elements up to `cut`, in the walk's order: the bins above its bin, then its bin's elements */
static double set_mass(const RowState *st, Cut cut) {
    const int lbin = (int)(cut.bits >> SHIFT1);
    double s = 0.0;
    for (int b = NB - 1; b > lbin; b--) s += st->mass[b];
    for (long i = 0; i < st->ncand; i++) {
        const uint32_t bits = (uint32_t)(st->cand[i] >> 32);
        if ((int)(bits >> SHIFT1) == lbin && within(bits, (long)(st->cand[i] & 0xffffffffu), cut))
            s += (double)bitsf(bits);
    }
    return s;
}

/* the last element in sorted order with a positive e: the smallest positive value, its largest index */
static long last_positive(const float *e, long V) {
    uint32_t low = 0xffffffffu;
    long idx = 0;
    for (long i = 0; i < V; i++) {
        const uint32_t bits = fbits(e[i]);
        if (bits != 0 && bits <= low) low = bits, idx = i;
    }
    return idx;
}

/* logits [R, V] (row stride ld); top_k (<= 0 or >= V: none); top_p (>= 1: none); u [R] in [0, 1). As
 * sample_rows_f32 for the draw sampling.py's _draw_filtered makes; the log-prob is the unfiltered distribution's, as
 * there. Returns the number of rows left undecided (NaN, +inf, only -inf), or -1 when its scratch (~36 bytes per
 * token and thread) could not be allocated. */
long sample_filtered_rows_f32(long R, long V, const float *logits, long ld, float temperature, long top_k,
                              double top_p, const double *u, int64_t *tokens, float *log_probs, int nthreads) {
    const int scaled = temperature != 1.0f;
    const int by_k = top_k > 0 && top_k < V;
    long bad = 0, no_memory = 0;
#pragma omp parallel num_threads(nthreads) if (R > 1 && R * V >= PARALLEL_FROM) reduction(+ : bad, no_memory)
    {
        float *e = malloc(sizeof(float) * (size_t)(V + BLOCK));
        uint64_t *cand = malloc(sizeof(uint64_t) * (size_t)V), *work = malloc(sizeof(uint64_t) * (size_t)V * 3);
        double *mass = malloc(sizeof(double) * (NB + NB2 + NB3));
        long *count = malloc(sizeof(long) * (NB + NB2 + NB3));
        const int ready = e && cand && work && mass && count;
#pragma omp for schedule(static)
        for (long r = 0; r < R; r++) {
            if (!ready) {
                no_memory++;
                continue;
            }
            const float *z = logits + r * ld;
            const float m = row_max(z, V, temperature, scaled);
            for (int b = 0; b < NB; b++) mass[b] = 0.0, count[b] = 0;
            /* the exps, their total (per block, as sample_rows_f32) and the histogram of count and mass */
            const long blocks = (V + BLOCK - 1) / BLOCK;
            double total = 0.0;
            for (long b = 0; b < blocks; b++) {
                float *eb = e + b * BLOCK;
                row_block_exp(z, V, b, temperature, scaled, m, eb);
                total += block_sum(eb);
                const long n = V - b * BLOCK < BLOCK ? V - b * BLOCK : BLOCK;
                for (long i = 0; i < n; i++) {
                    const int bin = (int)(fbits(eb[i]) >> SHIFT1);
                    if (bin < NB) { /* a NaN's bits land past the bins: the total flags its row */
                        count[bin]++;
                        mass[bin] += (double)eb[i];
                    }
                }
            }
            if (isnan(total) || isnan(m) || isinf(m)) {
                bad++;
                continue;
            }
            RowState st = {e, V, mass, count, cand, work, mass + NB, count + NB, 0, -1};
            Cut cut = {0, 0, 0}, next;
            double kept = total;
            if (by_k) { /* the top_k-th element in sorted order ends the set */
                find(&st, cut, (double)(top_k - 1), 1, &cut);
                kept = set_mass(&st, cut);
            }
            /* top-p: the first element whose running mass reaches top_p of the set's is the last one kept (the
             * first element always is); a target past the set's mass in rounding keeps the set */
            if (top_p < 1.0 && find(&st, cut, nextafter(top_p * kept, -INFINITY), 0, &next)) {
                cut = next;
                kept = set_mass(&st, cut);
            }
            long token;
            if (find(&st, cut, u[r] * kept, 0, &next))
                token = next.idx;
            else if (cut.set && cut.bits != 0) /* u * kept reached the set's mass in rounding: its last element */
                token = cut.idx;
            else /* the same, where the set is the row or runs into tokens of probability 0 */
                token = last_positive(e, V);
            const float s = scaled ? z[token] / temperature : z[token];
            tokens[r] = token;
            log_probs[r] = (float)((double)s - ((double)m + log(total)));
        }
        free(e), free(cand), free(work), free(mass), free(count);
    }
    return no_memory ? -1 : bad;
}

/* ---- The training engine's log-probs (hf_model.log_probs_from_logits on CPU) ----
 *
 * log p(t) = s[t] - lse with lse = m + log(total) summed as sample_rows_f32 sums it (the max, then the exps per block
 * of BLOCK in fp64 by block_sum, the blocks in order) and the difference rounded once to fp32: for the same logits
 * the value the draws report, bit for bit (s is already divided by the temperature: the caller's z / T is the same
 * fp32 division as the draws'). A row whose max is +-inf gets lse = that max (torch's logsumexp), so a row of only
 * -inf gives NaN, as torch's formula does. Forward: the row's max, then its exps (two passes, no [R, V] buffer);
 * backward: one pass writing d[r, j] = g[r] * ([j == t] - exp(s[j] - lse)). Rows are independent of each other and
 * of the thread count. */

/* sum_i e[i] z[i] over a block's n <= BLOCK values in fp64, in block_sum's fixed order (eight running sums, then
 * pairwise); a value of probability 0 adds nothing (a -inf logit would give 0 * -inf) */
static inline __attribute__((always_inline)) double block_weighted_sum(const float *e, const float *z, long n) {
    double a[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    if (n == BLOCK) {
        for (int i = 0; i < BLOCK; i += 8)
            for (int j = 0; j < 8; j++) a[j] += (double)e[i + j] * (double)(e[i + j] != 0.f ? z[i + j] : 0.f);
    } else {
        for (long i = 0; i < n; i++) a[i % 8] += (double)e[i] * (double)(e[i] != 0.f ? z[i] : 0.f);
    }
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* logits s [R, V] (row stride ld), targets [R] -> log_probs [R], lse [R] (fp64, for the backward); with entropy
 * (else NULL) also entropy [R] = lse - sum_j p_j s[j] and mean_s [R] = that sum (fp64, for the backward), the sum
 * taken in the same pass over the exps, in fp64 (tokens of probability 0 add nothing). Returns the number of targets
 * outside [0, V) (those rows are not computed). */
long log_probs_f32(long R, long V, const float *s, long ld, const int64_t *targets, float *log_probs, double *lse,
                   float *entropy, double *mean_s, int nthreads) {
    long bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad) if (R > 1 && R * V >= PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        const float *z = s + r * ld;
        const int64_t t = targets[r];
        if (t < 0 || t >= V) {
            bad++;
            continue;
        }
        float e[BLOCK];
        const float m = row_max(z, V, 1.0f, 0);
        const long blocks = (V + BLOCK - 1) / BLOCK;
        double total = 0.0, weighted = 0.0;
        for (long b = 0; b < blocks; b++) {
            row_block_exp(z, V, b, 1.0f, 0, m, e);
            total += block_sum(e);
            if (entropy)
                weighted += block_weighted_sum(e, z + b * BLOCK, V - b * BLOCK < BLOCK ? V - b * BLOCK : BLOCK);
        }
        const double l = isinf(m) ? (double)m : (double)m + log(total);
        lse[r] = l;
        log_probs[r] = (float)((double)z[t] - l);
        if (entropy) {
            const double ms = isinf(m) ? NAN : weighted / total;
            mean_s[r] = ms;
            entropy[r] = (float)(l - ms);
        }
    }
    return bad;
}

/* d [R, V] (row stride ldd) = the gradient of log_probs_f32's outputs weighted by g [R] (the log-probs) and, when
 * not NULL, g_entropy [R]: g[r] ([j == t] - p_j) + g_entropy[r] p_j (mean_s[r] - s[j]), p_j = exp(s[j] - lse) with
 * lse and mean_s rounded to fp32 (torch's backward of its formulas is fp32 throughout). Compiled for 512-bit vectors
 * where the CPU has them (compilers prefer 256 there): the 16-lane vector expf; the draws keep exp_block's 8 lanes
 * (their bits, and their speed, as they were). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((target("prefer-vector-width=512")))
#endif
void log_probs_backward_f32(long R, long V, const float *s, long ld, const int64_t *targets, const double *lse,
                            const float *g, const float *g_entropy, const double *mean_s, float *d, long ldd,
                            int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 1 && R * V >= PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        const float *z = s + r * ld;
        float *dr = d + r * ldd;
        const float l = (float)lse[r], gr = g[r], gh = g_entropy ? g_entropy[r] : 0.f;
        if (gh == 0.f) {
#pragma omp simd
            for (long j = 0; j < V; j++) dr[j] = -gr * expf(z[j] - l);
        } else {
            const float ms = (float)mean_s[r];
#pragma omp simd
            for (long j = 0; j < V; j++) {
                const float p = expf(z[j] - l);
                dr[j] = p == 0.f ? 0.f : p * (gh * (ms - z[j]) - gr); /* a -inf logit: p = 0, no inf * 0 */
            }
        }
        dr[targets[r]] += gr;
    }
}
