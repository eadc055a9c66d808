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
 * Each task first asks for the next task's keys and values (software prefetch): a decode step's projections stream
 * the weights through the caches between two layers' attention calls, so the cache lines come from memory, and the
 * hardware prefetchers do not follow the keys' strided rows from one task to the next.
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

/* Vectors in GCC's portable vector types: 16 floats with AVX-512, 8 with AVX2, 4 otherwise. The register blocks are
 * vectors held in named registers (an array of floats here was kept on the stack: a load and a store per FMA). */
#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
#define VEC (VBYTES / 4)
typedef float vf __attribute__((vector_size(VBYTES)));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));
typedef uint16_t vh __attribute__((vector_size(VBYTES / 2)));

static inline vf vld_f32(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline vf vld_bf16(const bf16 *p) {
    vh h;
    __builtin_memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline vf vbroadcast(float x) { return (vf){0} + x; }
static inline void vstore_part(float *p, vf v, int n) { __builtin_memcpy(p, &v, n * sizeof(float)); }

/* n < VEC elements, zero past them: a masked load where the CPU has one, else through a zeroed buffer */
#if defined(__AVX512F__) && VBYTES == 64
#include <immintrin.h>
static inline vf vld_part_f32(const float *p, int n) {
    return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
#elif defined(__AVX2__) && VBYTES == 32
#include <immintrin.h>
static inline vf vld_part_f32(const float *p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return (vf)_mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
}
#else
static inline vf vld_part_f32(const float *p, int n) {
    float part[VEC] = {0};
    for (int i = 0; i < n; i++) part[i] = p[i];
    return vld_f32(part);
}
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__) && VBYTES == 64
static inline vf vld_part_bf16(const bf16 *p, int n) {
    __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
#else
static inline vf vld_part_bf16(const bf16 *p, int n) {
    bf16 part[VEC] = {0};
    for (int i = 0; i < n; i++) part[i] = p[i];
    return vld_bf16(part);
}
#endif

/* Ask for the lines of `rows` rows of `bytes` bytes each, `stride` bytes apart, to be brought into cache. A task's
 * keys and values are prefetched only up to this size, a small share of L2: a long context's rows are long, and the
 * hardware prefetchers follow them. */
#define PREFETCH_MAX_BYTES (128L * 1024)
static inline void prefetch_rows(const char *p, int rows, long stride, long bytes) {
    for (int i = 0; i < rows; i++)
        for (long off = 0; off < bytes; off += 64) __builtin_prefetch(p + i * stride + off, 0, 3);
}

/* Scores of GB (1 to 4) query heads at once, so each key vector is loaded once for all of them, over blocks of up to
 * NV_MAX(GB) vectors of key columns: for each d the block's part of key row d is read in one run, so a task's keys
 * stream through memory in order (one pass over [d][length]) and the hardware prefetchers follow them; blocks of two
 * vectors read 64 rows a few lines at a time, which out of cache waited on memory. The accumulators (GB x NV) and
 * the GB broadcast query values stay in registers: 32 with AVX-512, 16 otherwise. Each score is the sum over d in
 * order, FMA by FMA, whatever the block width. */
#if VBYTES == 64
#define NV_MAX(GB) ((GB) == 1 ? 12 : (GB) == 2 ? 12 : (GB) == 3 ? 8 : 6)
#else
#define NV_MAX(GB) ((GB) == 1 ? 12 : (GB) == 2 ? 6 : (GB) == 3 ? 3 : 2)
#endif
#define DEFINE_KERNEL(NAME, T, LD, ST, VLD, VLD_PART)                                                                \
    /* out[g][c] = (or += with ACC) the sum over i in [i0, i1), in order, of a[g * lda + i] * B[i * ldb + c], for GB \
     * rows g and the columns c of nv vectors (n of VEC in the last): the scores are this with i = d over the key rows \
     * (B: [d][length]), the weighted sum of values with i = l over the value rows (B: [l][d]) */                    \
    static inline __attribute__((always_inline)) void NAME##_block(const int GB, const int NV, const int ACC, int nv,  \
                                                                   int n, const float *a, int lda, const T *B,       \
                                                                   long ldb, int i0, int i1, float *out, int ldo) {  \
        vf acc[4][12];                                                                                               \
        _Pragma("GCC unroll 4") for (int g = 0; g < GB; g++)                                                         \
            _Pragma("GCC unroll 12") for (int v = 0; v < NV; v++) acc[g][v] = (vf){0};                               \
        for (int i = i0; i < i1; i++) {                                                                              \
            const T *Bi = B + (long)i * ldb;                                                                         \
            vf av[4];                                                                                                \
            _Pragma("GCC unroll 4") for (int g = 0; g < GB; g++) av[g] = vbroadcast(a[g * lda + i]);                 \
            _Pragma("GCC unroll 12") for (int v = 0; v < NV; v++) {                                                  \
                if (v >= nv) break;                                                                                  \
                vf x = v < nv - 1 || n == VEC ? VLD(Bi + v * VEC) : VLD_PART(Bi + v * VEC, n);                       \
                _Pragma("GCC unroll 4") for (int g = 0; g < GB; g++) acc[g][v] += av[g] * x;                         \
            }                                                                                                        \
        }                                                                                                            \
        _Pragma("GCC unroll 4") for (int g = 0; g < GB; g++)                                                         \
            _Pragma("GCC unroll 12") for (int v = 0; v < NV && v < nv; v++) {                                        \
                float *og = out + g * ldo + v * VEC;                                                                 \
                int m = v < nv - 1 ? VEC : n;                                                                        \
                vf r = acc[g][v];                                                                                    \
                if (ACC) r = (m == VEC ? vld_f32(og) : vld_part_f32(og, m)) + r;                                     \
                vstore_part(og, r, m);                                                                               \
            }                                                                                                        \
    }                                                                                                                \
    /* the columns [c0, c1) in blocks of up to NV_MAX(GB) vectors */                                                 \
    static inline __attribute__((always_inline)) void NAME##_columns(const int GB, const int ACC, int c0, int c1,    \
                                                                     const float *a, int lda, const T *B, long ldb,  \
                                                                     int i0, int i1, float *out, int ldo) {          \
        for (int cb = c0; cb < c1; cb += NV_MAX(GB) * VEC) {                                                         \
            int vectors = (c1 - cb + VEC - 1) / VEC;                                                                 \
            int nv = vectors < NV_MAX(GB) ? vectors : NV_MAX(GB), n = c1 - cb - (nv - 1) * VEC;                      \
            n = n < VEC ? n : VEC;                                                                                   \
            NAME##_block(GB, NV_MAX(GB), ACC, nv, n, a, lda, B + cb, ldb, i0, i1, out + cb, ldo);                    \
        }                                                                                                            \
    }                                                                                                                \
    /* one copy per GB and product (scores: acc_out 0, values: 1), called for both cache segments (inlined at        \
     * each call, the build took five times as long) */                                                              \
    static __attribute__((noinline)) void NAME##_product(int GB, int acc_out, int c0, int c1, const float *a, int lda, \
                                                         const T *B, long ldb, int i0, int i1, float *out, int ldo) { \
        if (i0 >= i1) return;                                                                                        \
        switch (GB * 2 + (acc_out != 0)) {                                                                           \
            case 8: NAME##_columns(4, 0, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            case 9: NAME##_columns(4, 1, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            case 6: NAME##_columns(3, 0, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            case 7: NAME##_columns(3, 1, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            case 4: NAME##_columns(2, 0, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            case 5: NAME##_columns(2, 1, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            case 3: NAME##_columns(1, 1, c0, c1, a, lda, B, ldb, i0, i1, out, ldo); break;                           \
            default: NAME##_columns(1, 0, c0, c1, a, lda, B, ldb, i0, i1, out, ldo);                                 \
        }                                                                                                            \
    }                                                                                                                \
    /* scores sc[g0 + g][l] for keys l in [l0, l1): the sum over d of q[g0 + g][d] K[d][l] */                        \
    static inline void NAME##_scores(int GB, int D, const float *qf, int g0, const T *K, long sd, int l0, int l1,    \
                                     float *sc, int ldsc) {                                                          \
        NAME##_product(GB, 0, l0, l1, qf + g0 * D, D, K, sd, 0, D, sc + g0 * ldsc, ldsc);                            \
    }                                                                                                                \
    /* o[g0 + g] += the sum over l in [l0, l1) of p[g0 + g][l] V[l] */                                               \
    static inline void NAME##_values(int GB, int D, const float *p, int g0, int ldp, const T *V, int l0, int l1,     \
                                     float *o) {                                                                     \
        NAME##_product(GB, 1, 0, D, p + g0 * ldp, ldp, V, D, l0, l1, o + g0 * D, D);                                 \
    }                                                                                                                \
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
            if (task + 1 < (long)R * KV) { /* the next task's keys and values, on their way while this one runs */  \
                long r1 = (task + 1) / KV, h1 = (task + 1) % KV, ra1 = pa ? pa[r1] : r1;                            \
                int s1 = start[r1], a1 = s1 < lenA ? s1 : lenA, b1 = s1 > lenA ? s1 - lenA : 0;                     \
                if ((long)(L - a1 - b1) * 2 * D * sizeof(T) <= PREFETCH_MAX_BYTES) {                                \
                    const T *ka = kA + ra1 * kAr + h1 * kAh + a1, *va = vA + ra1 * vAr + h1 * vAh + (long)a1 * D;   \
                    const T *kb = kB + r1 * kBr + h1 * kBh + b1, *vb = vB + r1 * vBr + h1 * vBh + (long)b1 * D;     \
                    prefetch_rows((const char *)ka, D, kAd * sizeof(T), (lenA - a1) * sizeof(T));                   \
                    prefetch_rows((const char *)va, 1, 0, (long)(lenA - a1) * D * sizeof(T));                       \
                    prefetch_rows((const char *)kb, D, kBd * sizeof(T), (lenB - b1) * sizeof(T));                   \
                    prefetch_rows((const char *)vb, 1, 0, (long)(lenB - b1) * D * sizeof(T));                       \
                }                                                                                                   \
            }                                                                                                       \
            int g = 0;                                                                                              \
            for (; g + 4 <= G; g += 4) {                                                                            \
                NAME##_scores(4, D, qf, g, KA, kAd, a0, lenA, sc, ldsc);                                            \
                NAME##_scores(4, D, qf, g, KB, kBd, b0, lenB, sc + lenA, ldsc);                                     \
            }                                                                                                       \
            if (g + 3 == G) { /* three heads left (G = 3, 7): one pass over the keys, not two */                     \
                NAME##_scores(3, D, qf, g, KA, kAd, a0, lenA, sc, ldsc);                                            \
                NAME##_scores(3, D, qf, g, KB, kBd, b0, lenB, sc + lenA, ldsc);                                     \
                g += 3;                                                                                             \
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
            if (g + 3 == G) {                                                                                       \
                NAME##_values(3, D, sc, g, ldsc, VA, a0, lenA, o);                                                  \
                NAME##_values(3, D, sc + lenA, g, ldsc, VB, b0, lenB, o);                                           \
                g += 3;                                                                                             \
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

DEFINE_KERNEL(decode_attention_f32, float, ld_f32, st_f32, vld_f32, vld_part_f32)
DEFINE_KERNEL(decode_attention_bf16, bf16, ld_bf16, st_bf16, vld_bf16, vld_part_bf16)
