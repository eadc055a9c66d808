/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in fp32, for the native rollout's projections on CPU (cpu_linear.py).

   W is packed once into panels of 16 output columns: packed[p][k][c] = W[16 p + c, k] (columns past N are zero), so
   one panel is a contiguous stream of K rows of 16 floats. A task takes one or two panels and all M rows; in blocks
   of up to MR rows it keeps every (row, column) sum in a register over the whole K loop: per k, one load of each
   panel's 16 weights, one broadcast per row, one FMA per row and panel (with two blocks, chunk by chunk of K: see
   the task loop). Each weight is read from memory once per call, which is what a decode step with few rows is bound
   by. Each thread runs a contiguous range of tasks and
   prefetches the next task's panels into L2 while the current task's row blocks run, so that streaming the weights
   from memory overlaps the FMAs instead of stalling the first row block of every task.

   Each output is the sum over k = 0..K-1 in that order, FMA by FMA, whatever M is: a row's result does not depend
   on how many rows are in the call. */
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
#define VEC 16
#define LANES_PER_PANEL 1
#define MR 12
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vbroadcast(p) _mm512_set1_ps(*(p))
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 8
#define LANES_PER_PANEL 2
#define MR 6
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
/* not _mm256_broadcast_ss(p): GCC takes that builtin's pointer argument as a read of any memory, so it stored
   every accumulator to the stack on each k (twelve stores per twelve FMAs: half the FMA rate); set1 of the loaded
   float compiles to the same vbroadcastss from memory and leaves the accumulators in registers */
#define vbroadcast(p) _mm256_set1_ps(*(p))
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#else
#error "cpu_panel_linear.c needs AVX-512F, or AVX2 with FMA"
#endif

#define PANEL 16
#define KC 64 /* k per chunk when a task has two row blocks */
/* two registers a row: with AVX-512 a task is two panels (32 columns), with AVX2 one panel (16 columns) */
#define REGS 2
#define TASK_PANELS (LANES_PER_PANEL == 1 ? 2 : 1)
#define TASK_COLS (REGS * VEC)
#if VEC == 16
#define vstore(p, a) _mm512_storeu_ps(p, a)
#else
#define vstore(p, a) _mm256_storeu_ps(p, a)
#endif

/* rows [0, mr) of x (stride ldx) times the task's columns, over k in [k0, k1); lane[j] is the weight stream of the
   j-th register of each row (16 columns with AVX-512, 8 with AVX2). The sums start at 0 when k0 = 0, else from
   sums[mr][TASK_COLS]; they go back there when k1 < K, else, with the bias, to y. */
static inline __attribute__((always_inline)) void
block(const int mr, const float *x, long ldx, const float *const *lane, long K, float *y, long ldy,
      const float *bias, int cols, const float *pf, long pf_lines, long k0, long k1, float *sums) {
    vec acc[MR][REGS];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < REGS; j++) acc[m][j] = k0 ? vload(sums + m * TASK_COLS + j * VEC) : vzero();
    for (long k = k0; k < k1; k++) {
        vec w[REGS];
        for (int j = 0; j < REGS; j++) {
            w[j] = vload(lane[j] + k * PANEL);
            _mm_prefetch((const char *)(lane[j] + k * PANEL + 256), _MM_HINT_T0);
        }
        /* the next task's weights into L2, two lines per k while this block's share lasts */
        const long i = k - k0;
        if (2 * i < pf_lines) _mm_prefetch((const char *)(pf + 2 * i * PANEL), _MM_HINT_T1);
        if (2 * i + 1 < pf_lines) _mm_prefetch((const char *)(pf + (2 * i + 1) * PANEL), _MM_HINT_T1);
        for (int m = 0; m < mr; m++) {
            vec xv = vbroadcast(x + m * ldx + k);
            for (int j = 0; j < REGS; j++) acc[m][j] = vfma(xv, w[j], acc[m][j]);
        }
    }
    if (k1 < K) {
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < REGS; j++) vstore(sums + m * TASK_COLS + j * VEC, acc[m][j]);
        return;
    }
    vec b[REGS];
    for (int j = 0; j < REGS; j++) {
        float part[VEC];
        for (int c = 0; c < VEC; c++) part[c] = bias && j * VEC + c < cols ? bias[j * VEC + c] : 0.0f;
        b[j] = vload(part);
    }
    for (int m = 0; m < mr; m++) {
        float *row = y + m * ldy;
        if (cols == TASK_COLS) {
            for (int j = 0; j < REGS; j++) vstore(row + j * VEC, vadd(acc[m][j], b[j]));
        } else {  /* the last task's columns past N are not written */
            float out[TASK_COLS];
            for (int j = 0; j < REGS; j++) vstore(out + j * VEC, vadd(acc[m][j], b[j]));
            for (int c = 0; c < cols; c++) row[c] = out[c];
        }
    }
}

#define BLOCK(R)                                                                                                   \
    static void block##R(const float *x, long ldx, const float *const *lane, long K, float *y, long ldy,          \
                         const float *bias, int cols, const float *pf, long pf_lines, long k0, long k1,           \
                         float *sums) {                                                                           \
        block(R, x, ldx, lane, K, y, ldy, bias, cols, pf, pf_lines, k0, k1, sums);                                \
    }
typedef void (*block_fn)(const float *, long, const float *const *, long, float *, long, const float *, int,
                         const float *, long, long, long, float *);
#if MR == 12
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)
static const block_fn BLOCKS[MR + 1] = {0, block1, block2, block3, block4, block5, block6,
                                        block7, block8, block9, block10, block11, block12};
#else
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
static const block_fn BLOCKS[MR + 1] = {0, block1, block2, block3, block4, block5, block6};
#endif

int panel_linear_vector_width(void) { return VEC; }

/* rows of the next block when `rest` rows are left: blocks of MR rows; what is left under 2 MR is split in two
   near-equal blocks */
static inline int block_rows(long rest) { return (int)(rest <= MR ? rest : (rest < 2 * MR ? (rest + 1) / 2 : MR)); }

/* x [M, K] contiguous, packed [ceil(N / 16)][K][16], bias [N] or NULL, y [M, N] contiguous */
void panel_linear_f32(const float *x, long M, long K, const float *packed, long N, const float *bias, float *y) {
    const long panels = (N + PANEL - 1) / PANEL;
    const long tasks = (panels + TASK_PANELS - 1) / TASK_PANELS;
#pragma omp parallel
    {
        float sums[2 * MR * TASK_COLS] __attribute__((aligned(64))); /* a chunked task's running sums */
        /* contiguous ranges of tasks per thread, so that a task knows the next one this thread runs */
        const long threads = omp_get_num_threads(), me = omp_get_thread_num();
        const long t_begin = tasks * me / threads, t_end = tasks * (me + 1) / threads;
        for (long t = t_begin; t < t_end; t++) {
            const long col0 = t * TASK_PANELS * PANEL;
            const long left = N - col0;
            const int cols = (int)(left < TASK_PANELS * PANEL ? left : TASK_PANELS * PANEL);
            const float *first = packed + t * TASK_PANELS * K * PANEL;
            /* the registers' weight streams: with AVX-512 one per panel; with AVX2 the two halves of the panel. A
               task with one real panel (the last, N <= 16 past it) reads its first panel twice and drops the copy. */
            const float *lane[REGS];
#if VEC == 16
            lane[0] = first;
            lane[1] = cols > PANEL ? first + K * PANEL : first;
#else
            lane[0] = first;
            lane[1] = first + VEC;
#endif
            /* The next task's panels (one 64-byte line per k and panel, contiguous after this task's) are
               prefetched into L2 while this task's row blocks run, shared out over its blocks: its first block
               then reads from cache instead of waiting on memory, and the memory stream overlaps the FMAs. */
            const float *next = first + TASK_PANELS * K * PANEL;
            const long next_panels = t + 1 < t_end ? (panels - (t + 1) * TASK_PANELS < TASK_PANELS
                                                      ? panels - (t + 1) * TASK_PANELS : TASK_PANELS) : 0;
            /* Two row blocks (MR < M < 2 MR: 16 rows of a GRPO decode step) take the K loop in chunks of KC, both
               blocks per chunk: the second reads the chunk's weights from L1 right after the first streamed them
               in, instead of from L2 after the whole task's. The sums over k stay in order (kept in `sums` between
               chunks), so the bits are the same. Fewer or more blocks: one chunk, as before. */
            const long kc = M > MR && M < 2 * MR ? KC : K;
            long blocks = 0;
            for (long m0 = 0; m0 < M; m0 += block_rows(M - m0)) blocks++;
            blocks *= (K + kc - 1) / kc;
            long pf_left = next_panels * K, pf_share = blocks ? (pf_left + blocks - 1) / blocks : 0;
            if (pf_share > 2 * kc) pf_share = 2 * kc;
            for (long k0 = 0; k0 < K; k0 += kc) {
                const long k1 = k0 + kc < K ? k0 + kc : K;
                for (long m0 = 0; m0 < M;) {
                    const int mr = block_rows(M - m0);
                    const long pf_lines = pf_left < pf_share ? pf_left : pf_share;
                    BLOCKS[mr](x + m0 * K, K, lane, K, y + m0 * N + col0, N, bias ? bias + col0 : 0, cols, next,
                               pf_lines, k0, k1, sums + m0 * TASK_COLS);
                    next += pf_lines * PANEL;
                    pf_left -= pf_lines;
                    m0 += mr;
                }
            }
        }
    }
}
