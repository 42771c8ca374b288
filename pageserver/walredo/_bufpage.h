/* PostgreSQL's 8 KiB page primitives in C for pagestore's redo kernels: the twins of the
 * routines of the same names in pageserver/walredo/bufpage.py (the reference, which says
 * which PostgreSQL function each follows). Declared for Cython in _bufpage.pxd, so any redo
 * kernel can `cimport` them (heap: _heap_c.pyx).
 *
 * The caller hands over a page it has checked is exactly PS_BLCKSZ bytes. Every offset is
 * computed in signed 64-bit arithmetic and checked against the page before anything is
 * written: a corrupt header or an item that does not fit gives an error code, never a write
 * outside the page. Nothing here allocates, raises or touches Python objects (noexcept nogil).
 */
#ifndef PAGESTORE_BUFPAGE_H
#define PAGESTORE_BUFPAGE_H

#include <stdint.h>
#include <string.h>

#include "../../protocol/_bytes.h"

#define PS_BLCKSZ 8192
#define PS_PAGE_HEADER 24
#define PS_ITEM_ID_SIZE 4
#define PS_PAGE_SIZE_VERSION (PS_BLCKSZ | 4)
/* (BLCKSZ - header) / (MAXALIGN(23) + sizeof(ItemIdData)) */
#define PS_MAX_HEAP_TUPLES_PER_PAGE ((PS_BLCKSZ - PS_PAGE_HEADER) / (24 + PS_ITEM_ID_SIZE))
#define PS_LP_NORMAL 1

#define PS_OFF_LOWER 12
#define PS_OFF_UPPER 14
#define PS_OFF_SPECIAL 16
#define PS_OFF_PAGESIZE_VERSION 18

/* result codes of ps_page_reserve_item (negative: nothing was written) */
#define PS_PAGE_BAD_POINTERS (-1)  /* the PageAddItem "corrupted page pointers" check */
#define PS_PAGE_BAD_OFFSET (-2)    /* offnum 0, or past maxoff + 1 */
#define PS_PAGE_SLOT_USED (-3)     /* overwrite of a line pointer that is used or has storage */
#define PS_PAGE_TOO_MANY (-4)      /* a heap page past MaxHeapTuplesPerPage */
#define PS_PAGE_NO_ROOM (-5)       /* the item and its line pointer do not fit */

static inline int64_t ps_maxalign(int64_t n)
{
    return (n + 7) & ~(int64_t)7;
}

static inline void ps_put_le16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static inline void ps_put_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* pd_lower, pd_upper, pd_special; 0 if they are consistent (PageAddItemExtended's check),
 * PS_PAGE_BAD_POINTERS otherwise. */
static inline int ps_page_pointers(const unsigned char *page, int64_t *lower, int64_t *upper, int64_t *special)
{
    *lower = ps_le16(page + PS_OFF_LOWER);
    *upper = ps_le16(page + PS_OFF_UPPER);
    *special = ps_le16(page + PS_OFF_SPECIAL);
    if (*lower < PS_PAGE_HEADER || *lower > *upper || *upper > *special || *special > PS_BLCKSZ)
        return PS_PAGE_BAD_POINTERS;
    return 0;
}

/* PageInit: zeros, then lower/upper/special and the size+version word. */
static inline void ps_page_init(unsigned char *page, int64_t special_size)
{
    uint16_t special = (uint16_t)(PS_BLCKSZ - ps_maxalign(special_size));
    memset(page, 0, PS_BLCKSZ);
    ps_put_le16(page + PS_OFF_LOWER, PS_PAGE_HEADER);
    ps_put_le16(page + PS_OFF_UPPER, special);
    ps_put_le16(page + PS_OFF_SPECIAL, special);
    ps_put_le16(page + PS_OFF_PAGESIZE_VERSION, PS_PAGE_SIZE_VERSION);
}

/* PageAddItemExtended with a given offnum in overwrite mode (what heap redo calls), minus the
 * copy: checks the page and the slot, sets the LP_NORMAL line pointer for a `size`-byte item,
 * pd_lower and pd_upper, and returns the item's offset on the page (> 0); the caller writes
 * the `size` bytes there (the MAXALIGN padding after them keeps what was on the page, as in
 * PostgreSQL). A negative result is one of the PS_PAGE_* codes and the page is unchanged.
 * `maxoff_out` gets the page's item count before the call (for error messages). */
static inline int64_t ps_page_reserve_item(unsigned char *page, int64_t offnum, int64_t size, int is_heap,
                                           int64_t *maxoff_out)
{
    int64_t lower, upper, special, maxoff, limit, new_lower, new_upper;
    const unsigned char *lp;
    uint32_t itemid;

    *maxoff_out = 0;
    if (ps_page_pointers(page, &lower, &upper, &special))
        return PS_PAGE_BAD_POINTERS;
    maxoff = (lower - PS_PAGE_HEADER) / PS_ITEM_ID_SIZE;
    *maxoff_out = maxoff;
    limit = maxoff + 1;
    if (offnum < 1 || offnum > limit)
        return PS_PAGE_BAD_OFFSET;
    if (offnum < limit) {
        lp = page + PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE;
        itemid = ps_le32(lp);
        if (((itemid >> 15) & 3) != 0 || (itemid >> 17) != 0)
            return PS_PAGE_SLOT_USED;
    }
    if (is_heap && offnum > PS_MAX_HEAP_TUPLES_PER_PAGE)
        return PS_PAGE_TOO_MANY;
    if (size < 0 || size > PS_BLCKSZ)
        return PS_PAGE_NO_ROOM;
    new_lower = offnum == limit ? lower + PS_ITEM_ID_SIZE : lower;
    new_upper = upper - ps_maxalign(size);
    if (new_lower > new_upper)
        return PS_PAGE_NO_ROOM;
    /* here PS_PAGE_HEADER <= new_lower <= new_upper and new_upper + size <= upper <= BLCKSZ */
    ps_put_le32(page + PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE,
                (uint32_t)new_upper | ((uint32_t)PS_LP_NORMAL << 15) | ((uint32_t)size << 17));
    ps_put_le16(page + PS_OFF_LOWER, (uint16_t)new_lower);
    ps_put_le16(page + PS_OFF_UPPER, (uint16_t)new_upper);
    return new_upper;
}

#endif
