/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) for pagestore's native modules.
 *
 * Two kernels over a raw accumulator (no initial or final inversion here; the caller does
 * both, as PostgreSQL's INIT/FIN_CRC32C macros do):
 *   - ps_crc32c_hw: the SSE4.2 crc32 instruction, 8 bytes at a time, in three interleaved
 *     chains over 1.5 KiB and more. Only these functions are compiled for SSE4.2 (a target attribute, never -msse4.2 for the whole file), so the
 *     compiler cannot put SSE4.2 instructions anywhere a CPU without it would run them.
 *   - ps_crc32c_sw: slicing-by-8 tables, for CPUs without SSE4.2 (and for tests, forced by
 *     PAGESTORE_CRC32C_SW=1).
 * ps_crc32c_choose() fills the tables and sets the pointer ps_crc32c_comp once, at module
 * init, from cpuid (__builtin_cpu_supports). Both kernels are pure C: callable without the GIL.
 */
#ifndef PAGESTORE_CRC32C_H
#define PAGESTORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define PS_CRC32C_X86 1
#endif

static uint32_t ps_crc32c_tab[8][256];

static void ps_crc32c_fill_tables(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        ps_crc32c_tab[0][n] = c;
    }
    /* tab[t][n]: the CRC of byte n followed by t zero bytes */
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = ps_crc32c_tab[0][n];
        for (int t = 1; t < 8; t++) {
            c = ps_crc32c_tab[0][c & 0xFFu] ^ (c >> 8);
            ps_crc32c_tab[t][n] = c;
        }
    }
}

static uint32_t ps_crc32c_sw(uint32_t crc, const unsigned char *p, size_t len)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* unaligned-safe; compiles to one load where that is allowed */
        w ^= crc;
        crc = ps_crc32c_tab[7][w & 0xFFu] ^ ps_crc32c_tab[6][(w >> 8) & 0xFFu] ^
              ps_crc32c_tab[5][(w >> 16) & 0xFFu] ^ ps_crc32c_tab[4][(w >> 24) & 0xFFu] ^
              ps_crc32c_tab[3][(w >> 32) & 0xFFu] ^ ps_crc32c_tab[2][(w >> 40) & 0xFFu] ^
              ps_crc32c_tab[1][(w >> 48) & 0xFFu] ^ ps_crc32c_tab[0][w >> 56];
        p += 8;
        len -= 8;
    }
#endif
    while (len--)
        crc = ps_crc32c_tab[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
    return crc;
}

#ifdef PS_CRC32C_X86
/* Three independent chains over blocks of PS_CRC32C_BLOCK bytes hide the crc32 instruction's
 * 3-cycle latency; the chains are joined with "shift through BLOCK zero bytes" tables
 * (the update is affine: state(s, X) = shift(s, len X) ^ state(0, X)). */
#define PS_CRC32C_BLOCK 512
static uint32_t ps_crc32c_shift_tab[4][256];

static inline uint32_t ps_crc32c_shift(uint32_t v)
{
    return ps_crc32c_shift_tab[0][v & 0xFFu] ^ ps_crc32c_shift_tab[1][(v >> 8) & 0xFFu] ^
           ps_crc32c_shift_tab[2][(v >> 16) & 0xFFu] ^ ps_crc32c_shift_tab[3][v >> 24];
}

__attribute__((target("sse4.2")))
static uint32_t ps_crc32c_hw_1(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c = crc;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    crc = (uint32_t)c;
    if (len >= 4) {
        uint32_t w;
        memcpy(&w, p, 4);
        crc = _mm_crc32_u32(crc, w);
        p += 4;
        len -= 4;
    }
    while (len--)
        crc = _mm_crc32_u8(crc, *p++);
    return crc;
}

__attribute__((target("sse4.2")))
static uint32_t ps_crc32c_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    while (len >= 3 * PS_CRC32C_BLOCK) {
        uint64_t a = crc, b = 0, c = 0;
        const unsigned char *pb = p + PS_CRC32C_BLOCK, *pc = p + 2 * PS_CRC32C_BLOCK;
        for (size_t k = 0; k < PS_CRC32C_BLOCK; k += 8) {
            uint64_t wa, wb, wc;
            memcpy(&wa, p + k, 8);
            memcpy(&wb, pb + k, 8);
            memcpy(&wc, pc + k, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            c = _mm_crc32_u64(c, wc);
        }
        crc = ps_crc32c_shift(ps_crc32c_shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        p += 3 * PS_CRC32C_BLOCK;
        len -= 3 * PS_CRC32C_BLOCK;
    }
    return ps_crc32c_hw_1(crc, p, len);
}
#endif

typedef uint32_t (*ps_crc32c_fn)(uint32_t, const unsigned char *, size_t);
static ps_crc32c_fn ps_crc32c_comp = ps_crc32c_sw;
static int ps_crc32c_hardware = 0;

/* Returns 1 if the SSE4.2 kernel was chosen. */
static int ps_crc32c_choose(int force_software)
{
    ps_crc32c_fill_tables();
    ps_crc32c_comp = ps_crc32c_sw;
    ps_crc32c_hardware = 0;
#ifdef PS_CRC32C_X86
    if (!force_software && __builtin_cpu_supports("sse4.2")) {
        static const unsigned char zeros[PS_CRC32C_BLOCK];
        /* shift_tab[k][b]: the state b << 8k carried through BLOCK zero bytes (linear in it) */
        for (int k = 0; k < 4; k++)
            for (uint32_t b = 0; b < 256; b++)
                ps_crc32c_shift_tab[k][b] = ps_crc32c_hw_1(b << (8 * k), zeros, PS_CRC32C_BLOCK);
        ps_crc32c_comp = ps_crc32c_hw;
        ps_crc32c_hardware = 1;
    }
#else
    (void)force_software;
#endif
    return ps_crc32c_hardware;
}

/* The finished CRC-32C of p[0:len] continuing from a finished value (the crc32c package's
 * crc32c(data, value) convention: crc(b, crc(a)) == crc(a + b)). */
static inline uint32_t ps_crc32c(uint32_t value, const unsigned char *p, size_t len)
{
    return ps_crc32c_comp(value ^ 0xFFFFFFFFu, p, len) ^ 0xFFFFFFFFu;
}

#endif
