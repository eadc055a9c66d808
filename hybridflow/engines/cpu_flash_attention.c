/* Causal attention over packed rows on CPU in fp32, forward and backward: the training engine's packed attention
 * (cpu_flash_attention.py).
 *
 * The tokens of several rows are packed one after another: row r is tokens [cu[r], cu[r + 1]), and attends causally
 * within itself only (a block-diagonal causal mask, never materialised). Query heads H share key/value heads G
 * (H / G query heads per key/value head). q, k, v, the output's gradient: element (t, h, d) at t * st + h * sh + d
 * (the projections' [T, H, D] rows, or transformers' transposed view of them); out, dq: [T, H, D] contiguous; dk,
 * dv: [T, G, D] contiguous; lse (the log-sum-exp of each query's scaled scores) and delta: [H, T].
 *
 * Everything is small matrix products, C = alpha A B (+ C), A [m, k] read with any two strides (so a transposed A is
 * read in place), B [k, n] with rows of n contiguous floats, n a multiple of the vector width. A register block of
 * up to MR rows of C by NV vectors of columns keeps its sums in registers over the whole k loop: per k, NV loads of
 * B, one broadcast of A per row and MR x NV FMAs.
 *
 * Forward: one task per (row, query head, block of BQ queries). The block's scores against the keys it can see
 * (keys [0, last query of the block], read from a transposed copy of the keys, kt [G][D][ldkt], made once per call)
 * are one product; a softmax per query over its own causal prefix; then one product with the values. The
 * log-sum-exp is kept for the backward.
 *
 * Backward: one task per (row, key/value head), which owns that head's dk and dv rows (no two tasks write the same
 * gradient). Per query head of the group and block of queries: the probabilities are recomputed from the scores
 * and the log-sum-exp, dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO * O), then dV += P^T dO,
 * dK += scale dS^T Q and dQ = scale dS K.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VBYTES 64
#define NV 4
#elif defined(__AVX__)
#define VBYTES 32
#define NV 2
#else
#define VBYTES 16
#define NV 2
#endif
#define VEC (VBYTES / 4)
#define MR 6
typedef float vf __attribute__((vector_size(VBYTES)));
typedef int32_t vi __attribute__((vector_size(VBYTES)));

static inline vf vld(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline void vst(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf vbc(float x) { return (vf){0} + x; }
static inline vi vbcl(long x) { return (vi){0} + (int32_t)x; }
/* 0, 1, ..., VEC - 1 */
static const vi lane = {0, 1, 2, 3
#if VEC > 4
                        , 4, 5, 6, 7
#endif
#if VEC > 8
                        , 8, 9, 10, 11, 12, 13, 14, 15
#endif
};
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

int flash_attention_vector_width(void) { return VEC; }

/* e^x for x <= 0 (scores minus their maximum), x = n ln2 + r with n the nearest integer, |r| <= ln2 / 2; e^r by
 * its degree-6 Taylor polynomial (relative error under 2e-7 there), 2^n built in the exponent bits. Below -87 the
 * result is e^-87 (~1.6e-38, under any sum it joins). */
static inline vf vexp(vf x) {
    x = vmax(x, vbc(-87.0f));
    vf n = __builtin_convertvector(__builtin_convertvector(x * vbc(1.44269504f) - vbc(0.5f), vi), vf);
    vf r = x - n * vbc(0.693145752f) - n * vbc(1.42860677e-6f);
    vf p = vbc(1.0f / 720) * r + vbc(1.0f / 120);
    p = p * r + vbc(1.0f / 24);
    p = p * r + vbc(1.0f / 6);
    p = p * r + vbc(0.5f);
    p = p * r + vbc(1.0f);
    p = p * r + vbc(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    __builtin_memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* C[mr, nv * VEC] = alpha * A B (+ C when accumulate): A(i, k) = A[i * am + k * ak], B rows ldb apart */
static inline __attribute__((always_inline)) void block(const int mr, const int nv, long K, const float *A, long am,
                                                        long ak, const float *B, long ldb, float *C, long ldc,
                                                        int accumulate, float alpha) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = (vf){0};
    for (long k = 0; k < K; k++) {
        vf b[NV];
        for (int j = 0; j < nv; j++) b[j] = vld(B + k * ldb + j * VEC);
        for (int i = 0; i < mr; i++) {
            vf a = vbc(A[i * am + k * ak]);
            for (int j = 0; j < nv; j++) acc[i][j] += a * b[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) {
            float *c = C + i * ldc + j * VEC;
            vf r = acc[i][j] * vbc(alpha);
            vst(c, accumulate ? vld(c) + r : r);
        }
}

typedef void (*block_fn)(long, const float *, long, long, const float *, long, float *, long, int, float);
#define BLOCK(R, N)                                                                                               \
    static void block_##R##_##N(long K, const float *A, long am, long ak, const float *B, long ldb, float *C,     \
                                long ldc, int accumulate, float alpha) {                                          \
        block(R, N, K, A, am, ak, B, ldb, C, ldc, accumulate, alpha);                                             \
    }
#if NV == 4
#define BLOCKS_OF(R) BLOCK(R, 1) BLOCK(R, 2) BLOCK(R, 3) BLOCK(R, 4)
#define ROW_OF(R) {0, block_##R##_1, block_##R##_2, block_##R##_3, block_##R##_4}
#else
#define BLOCKS_OF(R) BLOCK(R, 1) BLOCK(R, 2)
#define ROW_OF(R) {0, block_##R##_1, block_##R##_2, 0, 0}
#endif
BLOCKS_OF(1) BLOCKS_OF(2) BLOCKS_OF(3) BLOCKS_OF(4) BLOCKS_OF(5) BLOCKS_OF(6)
static const block_fn BLOCKS[MR + 1][5] = {{0}, ROW_OF(1), ROW_OF(2), ROW_OF(3), ROW_OF(4), ROW_OF(5), ROW_OF(6)};

static inline long round_up(long x) { return (x + VEC - 1) / VEC * VEC; }

/* What of a product the causal mask leaves: the scores of query `diag` + i against key j are kept for j <= diag + i,
 * so a row block's products past its last query's keys are zeros (their probabilities are) and are skipped. */
enum causal {
    ALL,         /* every product */
    QUERY_COLS,  /* C rows are queries diag + i, C columns are keys: a row block's columns up to its last query's */
    QUERY_DEPTH, /* C rows are queries diag + i, k runs over keys: k up to the row block's last query */
    KEY_ROWS,    /* C rows are keys j, k runs over queries diag + k: a row block's k from its first key's query on */
};

/* C[m, n] = alpha * A[m, K] B[K, n] (+ C), n a multiple of VEC, with what `causal` skips */
static void gemm(long m, long n, long K, const float *A, long am, long ak, const float *B, long ldb, float *C,
                 long ldc, int accumulate, float alpha, enum causal causal, long diag) {
    for (long j0 = 0; j0 < n; j0 += NV * VEC) {
        for (long i0 = 0; i0 < m; i0 += MR) {
            const int mr = (int)(m - i0 < MR ? m - i0 : MR);
            long k0 = 0, k1 = K, n1 = n;
            if (causal == QUERY_COLS && round_up(diag + i0 + mr) < n) n1 = round_up(diag + i0 + mr);
            if (j0 >= n1) continue;
            const int nv = (int)((n1 - j0) / VEC < NV ? (n1 - j0) / VEC : NV);
            if (causal == QUERY_DEPTH && diag + i0 + mr < K) k1 = diag + i0 + mr;
            if (causal == KEY_ROWS && i0 > diag) k0 = i0 - diag < K ? i0 - diag : K;
            BLOCKS[mr][nv](k1 - k0, A + i0 * am + k0 * ak, am, ak, B + k0 * ldb + j0, ldb, C + i0 * ldc + j0, ldc,
                           accumulate, alpha);
        }
    }
}

/* dst[d * ldd + j] = src[j * st + d] for j < L, d < D; columns [L, round_up(L)) zero */
static void transpose(const float *src, long st, long L, int D, float *dst, long ldd) {
    for (long j0 = 0; j0 < L; j0 += 16) {
        const long j1 = j0 + 16 < L ? j0 + 16 : L;
        for (int d = 0; d < D; d++)
            for (long j = j0; j < j1; j++) dst[d * ldd + j] = src[j * st + d];
    }
    for (int d = 0; d < D; d++)
        for (long j = L; j < round_up(L); j++) dst[d * ldd + j] = 0.0f;
}

/* Columns of query row i (of a block of m queries from query q0) that its products over the own keys read: up to
 * the last query of its MR-row block (gemm's QUERY_COLS and QUERY_DEPTH), rounded up to whole vectors */
static inline long row_columns(long q0, long i, long m) {
    const long end = (i / MR + 1) * MR;
    return round_up(q0 + (end < m ? end : m));
}

static inline vf row_max(const float *s, long seen, vf mv) {
    long j = 0;
    for (; j + VEC <= seen; j += VEC) mv = vmax(vld(s + j), mv);
    if (j < seen) mv = vmax(vselect(lane < vbcl(seen - j), vld(s + j), vbc(-3.0e38f)), mv);
    return mv;
}

/* s[j] = e^(s[j] - m) for j < seen, 0 for seen <= j < cols (cols a multiple of VEC); returns the sums' vector */
static inline vf row_exp(float *s, long seen, long cols, vf mb, vf sum) {
    for (long j = 0; j < cols; j += VEC) {
        vf e = vexp(vld(s + j) - mb);
        if (j + VEC > seen) e = vselect(lane < vbcl(seen - j), e, (vf){0});
        vst(s + j, e);
        sum += e;
    }
    return sum;
}

/* A query row's scores: s[0, lp) against the prefix keys (all seen; lpp = round_up(lp), the columns between are
 * padding), s[lpp, lpp + n_row) against its own keys, of which it sees [0, last]. Writes e^(score - max) there
 * (zero where it does not see), zeros on up to lpp + n (columns other rows' products may read), sets *inv to the
 * reciprocal of their sum (the caller scales the row's output by it, not the n_row probabilities) and returns the
 * log-sum-exp. */
static inline float softmax_row(float *s, long lp, long lpp, long last, long n_row, long n, float *inv) {
    vf mv = row_max(s + lpp, last + 1, row_max(s, lp, vbc(-3.0e38f)));
    float m = -3.0e38f;
    for (int l = 0; l < VEC; l++) m = mv[l] > m ? mv[l] : m;
    const vf mb = vbc(m);
    vf sum = row_exp(s + lpp, last + 1, n_row, mb, row_exp(s, lp, lpp, mb, (vf){0}));
    float total = 0.0f;
    for (int l = 0; l < VEC; l++) total += sum[l];
    *inv = 1.0f / total;
    for (long j = lpp + n_row; j < lpp + n; j += VEC) vst(s + j, (vf){0});
    return m + logf(total);
}

/* The probabilities and dS = P (dP - delta) of a query row from its scores s and dP = dO V^T in ds, laid out as in
 * softmax_row, given its log-sum-exp. */
static inline void backward_row(float *p, float *ds, long lp, long lpp, long last, long n_row, long n, float lse,
                                float delta) {
    const vf l = vbc(lse), dl = vbc(delta);
    for (int part = 0; part < 2; part++) {
        const long base = part ? lpp : 0, seen = part ? last + 1 : lp, cols = part ? n_row : lpp;
        for (long j = 0; j < cols; j += VEC) {
            vf pj = vexp(vld(p + base + j) - l);
            if (j + VEC > seen) pj = vselect(lane < vbcl(seen - j), pj, (vf){0});
            vst(p + base + j, pj);
            vst(ds + base + j, pj * (vld(ds + base + j) - dl));
        }
    }
    for (long j = lpp + n_row; j < lpp + n; j += VEC) { /* read by the key-row products of other blocks */
        vst(p + j, (vf){0});
        vst(ds + j, (vf){0});
    }
}

/* Transposed keys for the forward: kt[g][d][cu[0] .. cu[rows]), ldkt >= T + VEC (the padding past T zero) */
void flash_keys_transposed(long T, int G, int D, const float *k, long skt, long skh, float *kt, long ldkt,
                           int nthreads) {
    const long chunks = (T + 63) / 64;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int g = 0; g < G; g++)
        for (long c = 0; c < chunks; c++) {
            const long t0 = c * 64, t1 = t0 + 64 < T ? t0 + 64 : T;
            for (int d = 0; d < D; d++)
                for (long t = t0; t < t1; t++) kt[(g * (long)D + d) * ldkt + t] = k[t * skt + g * skh + d];
            if (t1 == T)
                for (int d = 0; d < D; d++)
                    for (long t = T; t < ldkt; t++) kt[(g * (long)D + d) * ldkt + t] = 0.0f;
        }
}

/* Sequences: seq[4 s .. 4 s + 3] = (qs, lq, ps, lp): queries qs .. qs + lq - 1, which attend to the prefix keys
 * ps .. ps + lp - 1 (all of them) and causally to their own keys (the same tokens as the queries). A packed row is
 * a sequence without prefix; a shared prompt is one, and each of its responses is a sequence with the prompt as
 * prefix. Groups of sequences, [group[i], group[i + 1]), hold every sequence whose keys a group's queries see (a
 * group's prefixes are own keys of its sequences): the backward runs a group as one task per key/value head. */

/* Sequences (or groups, with count and first) by their attention work, largest first */
static int *by_work(long n, const int64_t *seq, const int64_t *first) {
    int *order = malloc(sizeof(int) * (n > 0 ? n : 1));
    double *work = malloc(sizeof(double) * (n > 0 ? n : 1));
    for (long i = 0; i < n; i++) {
        order[i] = (int)i;
        work[i] = 0.0;
        for (long x = first ? first[i] : i; x < (first ? first[i + 1] : i + 1); x++)
            work[i] += (double)seq[4 * x + 1] * (seq[4 * x + 3] + 0.5 * seq[4 * x + 1]);
    }
    for (long a = 1; a < n; a++) { /* insertion sort: a micro-batch has tens to hundreds */
        int x = order[a];
        long b = a;
        while (b > 0 && work[order[b - 1]] < work[x]) {
            order[b] = order[b - 1];
            b--;
        }
        order[b] = x;
    }
    free(work);
    return order;
}

/* scratch: per thread BQ * ldS floats, ldS >= round_up(longest prefix) + round_up(longest sequence) */
void flash_forward_f32(long T, int nseq, const int64_t *seq, int H, int G, int D, int BQ, const float *q, long sqt,
                       long sqh, const float *kt, long ldkt, const float *v, long svt, long svh, float scale,
                       float *out, float *lse, float *scratch, long ldS, int nthreads) {
    int *order = by_work(nseq, seq, NULL);
    long *first = malloc(sizeof(long) * (nseq + 1)); /* first task of each sequence (in order): blocks x heads */
    first[0] = 0;
    for (int x = 0; x < nseq; x++) first[x + 1] = first[x] + (seq[4 * order[x] + 1] + BQ - 1) / BQ * H;
    const long tasks = first[nseq];
    const int per_group = H / G;
#pragma omp parallel num_threads(nthreads)
    {
        float *S = scratch + omp_get_thread_num() * (long)BQ * ldS;
        int x = 0;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < tasks; task++) {
            while (first[x + 1] <= task) x++;
            while (first[x] > task) x--;
            const int64_t *sq = seq + 4 * order[x];
            const long qs = sq[0], L = sq[1], ps = sq[2], lp = sq[3], lpp = round_up(lp), local = task - first[x];
            const int h = (int)(local % H), g = h / per_group;
            const long blocks = (L + BQ - 1) / BQ, i0 = (blocks - 1 - local / H) * BQ; /* the longest blocks first */
            const long m = L - i0 < BQ ? L - i0 : BQ, n = round_up(i0 + m);
            const float *Q = q + (qs + i0) * sqt + h * sqh, *KT = kt + g * (long)D * ldkt;
            float *O = out + (qs + i0) * H * D + h * D;
            if (lp) gemm(m, lpp, D, Q, sqt, 1, KT + ps, ldkt, S, ldS, 0, scale, ALL, 0);
            gemm(m, n, D, Q, sqt, 1, KT + qs, ldkt, S + lpp, ldS, 0, scale, QUERY_COLS, i0);
            float inv[BQ];
            for (long i = 0; i < m; i++)
                lse[h * T + qs + i0 + i] =
                    softmax_row(S + i * ldS, lp, lpp, i0 + i, row_columns(i0, i, m), n, inv + i);
            if (lp) gemm(m, D, lp, S, ldS, 1, v + ps * svt + g * svh, svt, O, (long)H * D, 0, 1.0f, ALL, 0);
            gemm(m, D, i0 + m, S + lpp, ldS, 1, v + qs * svt + g * svh, svt, O, (long)H * D, lp > 0, 1.0f,
                 QUERY_DEPTH, i0);
            for (long i = 0; i < m; i++) /* the softmax's normalisation, on the D outputs instead of the row */
                for (int d = 0; d < D; d += VEC) vst(O + i * H * D + d, vld(O + i * H * D + d) * vbc(inv[i]));
        }
    }
    free(first);
    free(order);
}

static void zero_rows(float *x, long rows, long stride, int D) {
    for (long j = 0; j < rows; j++) memset(x + j * stride, 0, sizeof(float) * D);
}

/* scratch: per thread (2 D + 2 BQ) * ldS floats, ldS as the forward's. dk and dv are overwritten. */
void flash_backward_f32(long T, const int64_t *seq, int ngroups, const int64_t *group, int H, int G, int D,
                        int BQ, const float *q, long sqt, long sqh, const float *k, long skt, long skh, const float *v,
                        long svt, long svh, const float *out, const float *dout, long sdt, long sdh, const float *lse,
                        float scale, float *dq, float *dk, float *dv, float *delta, float *scratch, long ldS,
                        int nthreads) {
    const int per_group = H / G;
    int *order = by_work(ngroups, seq, group);
    const long kvs = (long)G * D, qrow = (long)H * D;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                const float *o = out + (t * H + h) * D, *g = dout + t * sdt + h * sdh;
                float acc = 0.0f;
                for (int d = 0; d < D; d++) acc += o[d] * g[d];
                delta[h * T + t] = acc;
            }
        float *Kt = scratch + omp_get_thread_num() * (2L * D + 2L * BQ) * ldS, *Vt = Kt + D * ldS;
        float *P = Vt + D * ldS, *dS = P + BQ * ldS;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < (long)ngroups * G; task++) {
            const int gi = order[task / G], g = (int)(task % G);
            for (long x = group[gi]; x < group[gi + 1]; x++) {
                const int64_t *sq = seq + 4 * x;
                zero_rows(dk + sq[0] * kvs + g * D, sq[1], kvs, D);
                zero_rows(dv + sq[0] * kvs + g * D, sq[1], kvs, D);
                zero_rows(dk + sq[2] * kvs + g * D, sq[3], kvs, D);
                zero_rows(dv + sq[2] * kvs + g * D, sq[3], kvs, D);
            }
            long transposed = -1; /* the prefix now in Kt, Vt [0, lpp) */
            for (long x = group[gi]; x < group[gi + 1]; x++) {
                const int64_t *sq = seq + 4 * x;
                const long qs = sq[0], L = sq[1], ps = sq[2], lp = sq[3], lpp = round_up(lp);
                if (lp && ps != transposed) {
                    transpose(k + ps * skt + g * skh, skt, lp, D, Kt, ldS);
                    transpose(v + ps * svt + g * svh, svt, lp, D, Vt, ldS);
                    transposed = ps;
                }
                transpose(k + qs * skt + g * skh, skt, L, D, Kt + lpp, ldS);
                transpose(v + qs * svt + g * svh, svt, L, D, Vt + lpp, ldS);
                const float *Kp = k + ps * skt + g * skh, *Ko = k + qs * skt + g * skh;
                float *DKp = dk + ps * kvs + g * D, *DVp = dv + ps * kvs + g * D;
                float *DKo = dk + qs * kvs + g * D, *DVo = dv + qs * kvs + g * D;
                for (int h = g * per_group; h < (g + 1) * per_group; h++)
                    for (long i0 = 0; i0 < L; i0 += BQ) {
                        const long m = L - i0 < BQ ? L - i0 : BQ, n = round_up(i0 + m), keys = i0 + m;
                        const float *Q = q + (qs + i0) * sqt + h * sqh, *dO = dout + (qs + i0) * sdt + h * sdh;
                        float *dQ = dq + (qs + i0) * qrow + h * D;
                        if (lp) {
                            gemm(m, lpp, D, Q, sqt, 1, Kt, ldS, P, ldS, 0, scale, ALL, 0);
                            gemm(m, lpp, D, dO, sdt, 1, Vt, ldS, dS, ldS, 0, 1.0f, ALL, 0);
                        }
                        gemm(m, n, D, Q, sqt, 1, Kt + lpp, ldS, P + lpp, ldS, 0, scale, QUERY_COLS, i0);
                        gemm(m, n, D, dO, sdt, 1, Vt + lpp, ldS, dS + lpp, ldS, 0, 1.0f, QUERY_COLS, i0);
                        for (long i = 0; i < m; i++)
                            backward_row(P + i * ldS, dS + i * ldS, lp, lpp, i0 + i, row_columns(i0, i, m), n,
                                         lse[h * T + qs + i0 + i], delta[h * T + qs + i0 + i]);
                        /* dV += P^T dO; dK += scale dS^T Q; dQ = scale dS K: the prefix's keys, then the own */
                        if (lp) {
                            gemm(lp, D, m, P, 1, ldS, dO, sdt, DVp, kvs, 1, 1.0f, ALL, 0);
                            gemm(lp, D, m, dS, 1, ldS, Q, sqt, DKp, kvs, 1, scale, ALL, 0);
                            gemm(m, D, lp, dS, ldS, 1, Kp, skt, dQ, qrow, 0, scale, ALL, 0);
                        }
                        gemm(keys, D, m, P + lpp, 1, ldS, dO, sdt, DVo, kvs, 1, 1.0f, KEY_ROWS, i0);
                        gemm(keys, D, m, dS + lpp, 1, ldS, Q, sqt, DKo, kvs, 1, scale, KEY_ROWS, i0);
                        gemm(m, D, keys, dS + lpp, ldS, 1, Ko, skt, dQ, qrow, lp > 0, scale, QUERY_DEPTH, i0);
                    }
            }
        }
    }
    free(order);
}
