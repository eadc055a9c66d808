/* The native rollout's bf16 projections (cpu_bf16_linear.py): y = x W^T (+ bias) for bf16 x [M, K] and a weight
 * W [N, K] packed once, as the products of AMX tiles where the CPU has AMX, and of AVX512-BF16's dot products on other
 * CPUs with bf16 units (AMD Zen 4 and later; Intel Cooper Lake).
 *
 * Packed layout: [ceil(N / 16)][ceil(K / 32)] tiles of 16 rows x 64 bytes, zero past N and K. Row r of tile (nb, kb)
 * holds, for the 16 columns n = 16 nb + c, the pair W[n][32 kb + 2 r], W[n][32 kb + 2 r + 1]: the layout TDPBF16PS
 * reads its second operand in, and one zmm register of VDPBF16PS's (16 columns, a k pair each). A column block's
 * tiles follow one another in k, so a call streams the weights from memory once, in order.
 *
 * Both products sum the bf16 products of each output in fp32, k in order from zero; then bias (fp32) is added and
 * each sum rounded to bf16 to nearest even. K must be a multiple of 32 (the caller pads with zeros; rows may be any
 * number); each row's result does not depend on the other rows of the call.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define HAVE_AMX 1
#endif
#if !defined(HAVE_AMX) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#error "the bf16 projection kernel needs AMX-TILE and AMX-BF16, or AVX512-BF16 (built with -march=native on such a CPU)"
#endif

typedef uint16_t bf16;

#define ROWS 16  /* rows of a tile */
#define KSTEP 32 /* bf16 k per tile row (64 bytes) */

void bf16_pack(const bf16 *w, long N, long K, long ld, bf16 *packed, int nthreads) {
    const long NB = (N + 15) / 16, KB = (K + KSTEP - 1) / KSTEP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long nb = 0; nb < NB; nb++)
        for (long kb = 0; kb < KB; kb++) {
            bf16 *t = packed + (nb * KB + kb) * ROWS * KSTEP;
            const long n0 = nb * 16, k0 = kb * KSTEP;
            if (n0 + 16 <= N && k0 + KSTEP <= K && ld % 2 == 0) { /* a whole tile: each k pair one 32-bit copy */
                for (int c = 0; c < 16; c++) {
                    const bf16 *row = w + (n0 + c) * ld + k0;
                    for (int r = 0; r < ROWS; r++) memcpy(t + r * KSTEP + 2 * c, row + 2 * r, 2 * sizeof(bf16));
                }
                continue;
            }
            for (int r = 0; r < ROWS; r++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        const long n = n0 + c, k = k0 + 2 * r + e;
                        t[r * KSTEP + 2 * c + e] = n < N && k < K ? w[n * ld + k] : 0;
                    }
        }
}

/* 16 sums + bias, rounded to bf16 to nearest even (NaN: torch's quiet NaN), the first `n` stored */
static inline void store_row(const float *sums, const bf16 *bias, bf16 *y, int n) {
    const __mmask16 mask = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __m512 v = _mm512_loadu_ps(sums);
    if (bias) v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16)));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(rounded));
}

#ifdef HAVE_AMX
/* Linux's permission for this process to use the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * 0 when granted. */
int amx_request(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* The products of up to four accumulator tiles (tiles 0-3), over all of k, each a block of 16 rows x 16 columns:
 * RB row blocks (16 rows of x each, `xs` apart) by CB column blocks (their packed tiles `ws` apart), 16 rows by up to
 * 64 columns or 32 rows by 16 or 32. Per k tile each weight tile is loaded once for the RB row blocks and each x
 * tile once for the CB column blocks. Tiles 4-7 hold the operands. */
#define LOAD_X(t, r) _tile_loadd(t, x + (r) * xs + kb * KSTEP, K * sizeof(bf16))
#define LOAD_W(t, c) _tile_loadd(t, w + (c) * ws + kb * tile, 64)
static inline void products(int RB, int CB, const bf16 *x, long xs, long K, const bf16 *w, long ws) {
    const long KB = K / KSTEP, tile = ROWS * KSTEP;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (RB == 2 && CB == 2) { /* tiles 0, 1: rows 0-15 by columns 0-15, 16-31; tiles 2, 3: rows 16-31 */
        for (long kb = 0; kb < KB; kb++) {
            LOAD_X(4, 0);
            LOAD_X(5, 1);
            LOAD_W(6, 0);
            LOAD_W(7, 1);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else if (RB == 2) { /* one column block: tiles 0, 1 are rows 0-15, 16-31 */
        for (long kb = 0; kb < KB; kb++) {
            LOAD_W(4, 0);
            LOAD_X(5, 0);
            _tile_dpbf16ps(0, 5, 4);
            LOAD_X(6, 1);
            _tile_dpbf16ps(1, 6, 4);
        }
    } else { /* one row block: tile c is column block c */
        for (long kb = 0; kb < KB; kb++) {
            LOAD_X(4, 0);
            LOAD_W(5, 0);
            _tile_dpbf16ps(0, 4, 5);
            if (CB > 1) {
                LOAD_W(6, 1);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (CB > 2) {
                LOAD_W(7, 2);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (CB > 3) {
                LOAD_W(5, 3);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
    }
}

/* Store the sums of the RB x CB tiles of products() for rows m0.. (at most `rows` of each row block) and the column
 * blocks from nb0: tile t is row block t / CB, column block t % CB. */
static void store_tiles(float sums[4][ROWS * 16], int RB, int CB, int rows, long m0, long nb0, long N, const bf16 *bias,
                        bf16 *y) {
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int t = 0; t < RB * CB; t++) {
        const long rows0 = m0 + (long)(t / CB) * ROWS, n0 = (nb0 + t % CB) * 16;
        const int n = N - n0 < 16 ? (int)(N - n0) : 16;
        for (int r = 0; r < rows; r++)
            store_row(sums[t] + r * 16, bias ? bias + n0 : NULL, y + (rows0 + r) * N + n0, n);
    }
}

static void configure(struct tile_config *config, int x_rows) {
    memset(config, 0, sizeof *config);
    config->palette = 1;
    for (int t = 0; t < 8; t++) config->rows[t] = t < 5 ? x_rows : ROWS, config->bytes_per_row[t] = 64;
}

/* y [M, N] bf16 (row stride N) = x [M, K] bf16 (row stride K) times the packed weight, + bias [N] bf16 (NULL: none).
 * K a multiple of 32. The threads split the columns in units of four blocks (64 columns); a unit takes the rows in
 * passes of 32 (two row blocks by two column blocks: one tile load per product, the fewest four accumulators allow),
 * then 16, then the last M mod 16 (tiles of that many rows), so its weight tiles come from memory once and stay in
 * cache for the later passes. */
void amx_linear_bf16(const bf16 *x, long M, long K, const bf16 *packed, long N, const bf16 *bias, bf16 *y,
                     int nthreads) {
    const long NB = (N + 15) / 16, KB = K / KSTEP, ws = KB * ROWS * KSTEP, units = (NB + 3) / 4;
    const long whole = M / ROWS * ROWS;
    const int tail = (int)(M - whole);
#pragma omp parallel num_threads(nthreads)
    {
        struct tile_config full, last;
        configure(&full, ROWS);
        configure(&last, tail > 0 ? tail : ROWS);
        _tile_loadconfig(&full);
        float sums[4][ROWS * 16];
#pragma omp for schedule(static)
        for (long u = 0; u < units; u++) {
            const long unit_blocks = NB - 4 * u < 4 ? NB - 4 * u : 4;
            for (long m0 = 0; m0 < whole;) {
                const long left = (whole - m0) / ROWS;
                const int RB = left >= 2 ? 2 : 1, per_call = 4 / RB; /* column blocks per products() call */
                for (long b0 = 0; b0 < unit_blocks; b0 += per_call) {
                    const int CB = unit_blocks - b0 < per_call ? (int)(unit_blocks - b0) : per_call;
                    products(RB, CB, x + m0 * K, ROWS * K, K, packed + (4 * u + b0) * ws, ws);
                    store_tiles(sums, RB, CB, ROWS, m0, 4 * u + b0, N, bias, y);
                }
                m0 += RB * ROWS;
            }
            if (tail) { /* tiles 0-4 of `tail` rows: the sums and x */
                _tile_loadconfig(&last);
                products(1, (int)unit_blocks, x + whole * K, ROWS * K, K, packed + 4 * u * ws, ws);
                store_tiles(sums, 1, (int)unit_blocks, tail, whole, 4 * u, N, bias, y);
                _tile_loadconfig(&full);
            }
        }
        _tile_release();
    }
}
#endif /* HAVE_AMX */

#ifdef __AVX512BF16__
/* The AVX512-BF16 product of RB rows of x by CB column blocks (16 columns each, their packed tiles `ws` apart), over
 * all of k: sums[r * CB + c] holds the 16 fp32 sums of row r and column block c. `next` (or NULL): CB column blocks
 * whose weights are fetched into L2 meanwhile, one cache line per block and k pair. Per k pair one weight register per
 * column block and one broadcast of the row's pair (the layout's zmm rows are VDPBF16PS's operand as they are); RB x
 * CB accumulators, as many as the pass's rows and columns allow, at most 24 (6 rows by 4 blocks: the fastest of the
 * shapes tried, docs/benchmarks.md). Each accumulator adds its pairs in k order, from zero. */
#define DOT_BLOCK(RB, CB)                                                                                             \
    static void dot_##RB##_##CB(const bf16 *x, long K, const bf16 *w, long ws, float *sums, const bf16 *next) {      \
        __m512 acc[RB][CB];                                                                                           \
        for (int r = 0; r < RB; r++)                                                                                  \
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();                                             \
        for (long j = 0; j < K / 2; j++) {                                                                            \
            __m512bh wv[CB];                                                                                          \
            for (int c = 0; c < CB; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * ws + j * 32);                   \
            if (next)                                                                                                 \
                for (int c = 0; c < CB; c++) _mm_prefetch((const char *)(next + c * ws + j * 32), _MM_HINT_T1);       \
            for (int r = 0; r < RB; r++) {                                                                            \
                int32_t pair;                                                                                         \
                memcpy(&pair, x + r * K + 2 * j, sizeof pair);                                                        \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                                \
                for (int c = 0; c < CB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);                      \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < RB; r++)                                                                                  \
            for (int c = 0; c < CB; c++) _mm512_storeu_ps(sums + (r * CB + c) * 16, acc[r][c]);                       \
    }
#define DOT_ROWS(CB) \
    DOT_BLOCK(1, CB) DOT_BLOCK(2, CB) DOT_BLOCK(3, CB) DOT_BLOCK(4, CB) DOT_BLOCK(5, CB) DOT_BLOCK(6, CB)
DOT_ROWS(1) DOT_ROWS(2) DOT_ROWS(3) DOT_ROWS(4)
#define DOT_MAX_ROWS 6
#define DOT_MAX_BLOCKS 4
typedef void (*dot_block)(const bf16 *x, long K, const bf16 *w, long ws, float *sums, const bf16 *next);
static const dot_block dot_blocks[DOT_MAX_BLOCKS][DOT_MAX_ROWS] = {
    {dot_1_1, dot_2_1, dot_3_1, dot_4_1, dot_5_1, dot_6_1},
    {dot_1_2, dot_2_2, dot_3_2, dot_4_2, dot_5_2, dot_6_2},
    {dot_1_3, dot_2_3, dot_3_3, dot_4_3, dot_5_3, dot_6_3},
    {dot_1_4, dot_2_4, dot_3_4, dot_4_4, dot_5_4, dot_6_4},
};

/* Tall blocks: up to 16 rows by one column block (16 accumulators), for calls of TALL_MIN_ROWS to TALL_MAX_ROWS rows.
 * Each column block's weights then stream from memory once, in one pass under all the rows (up to 16 dot products per
 * weight register), with a prefetch TALL_PREFETCH k pairs ahead in the stream, into L2. Sixteen row pointers would not
 * fit in the registers: row r is read at bases[row_base[r]] + row_scale[r] * (the row stride), six bases (rows 0, 3,
 * 6, 9, 12, 15) and the scales addressing allows. Same sums as dot_RB_CB: each accumulator adds its pairs in k order,
 * from zero, with the same instruction. Against the 6 x 4 blocks, with the weights streaming from memory: 9-24% less
 * time at 8 to 48 rows (the mid model's projections), 16-18% at 8 and 16 rows (SmolLM2-135M's); the same with the
 * weights resident in L3 (docs/benchmarks-history.md, fortieth session). */
#define TALL_MIN_ROWS 8
#define TALL_MAX_ROWS 48
#define TALL_ROWS 16
#define TALL_PREFETCH 192
static const int row_base[TALL_ROWS] = {0, 0, 0, 3, 0, 3, 6, 3, 0, 9, 6, 3, 12, 9, 6, 15};
static const int row_scale[TALL_ROWS] = {0, 1, 2, 0, 4, 2, 0, 4, 8, 0, 4, 8, 0, 4, 8, 0};
#define TALL_BLOCK(RB)                                                                                                \
    static void tall_##RB(const bf16 *x, long K, const bf16 *w, float *sums) {                                       \
        __m512 acc[RB];                                                                                               \
        for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();                                                    \
        const long stride = K * (long)sizeof(bf16);                                                                   \
        const char *bases[16];                                                                                        \
        for (int b = 0; b < RB; b += 3) bases[b] = (const char *)x + b * stride; /* row_base[r] <= r */               \
        for (long j = 0; j < K / 2; j++) {                                                                            \
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * 32);                                             \
            _mm_prefetch((const char *)(w + (j + TALL_PREFETCH) * 32), _MM_HINT_T1);                                  \
            _Pragma("GCC unroll 16") for (int r = 0; r < RB; r++) {                                                   \
                int32_t pair;                                                                                         \
                memcpy(&pair, bases[row_base[r]] + row_scale[r] * stride + 4 * j, sizeof pair);                      \
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), wv);                             \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < RB; r++) _mm512_storeu_ps(sums + r * 16, acc[r]);                                         \
    }
TALL_BLOCK(1) TALL_BLOCK(2) TALL_BLOCK(3) TALL_BLOCK(4) TALL_BLOCK(5) TALL_BLOCK(6) TALL_BLOCK(7) TALL_BLOCK(8)
TALL_BLOCK(9) TALL_BLOCK(10) TALL_BLOCK(11) TALL_BLOCK(12) TALL_BLOCK(13) TALL_BLOCK(14) TALL_BLOCK(15)
TALL_BLOCK(16)
typedef void (*tall_block)(const bf16 *x, long K, const bf16 *w, float *sums);
static const tall_block tall_blocks[TALL_ROWS] = {tall_1,  tall_2,  tall_3,  tall_4,  tall_5,  tall_6,
                                                   tall_7,  tall_8,  tall_9,  tall_10, tall_11, tall_12,
                                                   tall_13, tall_14, tall_15, tall_16};

/* y's column blocks [first, last) in tall blocks: each block's rows in passes of 16, the last pass the rest */
static void dot_tall(const bf16 *x, long M, long K, const bf16 *packed, long ws, long N, const bf16 *bias, bf16 *y,
                     long first, long last) {
    float sums[TALL_ROWS * 16];
    for (long nb = first; nb < last; nb++) {
        const long n0 = nb * 16;
        const int n = N - n0 < 16 ? (int)(N - n0) : 16;
        for (long m0 = 0; m0 < M; m0 += TALL_ROWS) {
            const int RB = M - m0 < TALL_ROWS ? (int)(M - m0) : TALL_ROWS;
            tall_blocks[RB - 1](x + m0 * K, K, packed + nb * ws, sums);
            for (int r = 0; r < RB; r++) store_row(sums + r * 16, bias ? bias + n0 : NULL, y + (m0 + r) * N + n0, n);
        }
    }
}

/* amx_linear_bf16's product with AVX512-BF16 (same arguments, same packed weight). Each thread takes an equal run of
 * column blocks. From TALL_MIN_ROWS to TALL_MAX_ROWS rows it runs them in tall blocks (above); otherwise it goes
 * through them four at a time, the rows in passes of six under those blocks: their weights come from memory in the
 * first pass and from cache in the others, and the second pass, when it has four rows or more, fetches the next four
 * blocks' weights meanwhile, so the first pass under them starts on weights in cache (docs/benchmarks-history.md,
 * thirty-ninth session). */
void dot_linear_bf16(const bf16 *x, long M, long K, const bf16 *packed, long N, const bf16 *bias, bf16 *y,
                     int nthreads) {
    const long NB = (N + 15) / 16, ws = K / KSTEP * ROWS * KSTEP;
    const int tall = M >= TALL_MIN_ROWS && M <= TALL_MAX_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const long first = NB * t / threads, last = NB * (t + 1) / threads;
        if (tall) {
            dot_tall(x, M, K, packed, ws, N, bias, y, first, last);
        } else {
            float sums[DOT_MAX_ROWS * DOT_MAX_BLOCKS * 16];
            for (long nb = first; nb < last;) {
                const int CB = last - nb < DOT_MAX_BLOCKS ? (int)(last - nb) : DOT_MAX_BLOCKS;
                for (long m0 = 0; m0 < M;) {
                    const int RB = M - m0 < DOT_MAX_ROWS ? (int)(M - m0) : DOT_MAX_ROWS;
                    const int fetch = m0 == DOT_MAX_ROWS && RB >= 4 && nb + CB < last;
                    dot_blocks[CB - 1][RB - 1](x + m0 * K, K, packed + nb * ws, ws, sums,
                                               fetch ? packed + (nb + CB) * ws : NULL);
                    for (int r = 0; r < RB; r++)
                        for (int c = 0; c < CB; c++) {
                            const long n0 = (nb + c) * 16;
                            store_row(sums + (r * CB + c) * 16, bias ? bias + n0 : NULL, y + (m0 + r) * N + n0,
                                      N - n0 < 16 ? (int)(N - n0) : 16);
                        }
                    m0 += RB;
                }
                nb += CB;
            }
        }
    }
}
#endif /* __AVX512BF16__ */
