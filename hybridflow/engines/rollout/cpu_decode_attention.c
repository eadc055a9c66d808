/* One decode step of attention on CPU, one query token per row: the native rollout's cpu_attention.py kernel.
 *
 * Each (row, KV head) is one task: its G query heads are scored against the row's keys, one softmax, then the
 * values are summed with those weights. Keys and values are read once per task straight from the KV cache (no
 * gather, no copy of a strided slice), in fp32 or bf16 (accumulated in fp32).
 *
 * The keys of a row are one or two segments of the cache, concatenated: A (n = 1: the row's whole cache; shared
 * layout: its prompt's part, found through pa[row]) and B (shared layout: the row's own generated part; lenB = 0
 * otherwise). Keys are stored transposed, [head_dim][length] with a d-stride (kv_cache.py); values [length][D].
 * Column c of the concatenation is attended when c >= start[row] (left padding and sliding windows are both a
 * prefix of masked columns), so no mask is read.
 *
 * Layouts and strides are in elements. q and out: [rows, kv, G, D] contiguous. scratch: per thread
 * (2 * G * D + G * ldsc) floats, ldsc = (lenA + lenB) rounded up to 16.
 *
 * kN, vN (or NULL): this step's keys and values [rows, kv, D], written into the last column (of B, or of A when
 * lenB = 0) by the task that reads it next. The key column is strided by the cache length: written alone (torch's
 * copy, one thread) each element is a cache line fetched for one store; here the task reads that line anyway.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

typedef uint16_t bf16;

static inline float ld_f32(const float *p, long i) { return p[i]; }
static inline float ld_bf16(const bf16 *p, long i) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)p[i] << 16;
    return x.f;
}
static inline void st_f32(float *p, long i, float v) { p[i] = v; }
static inline void st_bf16(bf16 *p, long i, float v) {  /* round to nearest even, as torch's float -> bf16 */
    union { uint32_t u; float f; } x;
    x.f = v;
    p[i] = (bf16)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#define LB 32 /* key columns per register block of the scores */
#define DB 32 /* head_dim columns per register block of the output */

/* GB (1, 2 or 4) query heads at once, so each key column is loaded once for all of them. */
#define DEFINE_KERNEL(NAME, T, LD, ST)                                                                               \
    static inline __attribute__((always_inline)) void NAME##_scores(const int GB, int D, const float *qf, int g0,  \
                                                                   const T *K, long sd, int l0, int l1, float *sc, \
                                                                   int ldsc) {                                     \
        for (int lb = l0; lb < l1; lb += LB) {                                                                      \
            int n = l1 - lb < LB ? l1 - lb : LB;                                                                    \
            float acc[4][LB];                                                                                       \
            for (int g = 0; g < GB; g++)                                                                            \
                for (int j = 0; j < LB; j++) acc[g][j] = 0.f;                                                       \
            if (n == LB) {                                                                                          \
                for (int d = 0; d < D; d++) {                                                                       \
                    const T *Kd = K + d * sd + lb;                                                                  \
                    float kv[LB];                                                                                   \
                    for (int j = 0; j < LB; j++) kv[j] = LD(Kd, j);                                                 \
                    for (int g = 0; g < GB; g++) {                                                                  \
                        float qv = qf[(g0 + g) * D + d];                                                            \
                        for (int j = 0; j < LB; j++) acc[g][j] += qv * kv[j];                                       \
                    }                                                                                               \
                }                                                                                                   \
            } else {                                                                                                \
                for (int d = 0; d < D; d++) {                                                                       \
                    const T *Kd = K + d * sd + lb;                                                                  \
                    for (int g = 0; g < GB; g++) {                                                                  \
                        float qv = qf[(g0 + g) * D + d];                                                            \
                        for (int j = 0; j < n; j++) acc[g][j] += qv * LD(Kd, j);                                    \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            for (int g = 0; g < GB; g++)                                                                            \
                for (int j = 0; j < n; j++) sc[(g0 + g) * ldsc + lb + j] = acc[g][j];                               \
        }                                                                                                           \
    }                                                                                                               \
    static inline __attribute__((always_inline)) void NAME##_values(const int GB, int D, const float *p, int g0,   \
                                                                   int ldp, const T *V, int l0, int l1, float *o) { \
        for (int db = 0; db < D; db += DB) {                                                                        \
            int w = D - db < DB ? D - db : DB;                                                                      \
            float acc[4][DB];                                                                                       \
            for (int g = 0; g < GB; g++)                                                                            \
                for (int j = 0; j < DB; j++) acc[g][j] = 0.f;                                                       \
            for (int l = l0; l < l1; l++) {                                                                         \
                const T *Vl = V + (long)l * D + db;                                                                 \
                if (w == DB) {                                                                                      \
                    float vv[DB];                                                                                   \
                    for (int j = 0; j < DB; j++) vv[j] = LD(Vl, j);                                                 \
                    for (int g = 0; g < GB; g++) {                                                                  \
                        float pv = p[(g0 + g) * ldp + l];                                                           \
                        for (int j = 0; j < DB; j++) acc[g][j] += pv * vv[j];                                       \
                    }                                                                                               \
                } else {                                                                                            \
                    for (int g = 0; g < GB; g++) {                                                                  \
                        float pv = p[(g0 + g) * ldp + l];                                                           \
                        for (int j = 0; j < w; j++) acc[g][j] += pv * LD(Vl, j);                                    \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            for (int g = 0; g < GB; g++)                                                                            \
                for (int j = 0; j < w; j++) o[(g0 + g) * D + db + j] += acc[g][j];                                  \
        }                                                                                                           \
    }                                                                                                               \
    void NAME(int R, int KV, int G, int D, const T *q, T *out, float scale, float softcap, const T *kA, long kAr,   \
              long kAh, long kAd, const T *vA, long vAr, long vAh, int lenA, const int64_t *pa, const T *kB,       \
              long kBr, long kBh, long kBd, const T *vB, long vBr, long vBh, int lenB, const int32_t *start,       \
              const T *kN, const T *vN, float *scratch, int nthreads) {                                             \
        int L = lenA + lenB, ldsc = (L + 15) & ~15;                                                                 \
        long per_thread = 2L * G * D + (long)G * ldsc;                                                              \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
        for (long task = 0; task < (long)R * KV; task++) {                                                          \
            int r = task / KV, h = task % KV, s0 = start[r];                                                        \
            float *qf = scratch + omp_get_thread_num() * per_thread, *o = qf + G * D, *sc = o + G * D;              \
            const T *qh = q + task * G * D;                                                                         \
            for (int i = 0; i < G * D; i++) {                                                                       \
                qf[i] = LD(qh, i) * scale;                                                                          \
                o[i] = 0.f;                                                                                         \
            }                                                                                                       \
            long ra = pa ? pa[r] : r;                                                                               \
            const T *KA = kA + ra * kAr + h * kAh, *VA = vA + ra * vAr + h * vAh;                                   \
            const T *KB = kB + (long)r * kBr + h * kBh, *VB = vB + (long)r * vBr + h * vBh;                         \
            if (kN) { /* this step's key and value: the last column of B (or of A when there is no B) */            \
                T *KW = lenB > 0 ? (T *)KB : (T *)KA, *VW = lenB > 0 ? (T *)VB : (T *)VA;                           \
                long c = lenB > 0 ? lenB - 1 : lenA - 1, sdw = lenB > 0 ? kBd : kAd;                                \
                for (int d = 0; d < D; d++) {                                                                       \
                    KW[d * sdw + c] = kN[task * D + d];                                                             \
                    VW[c * D + d] = vN[task * D + d];                                                               \
                }                                                                                                   \
            }                                                                                                       \
            int a0 = s0 < lenA ? s0 : lenA, b0 = s0 > lenA ? s0 - lenA : 0;                                         \
            int g = 0;                                                                                              \
            for (; g + 4 <= G; g += 4) {                                                                            \
                NAME##_scores(4, D, qf, g, KA, kAd, a0, lenA, sc, ldsc);                                            \
                NAME##_scores(4, D, qf, g, KB, kBd, b0, lenB, sc + lenA, ldsc);                                     \
            }                                                                                                       \
            for (; g + 2 <= G; g += 2) {                                                                            \
                NAME##_scores(2, D, qf, g, KA, kAd, a0, lenA, sc, ldsc);                                            \
                NAME##_scores(2, D, qf, g, KB, kBd, b0, lenB, sc + lenA, ldsc);                                     \
            }                                                                                                       \
            for (; g < G; g++) {                                                                                    \
                NAME##_scores(1, D, qf, g, KA, kAd, a0, lenA, sc, ldsc);                                            \
                NAME##_scores(1, D, qf, g, KB, kBd, b0, lenB, sc + lenA, ldsc);                                     \
            }                                                                                                       \
            for (g = 0; g < G; g++) { /* softmax over the attended columns [s0, L) */                               \
                float *sg = sc + g * ldsc, m = -3.0e38f, sum = 0.f;                                                 \
                if (softcap > 0.f)                                                                                  \
                    for (int l = s0; l < L; l++) sg[l] = softcap * tanhf(sg[l] / softcap);                          \
                for (int l = s0; l < L; l++) m = sg[l] > m ? sg[l] : m;                                             \
                for (int l = s0; l < L; l++) {                                                                      \
                    float e = expf(sg[l] - m);                                                                      \
                    sg[l] = e;                                                                                      \
                    sum += e;                                                                                       \
                }                                                                                                   \
                float inv = 1.f / sum;                                                                              \
                for (int l = s0; l < L; l++) sg[l] *= inv;                                                          \
            }                                                                                                       \
            g = 0;                                                                                                  \
            for (; g + 4 <= G; g += 4) {                                                                            \
                NAME##_values(4, D, sc, g, ldsc, VA, a0, lenA, o);                                                  \
                NAME##_values(4, D, sc + lenA, g, ldsc, VB, b0, lenB, o);                                           \
            }                                                                                                       \
            for (; g + 2 <= G; g += 2) {                                                                            \
                NAME##_values(2, D, sc, g, ldsc, VA, a0, lenA, o);                                                  \
                NAME##_values(2, D, sc + lenA, g, ldsc, VB, b0, lenB, o);                                           \
            }                                                                                                       \
            for (; g < G; g++) {                                                                                    \
                NAME##_values(1, D, sc, g, ldsc, VA, a0, lenA, o);                                                  \
                NAME##_values(1, D, sc + lenA, g, ldsc, VB, b0, lenB, o);                                           \
            }                                                                                                       \
            T *oh = out + task * G * D;                                                                             \
            for (int i = 0; i < G * D; i++) ST(oh, i, o[i]);                                                        \
        }                                                                                                           \
    }

DEFINE_KERNEL(decode_attention_f32, float, ld_f32, st_f32)
DEFINE_KERNEL(decode_attention_bf16, bf16, ld_bf16, st_bf16)
