/* Fixed-width little- and big-endian loads and stores for pagestore's native modules.
 *
 * Byte-wise on purpose: this is correct on any host and any alignment, and gcc/clang turn
 * each into one (byte-swapped) load or store where the CPU allows it. Callers check the
 * remaining length before every load (native.md section 6.1): these never check.
 */
#ifndef PAGESTORE_BYTES_H
#define PAGESTORE_BYTES_H

#include <stdint.h>

static inline uint16_t ps_le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | ((uint16_t)p[1] << 8));
}

static inline uint32_t ps_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t ps_le64(const unsigned char *p)
{
    return (uint64_t)ps_le32(p) | ((uint64_t)ps_le32(p + 4) << 32);
}

static inline uint32_t ps_be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline uint64_t ps_be64(const unsigned char *p)
{
    return ((uint64_t)ps_be32(p) << 32) | (uint64_t)ps_be32(p + 4);
}

static inline void ps_put_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static inline void ps_put_be64(unsigned char *p, uint64_t v)
{
    ps_put_be32(p, (uint32_t)(v >> 32));
    ps_put_be32(p + 4, (uint32_t)v);
}

#endif
