/* A few tokens' routed experts and dense rows on GGUF blocks, Q8_0 and K-quant rows dotted where they lie (decode
   at a small batch: each expert read once for all its tokens; the K-quants' rows also against an expert's few
   activation rows).

   gguf_matmul.c's one-token call decodes each weight row into a buffer of the thread's (the bytes copied,
   each block's half scale widened into two floats) and dots that buffer with the activations: at one
   activation row the copy costs about what the dot does, and the call read Q8_0 experts at half of what one
   core streams (5 of 10-11 GB/s on a 2-core Xeon, the 784M Mixtral's experts). A Q8_0 block is already the
   dot's operands (an f16 scale and 32 signed bytes), so here the dot reads the block itself: the same integer
   dots, the same float products and the same lane order as gguf_matmul.c's int8 tiles (AVX-512 VNNI: two
   blocks a 512-bit vector, even blocks in the low lanes; AVX2: even and odd blocks in two accumulators;
   plain C: 16 lanes), so the result equals `mlight_gguf_moe`'s int8 path bit for bit
   (tests/test_gguf_token.py).

   The K-quants (Q4_K, Q5_K, Q6_K; with AVX-512 VNNI) keep gguf_matmul.c's int16 arithmetic (activations int16
   a 256, the weights int16 with their sub-scales folded in, a super-block's dot an int32 a lane) and so its
   result bit for bit, but four weight rows a tile against the one activation row (their dots overlapping:
   1.25x one row), each super-block's scales unpacked in registers (through the stack they took a third of a
   Q4_K super-block's time) and the next rows prefetched. On the 784M Mixtral's expert shapes (Zen 5, one
   thread, weights from memory) that read Q4_K at 1.2-1.3x gguf_matmul.c's one-row kernel, Q6_K at 1.0x
   (bench/gguf_speed.py --kernel --paths main:int16,token); the same integers on u8 x s8 dots (k8_rows: the
   weights left bytes, the activations split into two bytes once a token) read them at 1.1-1.3x that again
   (Q4_K 24-25, Q5_K 21, Q6_K 15-16 G weights/s). mlight_gguf_token_linear takes a few activation
   rows too (an expert's rows at a small batch's decode): one weight row against up to TM of them, each 32
   values unpacked once for all, 1.1-1.6x gguf_matmul.c's k16 tiles at 2-8 rows (the same shapes). With AVX2
   and in plain C these rows are decoded first, as in gguf_matmul.c. Other formats take gguf_matmul.c's row
   decode as before.

   gguf_matmul.c is compiled into this library (its quantization, SiLU and decoders are the reference here,
   not a copy); the build's flags carry a hash of it, so a change there builds this afresh
   (core.model.cpu.gguf_token). */

#include "gguf_matmul.c"

/* the plain-C integers and floats of tile_scalar (the same float as the SIMD dots) */
static float dot_q8_0_c(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd) {
    float acc[16] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 34 * b;
        const int8_t *u = (const int8_t *)(p + 2);
        float sd = f16f(p) * xd[b], *a = acc + 8 * (b & 1);
        for (int i = 0; i < 8; i++) {
            int t = 0;
            for (int j = 0; j < 4; j++) t += (int)u[4 * i + j] * (int)xq[32 * b + 4 * i + j];
            a[i] = FMA((float)t, sd, a[i]);
        }
    }
    float c[8];
    for (int i = 0; i < 8; i++) c[i] = acc[i] + acc[i + 8];
    float e0 = c[0] + c[4], e1 = c[1] + c[5], e2 = c[2] + c[6], e3 = c[3] + c[7];
    return (e0 + e2) + (e1 + e3);
}

#define TM 4 /* activation rows a tile of the in-place K-quant dots */
#define AHEAD 4096 /* bytes prefetched ahead of the dot: without it one core streamed 8-11 GB/s here, with it 17-25
                          (2-core Xeon VM; the hardware prefetchers alone fall behind) */

/* w . x for one Q8_0 row of nb blocks and x quantized per 32 (q, d): gguf_matmul.c's tile_simd with the
   block's own bytes and scale in place of the decoded row's. AVX-512: the scale products of 16 blocks at once
   (their halves gathered, 34 bytes apart), a pair's lanes permuted out of them */
static float dot_q8_0(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd) {
#if SIMD == 2
    const __m512i at = _mm512_set_epi32(15 * 34, 14 * 34, 13 * 34, 12 * 34, 11 * 34, 10 * 34, 9 * 34, 8 * 34,
                                        7 * 34, 6 * 34, 5 * 34, 4 * 34, 3 * 34, 2 * 34, 34, 0);
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (int64_t b0 = 0; b0 + 2 <= nb; b0 += 16) {
        int64_t n = nb - b0 < 16 ? nb - b0 : 16;
        __mmask16 live = (__mmask16)((1u << n) - 1);
        const uint8_t *p0 = row + 34 * b0;
        __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, (const void *)p0, 1);
        __m512 sd = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_maskz_loadu_ps(live, xd + b0));
        for (int64_t j = 0; j + 2 <= n; j += 2) {
            const uint8_t *p = p0 + 34 * j;
            _mm_prefetch((const char *)(p + AHEAD), _MM_HINT_T0);
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2))),
                                           _mm256_loadu_si256((const __m256i *)(p + 36)), 1);
            __m512i a = _mm512_abs_epi8(v), q = _mm512_loadu_si512(xq + 32 * (b0 + j));
            q = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(v), _mm512_setzero_si512(), q);
            __m512 s = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32((int)j)), sd);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, q)), s, acc);
        }
        b = b0 + (n & ~(int64_t)1);
    }
    __m256 lo = _mm512_castps512_ps256(acc), hi = _mm512_extractf32x8_ps(acc, 1);
    if (b < nb) { /* an odd block count: the last block is even, the low lanes' */
        const uint8_t *p = row + 34 * b;
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 2)), a = _mm256_abs_epi8(v);
        __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + 32 * b)), v);
        lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(a, q)), _mm256_set1_ps(f16f(p) * xd[b]), lo);
    }
    return hsum8(_mm256_add_ps(lo, hi));
#elif SIMD == 1
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 34 * b;
        if (!(b & 1)) _mm_prefetch((const char *)(p + AHEAD), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 2)), a = _mm256_abs_epi8(v);
        __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + 32 * b)), v);
        acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(a, q)), _mm256_set1_ps(f16f(p) * xd[b]), acc[b & 1]);
    }
    return hsum8(_mm256_add_ps(acc[0], acc[1]));
#else
    return dot_q8_0_c(row, nb, xq, xd);
#endif
}

#if SIMD == 2
/* ---- a few activation rows of int8 on u8 x s8 dots -------------------------------------------------------
   At a few tokens these dots read the weights at about what two cores stream, so their instructions count. Here
   the weights stay the file's unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) in their own order, and each
   activation row is quantized to int8 once a token for the kind's layout (split8): a super-block of 256 values
   takes one scale d = max|x| / 127 and each 32 of it a power of two 2^-e (e = 0..SH, the largest e with
   2^e max|x of the 32| <= max|x|), q = round(x 2^e / d), so x = q d 2^-e: each 32 as fine as its own values
   allow to within 2x, where one scale a 256 (llama.cpp's Q8_K) measured 2.6-2.75 % medians against the reference
   reading, past issue 44's 2.5 % bound. The power of two goes into the weight's integer sub-scale (sc << SH - e:
   |sc| <= 128, so 2^13 at most, an int16), so a super-block's whole dot stays one integer a lane: maddubs turns a
   pair of weight bytes and a pair of activation bytes into an int16 (at most 2 * 63 * 127; Q6_K's -32 offset is
   taken off the pairs as 32 (a + b), precomputed, leaving |pair| <= 2 * 32 * 127) and vpdpwssd multiplies it by
   the pair's shifted sub-scale into an int32 lane: 8 products a lane a super-block, |lane| <= 8 * 8128 * 2^13 <
   2^29, and the two halves' lanes folded < 2^30. The float work is k16_lanes': d_w d 2^-SH, the mins' products
   with each 32's shifted sums. Each 512-bit vector holds two 32s (a slot): the low and high nibbles of 64 qs bytes
   (Q4_K, Q5_K: 32s 0 and 2, 1 and 3, 4 and 6, 5 and 7), Q6_K's 32s t = 0, 1 or 2, 3 of a half. The result is the
   float64 dot of these activations with the file's weights within float32's rounding (tests/test_gguf_token.py),
   the same for a token alone or among others (the same integers and FMAs an item). */
#define KB 1024 /* bytes of a super-block's split row: q at 64v (slot v), Q6_K's pair offsets (int16) at 256 + 64v,
                   the shifts at 512 (32 int16 words: the pattern of a tile's sub-scale words), the shifted sums at
                   576 (8 int32), d 2^-SH at 608 */
#define KS 64 /* a 32's step: k D, k = 1..KS, D = max|x| / (127 KS) of its super-block */
static const int SLOT[2][4][2] = {{{0, 2}, {1, 3}, {4, 6}, {5, 7}}, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}};
static const int POS[2][8] = {{0, 64, 32, 96, 128, 192, 160, 224}, {0, 32, 64, 96, 128, 160, 192, 224}}; /* a 32's bytes */

/* the activation row x (K, bf16 or fp32) quantized and laid out for kind's slots into xb (K / 256 * KB bytes) */
static void split8(int kind, const void *x, int bf, int64_t K, int8_t *xb) {
    for (int64_t b = 0; b < K / 256; b++) {
        int8_t *o = xb + KB * b;
        float v[256], am[8], A = 0.f;
        for (int j = 0; j < 8; j++) {
            am[j] = 0.f;
            for (int i = 0; i < 32; i++) v[32 * j + i] = in_f(x, bf, 256 * b + 32 * j + i), am[j] = fmaxf(am[j], fabsf(v[32 * j + i]));
            A = fmaxf(A, am[j]);
        }
        int16_t *kw = (int16_t *)(o + 512);
        int32_t *bs = (int32_t *)(o + 576);
        const float D = A / 127.f / (float)KS; /* the finest step */
        for (int j = 0; j < 8; j++) {
            int k = A > 0.f ? (int)ceilf(am[j] * (float)KS / A) : 1; /* this 32's step: k D */
            k = k < 1 ? 1 : k > KS ? KS : k;
            const float step = D * (float)k, inv = step > 0.f ? 1.f / step : 0.f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                float r = nearbyintf(v[32 * j + i] * inv);
                int q = r > 127.f ? 127 : r < -127.f ? -127 : (int)r;
                o[POS[kind == 4][j] + i] = (int8_t)q, sum += q;
            }
            bs[j] = sum * k;
            if (kind == 4) kw[2 * j] = kw[2 * j + 1] = kw[16 + 2 * j] = kw[16 + 2 * j + 1] = (int16_t)k;
            else kw[j] = kw[16 + j] = (int16_t)k, kw[8 + j] = kw[24 + j] = 0;
        }
        if (kind == 4) { /* each 16's sum, for Q6_K's -32 */
            int16_t *s16 = (int16_t *)(o + 256);
            for (int k = 0; k < 16; k++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += o[POS[1][k / 2] + 16 * (k & 1) + i];
                s16[k] = (int16_t)sum;
            }
        }
        memcpy(o + 608, &D, 4);
    }
}

static inline __m512i idx16(int lo, int hi) { /* words 0-15: lo, 16-31: hi */
    return _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
}

/* the 16 bytes at p, p + ldw, ... of NR (1-4) rows in a 512-bit vector's 128-bit lanes (the rest zero) */
static inline __attribute__((always_inline)) __m512i lanes4(const uint8_t *p, int64_t ldw, const int NR) {
    __m512i l = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)p));
    if (NR > 1) l = _mm512_inserti32x4(l, _mm_loadu_si128((const __m128i *)(p + ldw)), 1);
    if (NR > 2) l = _mm512_inserti32x4(l, _mm_loadu_si128((const __m128i *)(p + 2 * ldw)), 2);
    if (NR > 3) l = _mm512_inserti32x4(l, _mm_loadu_si128((const __m128i *)(p + 3 * ldw)), 3);
    return l;
}

/* Q4_K / Q5_K: the first 16 bytes of NR blocks (lanes4) to, a lane each, the 8 six-bit sub-scales (bytes 0-7)
   and the 8 six-bit mins (8-15), sm_k4's unpacking in one go for the tile's rows (scale byte i at i + 4: sub-scale
   j < 4 is byte j + 4's low 6 bits, j >= 4 byte j + 8's low nibble and byte j's top 2 bits; min j < 4 byte j + 8's
   low 6 bits, j >= 4 byte j + 8's high nibble and byte j + 4's top 2 bits) */
static inline __m512i k4_scales4(__m512i l) {
    const __m512i ia = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i ib = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m512i ma = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m512i mh = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    __m512i a = _mm512_shuffle_epi8(l, ia), h = _mm512_shuffle_epi8(l, ib);
    __m512i lo = _mm512_or_si512(_mm512_and_si512(a, ma), _mm512_and_si512(_mm512_srli_epi16(a, 4), mh));
    return _mm512_or_si512(lo, _mm512_and_si512(_mm512_srli_epi16(h, 2), _mm512_set1_epi8(0x30)));
}

/* out[i] = w_r . x_m for the items i = MRC r + m of a tile: NR (1, 2, 4) weight rows ldw bytes apart of kind 2-4 (K
   values each) against MRC (1-4; NR MRC <= 8) activation rows, each split by split8 at xb[m]. Each weight row's bytes
   are unpacked once for all its items; two items' float lanes share a 512-bit vector (the same FMAs an item
   whatever the tile). */
static inline __attribute__((always_inline)) void k8_rows(const int kind, const uint8_t *row, int64_t ldw,
                                                          const int NR, int64_t K, const int8_t *const *xb,
                                                          const int MRC, float *out) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const int NI = NR * MRC, NP = (NI + 1) / 2; /* items, item pairs */
    /* six[v]: slot v's scales (int16) shuffled out of the 8 words in every 128-bit lane (vpshufb: Q4_K, Q5_K a
       row's 8 sub-scales, a 32's for each half; Q6_K scales 8 (v >> 1) .. 8 (v >> 1) + 7 of its 16, a 16's for each
       quarter) */
    __m512i six[4], bit[4];
    for (int v = 0; v < 4; v++) {
        int ja = SLOT[kind == 4][v][0], jb = SLOT[kind == 4][v][1];
        if (kind == 4) {
            const long long w = 0x0202020202020202LL, o = 0x0100010001000100LL;
            int w0 = (4 * v) % 8;
            six[v] = _mm512_set_epi64((w0 + 3) * w + o, (w0 + 3) * w + o, (w0 + 2) * w + o, (w0 + 2) * w + o,
                                      (w0 + 1) * w + o, (w0 + 1) * w + o, w0 * w + o, w0 * w + o);
        } else six[v] = idx16(ja * 0x202 + 0x100, jb * 0x202 + 0x100);
        bit[v] = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << ja)), _mm256_set1_epi8((char)(1 << jb)), 1);
    }
    /* item i's row r and activation row m as float lanes: (d_r, dmin_r) at 2i, 2i + 1 of the tile's hw, dx_m */
    int ir[16], im[16];
    for (int i = 0; i < 16; i++) ir[i] = i / 2 < NI ? 2 * (i / 2 / MRC) + (i & 1) : 0, im[i] = i / 2 < NI ? i / 2 % MRC : 0;
    const __m512i vr = _mm512_loadu_si512(ir), vm = _mm512_loadu_si512(im);
    const __m512i pair = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(2), 1); /* 0 x 8, 2 x 8 */
    __m512 acc[4];
    for (int p = 0; p < NP; p++) acc[p] = _mm512_setzero_ps();
    /* twice the tile's bytes ahead, into L1: on a quiet Zen 5 these int8 dots read experts from memory at 1.12x
       their rate into L2 (T1), a B = 1 step 5-7 % shorter (the int16 dots before them, loaded box: 0.7-0.8x) */
    int64_t ahead = 2 * (NR * ldw > AHEAD ? NR * ldw : AHEAD);
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *b0 = row + b * TS[kind];
        __m512i sw[2]; /* a row pair's scales as int16 (16 words a row) */
        __m256i mn[4]; /* each row's 8 mins as int32 */
        __m256 hw; /* d and dmin of row r at 2r, 2r + 1 */
        if (kind == 4) {
            __m512i l = lanes4(b0 + 192, ldw, NR);
            sw[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(l)), sw[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(l, 1));
            __m128i h = _mm_cvtsi32_si128(b0[208] | b0[209] << 8);
            for (int r = 1; r < NR; r++) h = _mm_insert_epi16(h, b0[r * ldw + 208] | b0[r * ldw + 209] << 8, 2 * r);
            h = _mm_or_si128(h, _mm_slli_epi32(h, 16)); /* d at 2r and 2r + 1, the second times 32: the -32's */
            hw = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set_ps(32.f, 1.f, 32.f, 1.f, 32.f, 1.f, 32.f, 1.f));
        } else {
            __m512i l = lanes4(b0, ldw, NR), sm = k4_scales4(l);
            sw[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(sm)), sw[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(sm, 1));
            const __m512i hi8 = _mm512_set_epi64(7, 7, 7, 7, 7, 5, 3, 1); /* each lane's bytes 8-15: the mins */
            __m512i mq = _mm512_permutexvar_epi64(hi8, sm);
            for (int r = 0; r < NR; r++)
                mn[r] = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(_mm_extract_epi64(_mm512_extracti32x4_epi32(mq, r >> 1), r & 1)));
            __m128i h = _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), l));
            hw = _mm256_cvtph_ps(h);
        }
        float dx[16] = {0};
        for (int m = 0; m < MRC; m++) memcpy(dx + m, xb[m] + KB * b + 608, 4);
        /* item i's d_w dx and dmin_w dx at 2i, 2i + 1 */
        const __m512 dz = _mm512_mul_ps(_mm512_permutexvar_ps(vr, _mm512_castps256_ps512(hw)),
                                        _mm512_permutexvar_ps(vm, _mm512_loadu_ps(dx)));
        __m512i t[8];
        __m256i c6[8]; /* Q6_K: each item's shifted scales times its 16s' sums, folded to 8 lanes */
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = b0 + r * ldw;
            for (int c = 0; c < TS[kind]; c += 64) _mm_prefetch((const char *)(blk + ahead + c), _MM_HINT_T0);
            __m512i u[4];
            if (kind == 4)
                for (int c = 0; c < 2; c++) {
                    __m512i lq = _mm512_loadu_si512(blk + 64 * c);
                    __m512i hq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c)));
                    u[2 * c] = _mm512_or_si512(_mm512_and_si512(lq, m4),
                                               _mm512_and_si512(_mm512_sllv_epi16(hq, idx16(4, 2)), m30));
                    u[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lq, 4), m4),
                                                   _mm512_and_si512(_mm512_srlv_epi16(hq, idx16(0, 2)), m30));
                }
            else {
                const uint8_t *qs = blk + (kind == 2 ? 16 : 48);
                for (int c = 0; c < 2; c++) {
                    __m512i v = _mm512_loadu_si512(qs + 64 * c);
                    u[2 * c] = _mm512_and_si512(v, m4), u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
                if (kind == 3) { /* Q5_K: bit j of qh's bytes is sub-block j's fifth bit */
                    __m512i hq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
                    for (int v = 0; v < 4; v++)
                        u[v] = _mm512_mask_add_epi8(u[v], _mm512_test_epi8_mask(hq, bit[v]), u[v], _mm512_set1_epi8(16));
                }
            }
            for (int m = 0; m < MRC; m++) {
                const int8_t *a = xb[m] + KB * b;
                /* the row's (first) 8 scales, shifted by this activation row's powers of two, in every 128-bit
                   lane; Q6_K's second 8 for slots 2, 3 */
                __m512i q = _mm512_mullo_epi16(sw[r >> 1], _mm512_loadu_si512(a + 512));
                __m512i rl = r & 1 ? _mm512_shuffle_i64x2(q, q, 0xaa) : _mm512_shuffle_i64x2(q, q, 0), rh = rl;
                if (kind == 4) rh = r & 1 ? _mm512_shuffle_i64x2(q, q, 0xff) : _mm512_shuffle_i64x2(q, q, 0x55);
                __m512i tt = _mm512_setzero_si512();
                for (int v = 0; v < 4; v++) {
                    __m512i sv = _mm512_shuffle_epi8(kind == 4 && v >= 2 ? rh : rl, six[v]);
                    tt = _mm512_dpwssd_epi32(tt, _mm512_maddubs_epi16(u[v], _mm512_loadu_si512(a + 64 * v)), sv);
                }
                t[r * MRC + m] = tt;
                if (kind == 4) {
                    __m256i s16 = r & 1 ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q);
                    c6[r * MRC + m] = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)(a + 256)));
                }
            }
        }
        if (NI & 1) t[NI] = _mm512_setzero_si512();
        for (int p = 0; p < NP; p++) { /* items 2p, 2p + 1: each folded into one vector's half, k16_lanes' FMAs */
            __m512i f = _mm512_add_epi32(_mm512_shuffle_i64x2(t[2 * p], t[2 * p + 1], 0x44),
                                         _mm512_shuffle_i64x2(t[2 * p], t[2 * p + 1], 0xee));
            __m512i at = _mm512_add_epi32(pair, _mm512_set1_epi32(4 * p));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), _mm512_permutexvar_ps(at, dz), acc[p]);
            /* the mins (each item's row's against its activation row's shifted sums), or Q6_K's -32 */
            const int i0 = 2 * p, i1 = 2 * p + 1 < NI ? 2 * p + 1 : 2 * p;
            __m512i cv;
            if (kind == 4) cv = _mm512_inserti64x4(_mm512_castsi256_si512(c6[i0]), c6[i1], 1);
            else {
                __m512i mv = _mm512_inserti64x4(_mm512_castsi256_si512(mn[i0 / MRC]), mn[i1 / MRC], 1);
                __m512i bs = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xb[i0 % MRC] + KB * b + 576))),
                    _mm256_loadu_si256((const __m256i *)(xb[i1 % MRC] + KB * b + 576)), 1);
                cv = _mm512_mullo_epi32(mv, bs);
            }
            __m512 sm = _mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(1)), dz);
            acc[p] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(cv), sm, acc[p]);
        }
    }
    for (int i = 0; i < NI; i++)
        out[i] = hsum8(i & 1 ? _mm512_extractf32x8_ps(acc[i >> 1], 1) : _mm512_castps512_ps256(acc[i >> 1]));
}

/* k8_rows specialised: NR (1, 2 or 4) weight rows against one activation row, or NR (1, 2) against mr (2..TM) */
static void k8_n(int kind, const uint8_t *row, int64_t ldw, int NR, int64_t K, const int8_t *const *xb, int mr,
                 float *out) {
#define K8_M(k, n) switch (mr) { case 1: k8_rows(k, row, ldw, n, K, xb, 1, out); break; \
                                 case 2: k8_rows(k, row, ldw, n, K, xb, 2, out); break; \
                                 case 3: k8_rows(k, row, ldw, n, K, xb, 3, out); break; \
                                 default: k8_rows(k, row, ldw, n, K, xb, 4, out); break; }
#define K8_N(k) switch (NR) { case 1: K8_M(k, 1) break; \
                              case 2: K8_M(k, 2) break; \
                              default: k8_rows(k, row, ldw, 4, K, xb, 1, out); break; }
    switch (kind) {
    case 2: K8_N(2) break;
    case 3: K8_N(3) break;
    default: K8_N(4) break;
    }
#undef K8_N
#undef K8_M
}
#endif

/* a row of format `kind` (K values) . the activation row quantized at xp: Q8_0 in place, else decoded into
   own (gguf_matmul.c's dot_one); simd 0: the plain-C dots */
static float dot_row(int kind, const uint8_t *row, int64_t K, uint8_t *xp, uint8_t *own, int64_t RW, int simd) {
    if (kind != 0) return dot_one(kind, row, K, xp, own, RW, simd);
    QRow x = qrow_at(xp, K);
    return simd ? dot_q8_0(row, K / 32, x.q, x.d) : dot_q8_0_c(row, K / 32, x.q, x.d);
}

#define TR 4 /* weight rows a tile at one token: 1.25x one row (Q4_K, AVX-512 VNNI), the rows' dots overlapping */

#if SIMD != 2
#define KB 0
static void split8(int kind, const void *x, int bf, int64_t K, int8_t *xb) { (void)kind, (void)x, (void)bf, (void)K, (void)xb; }
#endif

/* out[r] = row r . x for nr (1..TR) rows ldw bytes apart: the K-quants' in-place tiles on x split by split8 at xb
   (where SIMD == 2), else row by row on x quantized at xp */
static void dot_tile(int kind, const uint8_t *row, int64_t ldw, int nr, int64_t K, uint8_t *xp, const int8_t *xb,
                     uint8_t *own, int64_t RW, int simd, float *out) {
#if SIMD == 2
    if (simd && is_k(kind)) {
        if (nr == 3) {
            k8_n(kind, row, ldw, 2, K, &xb, 1, out);
            k8_n(kind, row + 2 * ldw, ldw, 1, K, &xb, 1, out + 2);
        } else k8_n(kind, row, ldw, nr, K, &xb, 1, out);
        return;
    }
#else
    (void)xb;
#endif
    for (int r = 0; r < nr; r++) out[r] = dot_row(kind, row + r * ldw, K, xp, own, RW, simd);
}

#define MAX_SLOTS 512 /* (token, expert) pairs a mlight_gguf_tokens_moe call takes */
/* floats of a thread's tile dots in mlight_gguf_tokens_moe: S TR rounded up, and 128 bytes apart, so that no two
   threads write one cache line. Packed (32 bytes a thread at one token), every tile's store moved the line between
   the cores: where two Zen 5 vCPUs sat on separate cores (a plain two-thread read 64-82 GB/s) the 784M Q4_K_M's
   B = 1 step took 4.6-4.8 ms, 2.9-3.0 apart; where they shared one (39-53 GB/s) 3.1-3.2 and 2.9-3.1 */
static int64_t tile_floats(int64_t S) { return (S * TR + 15) / 16 * 16 + 32; }
/* tiles a thread takes at a time: a phase's tiles in CHUNKS runs a thread, at least 16 tiles (64 rows). Runs of
   16 tiles, dealt alternately, broke each thread's stream every 64 rows: at one token the 784M Mixtral's Q4_K
   experts came 1.2-1.3x faster in long runs on two Zen 5 cores (1.0-1.1x for Q8_0, whose rows are wider) */
#define CHUNKS 4
static inline int64_t chunk_of(int64_t tiles, int threads) {
    int64_t c = (tiles + CHUNKS * threads - 1) / (CHUNKS * threads);
    return c < 16 ? 16 : c;
}

/* the rows `at` (a group's slots, nr of them) of an expert's matrix tile [n, n + nr) (rows ldw bytes apart):
   out[s][r] (slot s's row r, TR floats a slot) = row . the slot's activation row (quantized at xq + s * qb; split
   at xb + s * sb where SIMD == 2). One slot: dot_tile's 4-row tiles; several (a K-quant on the SIMD dots): each
   weight row once against up to TM of them (k8_n); other formats' rows decoded once for all of them (the
   in-place Q8_0 dot unpacks a block's scale and signs again for every slot); else each slot in turn. The same
   floats either way. */
static void group_tile(int kind, const uint8_t *w, int64_t ldw, int nr, int64_t K, const int *at, int ns, uint8_t *xq,
                       int64_t qb, const int8_t *xb, int64_t sb, uint8_t *own, int64_t RW, int simd, float *out) {
#if SIMD == 2
    if (ns > 1 && simd && is_k(kind)) {
        const int8_t *xs[TM];
        float v[2 * TM];
        for (int r = 0; r < nr; r += 2) {
            int n2 = nr - r < 2 ? 1 : 2;
            for (int s0 = 0; s0 < ns; s0 += TM) {
                int mr = ns - s0 < TM ? ns - s0 : TM;
                for (int m = 0; m < mr; m++) xs[m] = xb + at[s0 + m] * sb;
                k8_n(kind, w + r * ldw, ldw, n2, K, xs, mr, v);
                for (int q = 0; q < n2; q++)
                    for (int m = 0; m < mr; m++) out[at[s0 + m] * TR + r + q] = v[q * mr + m];
            }
        }
        return;
    }
#endif
    if (ns > 1 && !is_k(kind)) { /* each weight row decoded once for all the slots (gguf_matmul.c's int8 tiles) */
        QRow xs[MR];
        float v[MR];
        WRow wr = wrow_at(own, RW);
        for (int r = 0; r < nr; r++) {
            decode_row_i8(kind, w + r * ldw, K, wr);
            for (int s0 = 0; s0 < ns; s0 += MR) {
                int mr = ns - s0 < MR ? ns - s0 : MR;
                for (int m = 0; m < mr; m++) xs[m] = qrow_at(xq + at[s0 + m] * qb, K);
                dot_rows_i8(kind, wr, K, xs, mr, simd, v);
                for (int m = 0; m < mr; m++) out[at[s0 + m] * TR + r] = v[m];
            }
        }
        return;
    }
    for (int i = 0; i < ns; i++)
        dot_tile(kind, w, ldw, nr, K, xq + at[i] * qb, xb + at[i] * sb, own, RW, simd, out + at[i] * TR);
}

/* M tokens' routed experts, SwiGLU: out[m] (ldo apart) = sum_j w[m, j] * W2_e (silu(G_e x_m) * U_e x_m), e =
   ids[m, j], for x [M, D] (rows ldx apart), ids int64 and routing weights (fp32 or bf16) [M, nexp]; W13_e and W2_e
   as mlight_gguf_moe's. Each expert a slot routes to is read once for all its slots (a small batch's decode), and
   every token's result equals the same token alone (M = 1) bit for bit: each slot's rows dotted as one token's
   (group_tile), each output summed over the token's experts in the order given. Phases split over the team: the
   experts' gate/up tiles; SiLU and each slot's h quantized; the down tiles; the sums. path 1 plain C, 2 SIMD; scratch as
   mlight_gguf_tokens_moe_scratch. */
int mlight_gguf_tokens_moe(int k13, int k2, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t D, int64_t I,
                           int nexp, const int64_t *ids, const void *wts, int w_bf16, const uint8_t *w13, int64_t e13,
                           int64_t ldw13, const uint8_t *w2, int64_t e2, int64_t ldw2, void *out, int out_bf16,
                           int64_t ldo, float *scratch, int threads, int path) {
    int64_t S = M * nexp;
    if (k13 < 0 || k13 > 5 || k2 < 0 || k2 > 5 || D % BS[k13] || I % BS[k2] || nexp < 1 || nexp > 64 || M < 1 ||
        S > MAX_SLOTS || threads < 1 || path < 1 || path > 2)
        return -1;
    int simd = path == 2, split13 = simd && SIMD == 2 && is_k(k13), split2 = simd && SIMD == 2 && is_k(k2);
    int64_t RW = D > I ? D : I, qd = xrow_bytes(k13, D), qi = xrow_bytes(k2, I), sd = D / 256 * KB, si = I / 256 * KB;
    int64_t wb = wrow_bytes(RW) > kwrow_bytes(RW) ? wrow_bytes(RW) : kwrow_bytes(RW);
    /* gu: each slot's gate|up, then h; ys: each slot's down rows; v: a tile's dots, TR a slot, per thread */
    float *gu = scratch, *ys = gu + S * 2 * I, *v = ys + S * D, w[MAX_SLOTS];
    uint8_t *xq = (uint8_t *)(v + threads * tile_floats(S)), *hq = xq + S * qd, *wq = hq + S * qi;
    int8_t *xb = (int8_t *)(wq + (int64_t)threads * wb), *hb = xb + S * sd;
    /* the slots grouped by expert (ascending, slots in order): `at` holds them, group g at at[g0[g]..g0[g + 1]) */
    int at[MAX_SLOTS], g0[MAX_SLOTS + 1], ng = 0;
    int64_t ge[MAX_SLOTS];
    for (int64_t s = 0; s < S; s++) {
        if (ids[s] < 0) return -1;
        w[s] = w_bf16 ? bf16f(((const uint16_t *)wts)[s]) : ((const float *)wts)[s];
    }
    for (int64_t e = -1, n = 0; n < S;) { /* the next expert above e, its slots appended */
        int64_t next = INT64_MAX;
        for (int64_t s = 0; s < S; s++) next = ids[s] > e && ids[s] < next ? ids[s] : next;
        g0[ng] = (int)n, ge[ng++] = e = next;
        for (int64_t s = 0; s < S; s++)
            if (ids[s] == e) at[n++] = (int)s;
    }
    g0[ng] = (int)S;
    /* each slot's copy of its token's row, quantized (and split): a group's slots index one array */
    for (int64_t s = 0; s < S; s++) {
        const int64_t m = s / nexp;
        if (s % nexp == 0) {
            const void *r = x_bf16 ? (const void *)((const uint16_t *)x + m * ldx)
                                   : (const void *)((const float *)x + m * ldx);
            if (split13) split8(k13, r, x_bf16, D, xb + s * sd);
            else quantize_for(k13, r, x_bf16, D, xq + s * qd);
        } else {
            memcpy(xq + s * qd, xq + (s - 1) * qd, qd);
            if (split13) memcpy(xb + s * sd, xb + (s - 1) * sd, sd);
        }
    }
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        uint8_t *own = wq + (int64_t)t * wb;
        float *vt = v + t * tile_floats(S);
        int64_t t13 = (2 * I + TR - 1) / TR; /* tiles of an expert's gate/up rows */
        /* dealt in runs as threads come free: a static split gave one thread the experts with more slots */
        const int64_t c13 = chunk_of(ng * t13, threads);
        OMP(omp for schedule(dynamic, c13))
        for (int64_t r = 0; r < ng * t13; r++) {
            int64_t g = r / t13, n = TR * (r % t13);
            int nr = 2 * I - n < TR ? (int)(2 * I - n) : TR;
            group_tile(k13, w13 + ge[g] * e13 + n * ldw13, ldw13, nr, D, at + g0[g], g0[g + 1] - g0[g], xq, qd, xb,
                       sd, own, RW, simd, vt);
            for (int i = g0[g]; i < g0[g + 1]; i++)
                for (int q = 0; q < nr; q++) gu[at[i] * 2 * I + n + q] = vt[at[i] * TR + q];
        }
        OMP(omp for schedule(static))
        for (int64_t s = 0; s < S; s++) {
            float *h = gu + s * 2 * I;
            for (int64_t i = 0; i < I; i++) h[i] = h[i] / (1.f + expf(-h[i])) * h[I + i];
            if (split2) split8(k2, h, 0, I, hb + s * si);
            else quantize_for(k2, h, 0, I, hq + s * qi);
        }
        int64_t t2 = (D + TR - 1) / TR; /* tiles of an expert's down rows */
        const int64_t c2 = chunk_of(ng * t2, threads);
        OMP(omp for schedule(dynamic, c2))
        for (int64_t r = 0; r < ng * t2; r++) { /* expert by expert: its rows streamed in order */
            int64_t g = r / t2, d = TR * (r % t2);
            int nr = D - d < TR ? (int)(D - d) : TR;
            group_tile(k2, w2 + ge[g] * e2 + d * ldw2, ldw2, nr, I, at + g0[g], g0[g + 1] - g0[g], hq, qi, hb, si,
                       own, RW, simd, vt);
            for (int i = g0[g]; i < g0[g + 1]; i++)
                for (int q = 0; q < nr; q++) ys[at[i] * D + d + q] = vt[at[i] * TR + q];
        }
        OMP(omp for schedule(static))
        for (int64_t md = 0; md < M * D; md++) { /* each output summed over the token's experts in their order */
            int64_t m = md / D, d = md % D;
            float y = 0;
            for (int j = 0; j < nexp; j++) y += w[m * nexp + j] * ys[(m * nexp + j) * D + d];
            put(out, out_bf16, m * ldo + d, y);
        }
    }
    return 0;
}

/* floats of scratch a mlight_gguf_tokens_moe call needs */
int64_t mlight_gguf_tokens_moe_scratch(int64_t M, int64_t D, int64_t I, int nexp, int threads) {
    int64_t S = M * nexp, RW = D > I ? D : I;
    int64_t qd = qrow_bytes(D) > kqrow_bytes(D) ? qrow_bytes(D) : kqrow_bytes(D);
    int64_t qi = qrow_bytes(I) > kqrow_bytes(I) ? qrow_bytes(I) : kqrow_bytes(I);
    int64_t wb = wrow_bytes(RW) > kwrow_bytes(RW) ? wrow_bytes(RW) : kwrow_bytes(RW);
    int64_t bytes = S * (qd + qi + (D / 256 + I / 256) * KB) + threads * wb;
    return S * (2 * I + D) + threads * tile_floats(S) + (bytes + 3) / 4;
}

/* mlight_gguf_linear's integer paths (1 plain C, 2 SIMD) for a few activation rows: y [M, N] (rows ldy apart) =
   x [M, K] (rows ldx apart) . W^T, W's rows ldw bytes apart in blocks of `kind`, Q8_0 dotted in place; the
   K-quants' SIMD rows (AVX-512 VNNI) in place too, each weight row against up to TM activation rows at once
   (read once for all of them); elsewhere each activation row in turn. scratch as
   mlight_gguf_token_linear_scratch(M, K, threads) */
int mlight_gguf_token_linear(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                             int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, float *scratch, int threads,
                             int path) {
    if (kind < 0 || kind > 5 || K % BS[kind] || M < 1 || threads < 1 || path < 1 || path > 2) return -1;
    int64_t wb = wrow_bytes(K) > kwrow_bytes(K) ? wrow_bytes(K) : kwrow_bytes(K), qb = xrow_bytes(kind, K);
    uint8_t *xq = (uint8_t *)scratch, *rows = xq + M * qb;
    /* the K-quants on the u8 dots (SIMD == 2): each row split past the threads' rows */
    int8_t *xb = (int8_t *)(rows + (int64_t)threads * wb);
    int64_t sb = K / 256 * KB, split = SIMD == 2 && path == 2 && is_k(kind);
    for (int64_t m = 0; m < M; m++) {
        const void *r = x_bf16 ? (const void *)((const uint16_t *)x + m * ldx) : (const void *)((const float *)x + m * ldx);
        if (split) split8(kind, r, x_bf16, K, xb + m * sb);
        else quantize_for(kind, r, x_bf16, K, xq + m * qb);
    }
    OMP(omp parallel num_threads(threads))
    {
        int t = THREAD_ID();
        uint8_t *own = rows + (int64_t)t * wb;
#if SIMD == 2
        if (split && M > 1) {
            const int8_t *xs[TM];
            float v[2 * TM];
            OMP(omp for schedule(static))
            for (int64_t n2 = 0; n2 < (N + 1) / 2; n2++) {
                int64_t n = 2 * n2;
                int nr = N - n < 2 ? 1 : 2;
                for (int64_t m0 = 0; m0 < M; m0 += TM) {
                    int mr = M - m0 < TM ? (int)(M - m0) : TM;
                    for (int m = 0; m < mr; m++) xs[m] = xb + (m0 + m) * sb;
                    k8_n(kind, w + n * ldw, ldw, nr, K, xs, mr, v);
                    for (int q = 0; q < nr; q++)
                        for (int m = 0; m < mr; m++) put(y, y_bf16, (m0 + m) * ldy + n + q, v[q * mr + m]);
                }
            }
        } else
#endif
        {
            OMP(omp for schedule(static))
            for (int64_t n4 = 0; n4 < (N + TR - 1) / TR; n4++) {
                int64_t n = TR * n4;
                int nr = N - n < TR ? (int)(N - n) : TR;
                float v[TR];
                for (int64_t m = 0; m < M; m++) {
                    dot_tile(kind, w + n * ldw, ldw, nr, K, xq + m * qb, xb + m * sb, own, K, path == 2, v);
                    for (int r = 0; r < nr; r++) put(y, y_bf16, m * ldy + n + r, v[r]);
                }
            }
        }
    }
    return 0;
}

/* floats of scratch a mlight_gguf_token_linear call needs */
int64_t mlight_gguf_token_linear_scratch(int64_t M, int64_t K, int threads) {
    int64_t x = qrow_bytes(K) > kqrow_bytes(K) ? qrow_bytes(K) : kqrow_bytes(K);
    int64_t wb = wrow_bytes(K) > kwrow_bytes(K) ? wrow_bytes(K) : kwrow_bytes(K);
    return (M * x + (int64_t)threads * wb + M * (K / 256) * KB + 3) / 4;
}
