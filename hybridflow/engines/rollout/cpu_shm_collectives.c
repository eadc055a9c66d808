/* Collectives of one tensor-parallel group whose ranks share a host, through one shared-memory segment
 * (shm_collectives.py maps it in every rank): all-reduce (sum), reduce-scatter (sum) and all-gather.
 *
 * Layout: a header of MAX_RANKS counters, one per rank on its own 64-byte line, then two buffers, each with one slot
 * of `slot` bytes per rank: [header][buffer 0: slot 0 .. slot W-1][buffer 1: slot 0 .. slot W-1].
 *
 * One round (per chunk of at most `slot` bytes): a rank copies its chunk into its slot of buffer (round & 1), stores
 * the round's number in its counter (release), waits until every counter has reached that number (acquire), then
 * reads every rank's slot: the sum in rank order for an all-reduce (every rank computes the same sum, so every rank
 * holds the same bits), or each slot copied to its place for an all-gather. Two buffers make one barrier a round
 * enough: a rank writes buffer b again two rounds later, after passing the next round's barrier, which no rank passes
 * before every rank has arrived there, i.e. finished reading buffer b.
 *
 * Waiting: a spin with pause for a few microseconds (a peer usually arrives within the same decode op), then
 * sched_yield, then short sleeps, so that a rank waiting on a busy machine gives its core back. A wait longer than
 * `timeout_s` returns an error (a peer died or hangs): the caller raises, nothing waits forever.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define CPU_PAUSE() __asm__ __volatile__("yield")
#else
#define CPU_PAUSE() ((void)0)
#endif

#define MAX_RANKS 64
#define LINE 64
#define HEADER_BYTES (MAX_RANKS * LINE)

typedef uint16_t bf16;

int shm_max_ranks(void) { return MAX_RANKS; }
long shm_header_bytes(void) { return HEADER_BYTES; }

static inline uint64_t *counter(char *base, int rank) { return (uint64_t *)(base + (long)rank * LINE); }
static inline char *slot_of(char *base, int world, long slot, uint64_t round, int rank) {
    return base + HEADER_BYTES + ((long)(round & 1) * world + rank) * slot;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Wait until every rank's counter has reached `round`: 0, or -1 after timeout_s seconds. */
static int wait_all(char *base, int world, uint64_t round, double timeout_s) {
    const double start = now_s();
    long spins = 0;
    for (int j = 0; j < world; j++) {
        while (__atomic_load_n(counter(base, j), __ATOMIC_ACQUIRE) < round) {
            spins++;
            if (spins < 4096) {
                CPU_PAUSE();
                continue;
            }
            const double waited = now_s() - start;
            if (waited > timeout_s) return -1;
            if (waited < 2e-3) {
                sched_yield();
            } else {
                struct timespec nap = {0, 20000}; /* 20 us */
                nanosleep(&nap, 0);
            }
        }
    }
    return 0;
}

/* One round's first half: this rank's chunk into its slot, its counter to `round`, then every rank's arrival. */
static int arrive(char *base, int world, int rank, long slot, uint64_t round, const void *chunk, long bytes,
                  double timeout_s) {
    memcpy(slot_of(base, world, slot, round, rank), chunk, bytes);
    __atomic_store_n(counter(base, rank), round, __ATOMIC_RELEASE);
    return wait_all(base, world, round, timeout_s);
}

static inline float from_bf16(bf16 h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
static inline bf16 to_bf16(float f) { /* round to nearest even, NaN to a quiet NaN */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    return (bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* out[m] = the sum of the ranks' slots of `round` from element `at` on, in rank order: fp32, or bf16 summed in fp32
 * and rounded once */
static void sum_f32(char *base, int world, long slot, uint64_t round, long at, float *out, long m) {
    const float *s0 = (const float *)slot_of(base, world, slot, round, 0) + at;
    for (long i = 0; i < m; i++) out[i] = s0[i];
    for (int j = 1; j < world; j++) {
        const float *sj = (const float *)slot_of(base, world, slot, round, j) + at;
        for (long i = 0; i < m; i++) out[i] += sj[i];
    }
}
static void sum_bf16(char *base, int world, long slot, uint64_t round, long at, bf16 *out, long m) {
    for (long i = 0; i < m; i++) {
        float acc = from_bf16(((const bf16 *)slot_of(base, world, slot, round, 0))[at + i]);
        for (int j = 1; j < world; j++) acc += from_bf16(((const bf16 *)slot_of(base, world, slot, round, j))[at + i]);
        out[i] = to_bf16(acc);
    }
}

/* x[n] (fp32, or bf16 when is_bf16; in place) = the sum over the ranks of their x, in rank order. Returns the next
 * round's number, or -1 on a timeout. `round` is this rank's next round (1 on a fresh segment); every rank passes
 * the same. */
long long shm_all_reduce(char *base, int world, int rank, long slot, long long round, char *x, long n, int is_bf16,
                         double timeout_s) {
    const long size = is_bf16 ? (long)sizeof(bf16) : (long)sizeof(float), per = slot / size;
    for (long off = 0; off < n; off += per, round++) {
        const long m = n - off < per ? n - off : per;
        if (arrive(base, world, rank, slot, (uint64_t)round, x + off * size, m * size, timeout_s)) return -1;
        if (is_bf16)
            sum_bf16(base, world, slot, (uint64_t)round, 0, (bf16 *)(x + off * size), m);
        else
            sum_f32(base, world, slot, (uint64_t)round, 0, (float *)(x + off * size), m);
    }
    return round;
}

/* out[m] = the sum over the ranks, in rank order, of their x[rank * m .. (rank + 1) * m) (x holds world * m elements,
 * fp32 or bf16; x is left as it is). A round carries the same c output elements of every rank's piece: a rank copies
 * its x's c-element run of each piece into its slot (piece r at r * c), then sums only its own piece over the slots,
 * so it reads world * m elements in all where an all-reduce and a slice would read world * world * m. Returns the
 * next round, or -1. */
long long shm_reduce_scatter(char *base, int world, int rank, long slot, long long round, const char *x, long m,
                             int is_bf16, char *out, double timeout_s) {
    const long size = is_bf16 ? (long)sizeof(bf16) : (long)sizeof(float), per = slot / size / world;
    for (long off = 0; off < m; off += per, round++) {
        const long c = m - off < per ? m - off : per;
        char *mine = slot_of(base, world, slot, (uint64_t)round, rank);
        for (int r = 0; r < world; r++) memcpy(mine + (long)r * c * size, x + ((long)r * m + off) * size, c * size);
        __atomic_store_n(counter(base, rank), (uint64_t)round, __ATOMIC_RELEASE);
        if (wait_all(base, world, (uint64_t)round, timeout_s)) return -1;
        if (is_bf16)
            sum_bf16(base, world, slot, (uint64_t)round, (long)rank * c, (bf16 *)(out + off * size), c);
        else
            sum_f32(base, world, slot, (uint64_t)round, (long)rank * c, (float *)(out + off * size), c);
    }
    return round;
}

/* out[world][nbytes] = every rank's in[nbytes] (rank j's at out + j * nbytes). Returns the next round, or -1. */
long long shm_all_gather(char *base, int world, int rank, long slot, long long round, const char *in, long nbytes,
                         char *out, double timeout_s) {
    for (long off = 0; off < nbytes; off += slot, round++) {
        const long m = nbytes - off < slot ? nbytes - off : slot;
        if (arrive(base, world, rank, slot, (uint64_t)round, in + off, m, timeout_s)) return -1;
        for (int j = 0; j < world; j++) memcpy(out + (long)j * nbytes + off, slot_of(base, world, slot, round, j), m);
    }
    return round;
}
