/* One decode step's token choice per row of fp32 logits, without top-k or top-p: the native rollout's cpu_sampling.py.
 *
 * Per row, two passes over the vocabulary and a third over one block of it:
 *   1. m = max of the scaled logits s = z / temperature (and, greedy, the first index holding it);
 *   2. the exp(s - m) summed in fp64 per block of BLOCK tokens (kept) and over the row: lse = m + log(total);
 *   3. sampling: the inverse CDF in block order: the first block whose running sum passes u * total, then the first
 *      token in it whose running sum does (a token of zero probability never raises the sum, so it is never drawn).
 * The reported log-prob is s[token] - lse in fp64, rounded once to fp32.
 *
 * The exp of a block is always the one function below (not inlined, every call BLOCK elements, a short block padded
 * with -inf), so passes 2 and 3 see the same bits whatever the compiler vectorised. A row holding a NaN or a +inf, or
 * only -inf, is flagged (bad[row] = 1) and left to torch's path by the caller.
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
            double acc = 0.0;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < BLOCK; i++) acc += (double)e[i];
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
