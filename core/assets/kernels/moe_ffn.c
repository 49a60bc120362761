/* A layer's routed experts in one call, bf16 weights and activations, AVX-512 BF16 (vdpbf16ps).

   For tokens x [T, D] routed to k of E experts with weights w [T, k]: out = sum_j w_j *
   down_e(silu(gate_e(x)) * up_e(x)), e = idx[t, j]. oneDNN's packed bf16 GEMM reaches 62-79 % of the
   machine's peak at the 16-32 rows an expert sees in a decode step (two Zen 5 cores); this kernel
   keeps a tile of up to 6 rows x 64 columns of fp32 sums in registers, streams each weight panel once
   in the order it is stored, block by block (software prefetch one block ahead, to L2), and fuses what
   torch runs as separate passes: the gather of each expert's rows (read in place through the token
   index), SiLU(gate) * up (in fp32, rounded once to bf16), the routing weight and the sum over experts
   (in fp32, rounded once). `mlight_linear` runs a dense projection on the same panels.

   Packed layouts, made once at load by core/model/cpu/ffn.py (bf16 pairs along K, as vdpbf16ps reads),
   expert e's at w13 + e * s13 and w2 + e * s2 (elements):
     gate/up of expert e: I/32 panels, panel p = [D/2][4][16][2]: vectors 0-1 gate columns 32p..32p+31,
       vectors 2-3 up columns 32p..32p+31;
     down of expert e: D/64 panels, panel p = [I/2][4][16][2]: output columns 64p..64p+63.
   Threads (OpenMP, on the libgomp torch has loaded): gate/up panels then down panels are split into
   contiguous runs, one per thread, with one barrier between; each thread owns its output columns.
   Scratch (bytes from mlight_moe_scratch): routing order, the bf16 [T*k, I] intermediate, and per thread
   a fp32 [T, 64] sum and the [T*k, 64] sums a panel's tiles carry between K blocks. Returns 0, or -1 for an expert id out of range.
   Built with -mamx-tile -mamx-bf16 (an AMX CPU), experts with AMX_MIN_ROWS rows or more run on AMX tiles instead
   (`panel_amx`), over the same panels, the rows gathered first into the scratch. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MLIGHT_AMX 1
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define MLIGHT_AMX 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 4  /* 16-float vectors per tile row: 64 output columns */
#define MR 6  /* rows per tile: 24 accumulators + 4 weight vectors + a broadcast in 32 registers */
#ifndef PREFETCH_MIN_ROWS
#define PREFETCH_MIN_ROWS 2 /* rows a panel needs before its tiles prefetch the next block (see `panel`) */
#endif
#ifndef KC
#define KC 64 /* K pairs a block: 16 KB of a 64-column panel, read by every tile of an expert's rows from L1 */
#endif

static inline __m512 exp512(__m512 x) { /* 2^n * p(r), relative error < 2e-7; saturates to 0 / inf */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu_mul(__m512 g, __m512 u) { /* g * sigmoid(g) * u */
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.f))), u);
}

/* 16 fp32 -> 16 bf16, round to nearest even (vcvtneps2bf16) */
static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* One tile: M rows (a compile-time constant in each instance, so the sums stay in registers) of an
   input against K pairs k0..k0+kn of a 64-column panel (w: that block), its sums carried between blocks
   in `acc` (fp32 [M][64]; zeros before the first block), the epilogue after the last. GATE_UP: rows of
   x, gathered through tok; out[r] = silu(gate) * up (32 bf16). Else: rows of the intermediate;
   sum[tok[r]] += weight * y (64 fp32). Meanwhile it prefetches its share (`lines` from `next`) of the
   block that follows, spread over its K steps, into L2 (T2), not L1: a prefetch to L1 holds one of the
   core's few L1 miss buffers for a whole trip to memory, and at the 8-16 rows an expert sees in a B = 32-64
   step those ran out (the stream stalled the arithmetic: 1.2-1.5x slower there on two Zen 4 cores, the
   same from 32 rows up); the first tile's loads bring the block from L2 to L1. */
enum { GATE_UP, DOWN };

static inline __attribute__((always_inline)) void tile(const int M, const int mode, const uint16_t *in, int64_t ld,
                                                       const int32_t *tok, const float *wt, const uint16_t *w,
                                                       int64_t k0, int64_t kn, float *acc_buf, int first, int last,
                                                       uint16_t *mid, int64_t I, float *sum, const char *next,
                                                       int64_t lines) {
    __m512 acc[MR][NR];
    const int64_t per_step = (lines + kn - 1) / kn;
    const uint16_t *rows[MR];
    for (int m = 0; m < M; m++) {
        rows[m] = (mode == GATE_UP ? in + (int64_t)tok[m] * ld : in + m * ld) + 2 * k0;
        for (int v = 0; v < NR; v++)
            acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + m * 64 + 16 * v);
    }
    for (int64_t k2 = 0; k2 < kn; k2++, w += 32 * NR) {
        for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T2);
        __m512bh wv[NR];
        for (int v = 0; v < NR; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
        for (int m = 0; m < M; m++) {
            int32_t pair;
            memcpy(&pair, rows[m] + 2 * k2, 4);
            __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NR; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], b, wv[v]);
        }
    }
    for (int m = 0; m < M; m++) {
        if (!last) {
            for (int v = 0; v < NR; v++) _mm512_storeu_ps(acc_buf + m * 64 + 16 * v, acc[m][v]);
        } else if (mode == GATE_UP) {
            store_bf16(mid + m * I, silu_mul(acc[m][0], acc[m][2]));
            store_bf16(mid + m * I + 16, silu_mul(acc[m][1], acc[m][3]));
        } else {
            float *s = sum + (int64_t)tok[m] * 64;
            __m512 g = _mm512_set1_ps(wt[m]);
            for (int v = 0; v < NR; v++)
                _mm512_storeu_ps(s + 16 * v, _mm512_fmadd_ps(acc[m][v], g, _mm512_loadu_ps(s + 16 * v)));
        }
    }
}

#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
#define TILES(M)                                                                                           \
static void tile_##M(int mode, const uint16_t *in, int64_t ld, const int32_t *tok, const float *wt,        \
                     const uint16_t *w, int64_t k0, int64_t kn, float *acc, int first, int last,           \
                     uint16_t *mid, int64_t I, float *sum, const char *next, int64_t lines) {              \
    if (mode == GATE_UP)                                                                                   \
        tile(M, GATE_UP, in, ld, tok, 0, w, k0, kn, acc, first, last, mid, I, 0, next, lines);             \
    else                                                                                                   \
        tile(M, DOWN, in, ld, tok, wt, w, k0, kn, acc, first, last, 0, I, sum, next, lines);               \
}
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#pragma GCC pop_options

typedef void (*tile_fn)(int, const uint16_t *, int64_t, const int32_t *, const float *, const uint16_t *, int64_t,
                        int64_t, float *, int, int, uint16_t *, int64_t, float *, const char *, int64_t);
static const tile_fn TILE[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* A panel for an expert's n rows, K pairs in blocks of KC: every tile reads a block while it is in L1
   (the first tile brings it in), and the tiles of one block together prefetch the next (the panel's next
   block, or `bytes` of `next`: the first block of this thread's next panel). So the memory streams
   evenly whatever the number of tiles, and what the cache holds ahead is one block, never a panel
   (a 64-column panel of K = 7168 is 896 KB: a second one prefetched beside it overflowed L2).
   A single row (a B = 1 decode step) prefetches nothing: the panel is then one plain sequential stream that
   the hardware prefetcher follows on its own, and the T2 hints only took load slots from it (a layer's
   experts read at 17-18 GB/s with them, 19-20 without, one Zen 5 core whose plain read runs at 22-23).
   GATE_UP: mid[r, 32p..32p+31] = silu(gate) * up; DOWN: sum[tok, 0..63] += weight * (mid row @ panel). */
static void panel(int mode, const uint16_t *in, int64_t ld, const int32_t *tok, const float *wt, int64_t n,
                  const uint16_t *w, int64_t K2, float *acc, uint16_t *mid, int64_t I, float *sum,
                  const uint16_t *next, int64_t bytes) {
    const int64_t tiles = (n + MR - 1) / MR;
    const int prefetch = n >= PREFETCH_MIN_ROWS;
    for (int64_t k0 = 0; k0 < K2; k0 += KC) {
        const int64_t kn = K2 - k0 < KC ? K2 - k0 : KC;
        const int more = k0 + KC < K2; /* the next block: this panel's, or the thread's next work */
        const char *nb = more ? (const char *)(w + (k0 + KC) * 32 * NR) : (const char *)next;
        const int64_t lines = !prefetch ? 0
                            : more ? (K2 - k0 - KC < KC ? K2 - k0 - KC : KC) * 4 : (bytes < KC * 256 ? bytes : KC * 256) / 64;
        for (int64_t t = 0; t < tiles; t++) { /* balanced: 13 rows are tiles of 5, 4, 4, not 6, 6, 1 */
            const int64_t r = n * t / tiles, m = n * (t + 1) / tiles - r, a = lines * t / tiles, b = lines * (t + 1) / tiles;
            TILE[m](mode, mode == GATE_UP ? in : in + r * ld, ld, tok + r, wt ? wt + r : 0, w + k0 * 32 * NR, k0, kn,
                    acc + r * 64, k0 == 0, k0 + kn == K2, mode == GATE_UP ? mid + r * I : 0, I, sum, nb + 64 * a, b - a);
        }
    }
}

#if MLIGHT_AMX
/* AMX (built with -mamx-tile -mamx-bf16 where the CPU has it): the same panels as 16 x 16 bf16-pair tiles.
   A panel block of K pairs is [K][4][16][2], so the 16 columns j of 16 pairs are one B tile, rows 256 bytes
   apart; the input rows, 16 at a time, are A tiles; each 16-row block's 64 sums are four C tiles. On the
   Xeon of the nineteenth session oneDNN's AMX GEMM ran a layer's experts 2.3-5x faster than the vector
   tiles from 16 rows an expert up: those are compute-bound there, and a tile does 16 rows x 16 columns x 32
   in one instruction. Rows are read 16 at a time, past n where n is not a multiple of 16: the callers keep
   those readable (scratch padding); their sums are never used. */
#define KC_AMX 512 /* K pairs a block: 128 KB of a panel, read from L2 by every 32-row block; 256 was 2-6 % slower */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8 /* fewer rows an expert: the vector tiles */
#endif

static int amx_ready = 0;

/* Linux hands a process the AMX state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
   without it the first tile instruction faults. Windows enables it for every process. 0: ready. */
int mlight_moe_amx_init(void) {
    if ((_xgetbv(0) & 0x60000) != 0x60000) return -1; /* the OS saves no tile state (XCR0 bits 17-18) */
#ifdef __linux__
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return -1;
#endif
    amx_ready = 1;
    return 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_begin(void) { /* every tile 16 rows x 64 bytes, in this thread */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

/* One 16-row block against K pairs [k0, k0 + kn) of a panel block `w`: sums carried in acc ([16][64] fp32). */
static inline void amx_block(const uint16_t *in, int64_t ld, const uint16_t *w, int64_t k0, int64_t kn, float *acc,
                             int first, const char *next, int64_t lines) {
    if (first) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, acc, 256); _tile_loadd(1, acc + 16, 256); _tile_loadd(2, acc + 32, 256); _tile_loadd(3, acc + 48, 256);
    }
    const int64_t steps = kn / 16, per_step = (lines + steps - 1) / (steps ? steps : 1);
    for (int64_t s = 0; s < steps; s++) {
        for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T2);
        const uint16_t *b = w + s * 16 * 128;
        _tile_loadd(4, in + 2 * (k0 + 16 * s), 2 * ld);
        _tile_loadd(5, b, 256);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 32, 256);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 64, 256);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 96, 256);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, acc, 256); _tile_stored(1, acc + 16, 256); _tile_stored(2, acc + 32, 256); _tile_stored(3, acc + 48, 256);
}

/* Two 16-row blocks at once, in two passes over the panel's column halves: per K step two A and two B tiles feed
   four products (2 x 2), so each B tile, the stream from L2, is loaded once for 32 rows, not twice. */
static inline void amx_block2(const uint16_t *in, int64_t ld, const uint16_t *w, int64_t k0, int64_t kn, float *acc,
                              int first, const char *next, int64_t lines) {
    const int64_t steps = kn / 16, per_step = (lines + 2 * steps - 1) / (steps ? 2 * steps : 1);
    float *a1 = acc + 16 * 64;
    for (int h = 0; h < 64; h += 32) {
        if (first) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        } else {
            _tile_loadd(0, acc + h, 256); _tile_loadd(1, acc + h + 16, 256);
            _tile_loadd(2, a1 + h, 256); _tile_loadd(3, a1 + h + 16, 256);
        }
        for (int64_t s = 0; s < steps; s++) {
            for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T2);
            const uint16_t *b = w + s * 16 * 128 + 2 * h; /* columns h..h+31: B tiles h/16 and h/16 + 1 */
            _tile_loadd(4, in + 2 * (k0 + 16 * s), 2 * ld);
            _tile_loadd(6, b, 256);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 32, 256);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, in + 16 * ld + 2 * (k0 + 16 * s), 2 * ld);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc + h, 256); _tile_stored(1, acc + h + 16, 256);
        _tile_stored(2, a1 + h, 256); _tile_stored(3, a1 + h + 16, 256);
    }
}

/* `panel` on tiles: `in` holds the n rows contiguously (ld apart, readable to a multiple of 16), K2 a multiple of
   16; the epilogue as the vector tiles' (GATE_UP: mid rows; DOWN: sum[tok] += weight * y) from acc. */
static void panel_amx(int mode, const uint16_t *in, int64_t ld, const int32_t *tok, const float *wt, int64_t n,
                      const uint16_t *w, int64_t K2, float *acc, uint16_t *mid, int64_t I, float *sum,
                      const uint16_t *next, int64_t bytes) {
    const int64_t blocks = (n + 15) / 16;
    for (int64_t k0 = 0; k0 < K2; k0 += KC_AMX) {
        const int64_t kn = K2 - k0 < KC_AMX ? K2 - k0 : KC_AMX;
        const int more = k0 + KC_AMX < K2;
        const char *nb = more ? (const char *)(w + (k0 + KC_AMX) * 128) : (const char *)next;
        const int64_t lines = more ? (K2 - k0 - KC_AMX < KC_AMX ? K2 - k0 - KC_AMX : KC_AMX) * 4
                                   : (bytes < KC_AMX * 256 ? bytes : KC_AMX * 256) / 64;
        for (int64_t r = 0; r < blocks; r += 2) {
            const int64_t a = lines * r / blocks, b = lines * (r + 2 < blocks ? r + 2 : blocks) / blocks;
            if (r + 1 < blocks)
                amx_block2(in + r * 16 * ld, ld, w + k0 * 128, k0, kn, acc + r * 16 * 64, k0 == 0, nb + 64 * a, b - a);
            else
                amx_block(in + r * 16 * ld, ld, w + k0 * 128, k0, kn, acc + r * 16 * 64, k0 == 0, nb + 64 * a, b - a);
        }
    }
    for (int64_t m = 0; m < n; m++) {
        const float *a = acc + m * 64;
        if (mode == GATE_UP) {
            store_bf16(mid + m * I, silu_mul(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 32)));
            store_bf16(mid + m * I + 16, silu_mul(_mm512_loadu_ps(a + 16), _mm512_loadu_ps(a + 48)));
        } else {
            float *s = sum + (int64_t)tok[m] * 64;
            __m512 g = _mm512_set1_ps(wt[m]);
            for (int v = 0; v < NR; v++) _mm512_storeu_ps(s + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * v), g, _mm512_loadu_ps(s + 16 * v)));
        }
    }
}
#endif

int mlight_moe_amx(void) { /* 1: built with the tile path and the process may use it */
#if MLIGHT_AMX
    return amx_ready;
#else
    return 0;
#endif
}

/* the first expert after e that got rows, or E */
static inline int64_t next_expert(const int32_t *start, int64_t E, int64_t e) {
    for (e++; e < E && start[e + 1] == start[e]; e++) {}
    return e;
}

static inline int64_t align64(int64_t b) { return (b + 63) & ~(int64_t)63; }

/* 16 rows past T * k in the intermediate, the gathered rows and the carried sums: the tiles read and write
   16 rows at a time */
int64_t mlight_moe_scratch(int64_t T, int64_t k, int64_t E, int64_t D, int64_t I, int64_t threads) {
    return 2 * align64(4 * (E + 1)) + align64(4 * T * k) + align64(4 * T * k) + align64(2 * (T * k + 16) * I) +
           (MLIGHT_AMX ? align64(2 * (T * k + 16) * D) : 0) +
           (align64(4 * T * 64) + align64(4 * (T * k + 16) * 64)) * threads + 64;
}

int mlight_moe_ffn(const uint16_t *x, int64_t T, int64_t k, const int64_t *idx, const void *wts, int wts_bf16,
                   int64_t E, int64_t D, int64_t I, const uint16_t *w13, int64_t s13, const uint16_t *w2, int64_t s2,
                   uint16_t *out, void *scratch, int threads) {
    char *s = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *start = (int32_t *)s, *fill = (int32_t *)(s + align64(4 * (E + 1)));
    s += 2 * align64(4 * (E + 1));
    int32_t *tok = (int32_t *)s;
    s += align64(4 * T * k);
    float *wt = (float *)s;
    s += align64(4 * T * k);
    uint16_t *mid = (uint16_t *)s;
    s += align64(2 * (T * k + 16) * I);
    uint16_t *xs = (uint16_t *)s; /* the rows in expert order, for the tiles */
    s += MLIGHT_AMX ? align64(2 * (T * k + 16) * D) : 0;
    float *sums = (float *)s;
    /* the (token, slot) pairs grouped by expert, tokens ascending within each (a counting sort) */
    memset(start, 0, 4 * (E + 1));
    for (int64_t i = 0; i < T * k; i++) {
        if (idx[i] < 0 || idx[i] >= E) return -1;
        start[idx[i] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, 4 * E);
    for (int64_t i = 0; i < T * k; i++) {
        int32_t at = fill[idx[i]]++;
        tok[at] = (int32_t)(i / k);
        if (wts_bf16) {
            uint32_t b = (uint32_t)((const uint16_t *)wts)[i] << 16;
            memcpy(wt + at, &b, 4);
        } else {
            wt[at] = ((const float *)wts)[i];
        }
    }
    const int64_t PA = I / 32, PB = D / 64;
    int amx = 0; /* some expert has rows enough for the tiles */
#if MLIGHT_AMX
    for (int64_t e = 0; amx_ready && e < E; e++) /* the rows of the experts the tiles run, in expert order */
        if (start[e + 1] - start[e] >= AMX_MIN_ROWS) {
            amx = 1;
            for (int64_t i = start[e]; i < start[e + 1]; i++) memcpy(xs + i * D, x + (int64_t)tok[i] * D, 2 * D);
        }
#endif
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
#if MLIGHT_AMX
        if (amx) amx_begin();
#endif
        const int64_t a0 = PA * id / nt, a1 = PA * (id + 1) / nt, b0 = PB * id / nt, b1 = PB * (id + 1) / nt;
        const int64_t first = next_expert(start, E, -1);
        float *sum = sums + (int64_t)id * ((align64(4 * T * 64) + align64(4 * (T * k + 16) * 64)) / 4);
        float *acc = sum + align64(4 * T * 64) / 4; /* a panel's sums between K blocks, [rows][64] */
        for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
            const int64_t n = start[e + 1] - start[e], en = next_expert(start, E, e);
            for (int64_t p = a0; p < a1; p++) {
                /* what this thread reads next: the following panel, the next expert's first, or its first down panel */
                const uint16_t *nx = p + 1 < a1 ? w13 + e * s13 + (p + 1) * D * 64
                                   : en < E ? w13 + en * s13 + a0 * D * 64 : w2 + first * s2 + b0 * I * 64;
                const int64_t nb = p + 1 < a1 || en < E ? D * 128 : (b0 < b1 ? I * 128 : 0);
#if MLIGHT_AMX
                if (amx && n >= AMX_MIN_ROWS) {
                    panel_amx(GATE_UP, xs + start[e] * D, D, 0, 0, n, w13 + e * s13 + p * D * 64, D / 2, acc,
                              mid + start[e] * I + p * 32, I, 0, nx, nb);
                    continue;
                }
#endif
                panel(GATE_UP, x, D, tok + start[e], 0, n, w13 + e * s13 + p * D * 64, D / 2, acc,
                      mid + start[e] * I + p * 32, I, 0, nx, nb);
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int64_t p = b0; p < b1; p++) {
            memset(sum, 0, 4 * T * 64);
            for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
                const int64_t en = next_expert(start, E, e);
                const uint16_t *nx = en < E ? w2 + en * s2 + p * I * 64 : w2 + first * s2 + (p + 1) * I * 64;
                const int64_t n = start[e + 1] - start[e];
#if MLIGHT_AMX
                if (amx && n >= AMX_MIN_ROWS) {
                    panel_amx(DOWN, mid + start[e] * I, I, tok + start[e], wt + start[e], n, w2 + e * s2 + p * I * 64,
                              I / 2, acc, 0, I, sum, nx, en < E || p + 1 < b1 ? I * 128 : 0);
                    continue;
                }
#endif
                panel(DOWN, mid + start[e] * I, I, tok + start[e], wt + start[e], n,
                      w2 + e * s2 + p * I * 64, I / 2, acc, 0, I, sum, nx, en < E || p + 1 < b1 ? I * 128 : 0);
            }
            for (int64_t t = 0; t < T; t++)
                for (int v = 0; v < NR; v++) store_bf16(out + t * D + p * 64 + 16 * v, _mm512_loadu_ps(sum + t * 64 + 16 * v));
        }
#if MLIGHT_AMX
        if (amx) _tile_release();
#endif
    }
    return 0;
}

/* A dense projection on the same panels: out[t, n] = bf16(sum_k x[t, k] w[n, k] (+ bias[n])), the sum in fp32
   rounded once (as oneDNN's bf16 GEMM does). w packed as the down weights: N/64 panels [K/2][4][16][2]; x rows
   ldx apart, out rows ldo apart; bias bf16 [N] or null. The DOWN tiles with every row its own token and a
   weight of 1 (sum + 1 * acc is acc exactly); threads split the panels. At one row, the decode step of a
   single stream, oneDNN's packed GEMV read a cold 1536 x 1024 QKV at 10-12 GB/s on two Zen 4 cores. */
int64_t mlight_linear_scratch(int64_t T, int64_t K, int64_t threads) {
    return 2 * align64(4 * T) + (MLIGHT_AMX ? align64(2 * (T + 16) * K) : 0) + 2 * align64(4 * (T + 16) * 64) * threads + 64;
}

void mlight_linear(const uint16_t *x, int64_t T, int64_t ldx, int64_t K, const uint16_t *w, int64_t N,
                   const uint16_t *bias, uint16_t *out, int64_t ldo, void *scratch, int threads) {
    char *s = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *tok = (int32_t *)s;
    float *one = (float *)(s + align64(4 * T));
    s += 2 * align64(4 * T);
    uint16_t *xp = (uint16_t *)s; /* the rows, contiguous and readable to a multiple of 16, for the tiles */
    s += MLIGHT_AMX ? align64(2 * (T + 16) * K) : 0;
    float *sums = (float *)s;
    for (int64_t t = 0; t < T; t++) tok[t] = (int32_t)t, one[t] = 1.f;
    const int64_t P = N / 64;
    int amx = 0;
#if MLIGHT_AMX
    amx = amx_ready && T >= AMX_MIN_ROWS && (K / 2) % 16 == 0;
    if (amx)
        for (int64_t t = 0; t < T; t++) memcpy(xp + t * K, x + t * ldx, 2 * K);
#endif
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
        const int64_t p0 = P * id / nt, p1 = P * (id + 1) / nt;
        float *sum = sums + (int64_t)id * 2 * (align64(4 * (T + 16) * 64) / 4), *acc = sum + align64(4 * (T + 16) * 64) / 4;
#if MLIGHT_AMX
        if (amx) amx_begin();
#endif
        for (int64_t p = p0; p < p1; p++) {
            memset(sum, 0, 4 * T * 64);
#if MLIGHT_AMX
            if (amx)
                panel_amx(DOWN, xp, K, tok, one, T, w + p * K * 64, K / 2, acc, 0, 0, sum, w + (p + 1) * K * 64,
                          p + 1 < p1 ? K * 128 : 0);
            else
#endif
            panel(DOWN, x, ldx, tok, one, T, w + p * K * 64, K / 2, acc, 0, 0, sum, w + (p + 1) * K * 64,
                  p + 1 < p1 ? K * 128 : 0);
            for (int64_t t = 0; t < T; t++)
                for (int v = 0; v < NR; v++) {
                    __m512 y = _mm512_loadu_ps(sum + t * 64 + 16 * v);
                    if (bias) {
                        __m256i b = _mm256_loadu_si256((const __m256i *)(bias + p * 64 + 16 * v));
                        y = _mm512_add_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
                    }
                    store_bf16(out + t * ldo + p * 64 + 16 * v, y);
                }
        }
#if MLIGHT_AMX
        if (amx) _tile_release();
#endif
    }
}

int mlight_moe_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
