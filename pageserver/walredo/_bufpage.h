/* PostgreSQL's 8 KiB page primitives in C for pagestore's redo kernels: the twins of the
 * routines of the same names in pageserver/walredo/bufpage.py (the reference, which says
 * which PostgreSQL function each follows). Declared for Cython in _bufpage.pxd, so any redo
 * kernel can `cimport` them (heap: _heap_c.pyx; SP-GiST: _spgist_c.pyx).
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
#define PS_PAGE_CORRUPT_ITEM (-6)  /* a line pointer outside [pd_upper, pd_special) or unaligned */
#define PS_PAGE_BAD_OFFSETS (-7)   /* PageIndexMultiDelete: "incorrect index offsets supplied" */
#define PS_PAGE_BAD_LENGTHS (-8)   /* the kept items do not fit between pd_lower and pd_special */

/* What a failed call found, for the caller's error message: BAD_POINTERS (lower, upper,
 * special), BAD_OFFSET (offnum), CORRUPT_ITEM (offset, size), BAD_LENGTHS (total, available). */
typedef struct ps_page_fault {
    int64_t a, b, c;
} ps_page_fault;

#define PS_LP_OFF(itemid) ((int64_t)((itemid) & 0x7FFF))
#define PS_LP_LEN(itemid) ((int64_t)((itemid) >> 17))

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

static inline int ps_page_fail(ps_page_fault *f, int code, int64_t a, int64_t b, int64_t c)
{
    f->a = a;
    f->b = b;
    f->c = c;
    return code;
}

/* PageGetMaxOffsetNumber: 0 on a page whose pd_lower is at or below the header. */
static inline int64_t ps_page_max_offset(const unsigned char *page)
{
    int64_t lower = ps_le16(page + PS_OFF_LOWER);
    return lower <= PS_PAGE_HEADER ? 0 : (lower - PS_PAGE_HEADER) / PS_ITEM_ID_SIZE;
}

/* bufpage._check_pointers (`aligned`: pd_special MAXALIGNed too, what the PageIndex*
 * routines check) or page_add_item's check; 0, or PS_PAGE_BAD_POINTERS with the three. */
static inline int ps_page_check_pointers(const unsigned char *page, int aligned, int64_t *lower, int64_t *upper,
                                         int64_t *special, ps_page_fault *f)
{
    if (ps_page_pointers(page, lower, upper, special) || (aligned && (*special & 7)))
        return ps_page_fail(f, PS_PAGE_BAD_POINTERS, *lower, *upper, *special);
    return 0;
}

/* The PageIndex* routines' check of item `offnum` (1 .. nline) before they move tuples
 * (bufpage._index_item): its raw line pointer, or a negative code. */
static inline int64_t ps_page_index_item(const unsigned char *page, int64_t offnum, int64_t nline, int64_t upper,
                                         int64_t special, ps_page_fault *f)
{
    uint32_t raw;
    int64_t offset, size;

    if (offnum <= 0 || offnum > nline)
        return ps_page_fail(f, PS_PAGE_BAD_OFFSET, offnum, 0, 0);
    raw = ps_le32(page + PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE);
    offset = PS_LP_OFF(raw);
    size = PS_LP_LEN(raw);
    if (offset < upper || offset + size > special || (offset & 7))
        return ps_page_fail(f, PS_PAGE_CORRUPT_ITEM, offset, size, 0);
    return raw;
}

/* Add `delta` to lp_off of every one of the first `nline` line pointers at or below
 * `offset` (the items that moved up when the space above them closed). */
static inline void ps_page_shift_items(unsigned char *page, int64_t nline, int64_t offset, uint32_t delta)
{
    int64_t i;
    unsigned char *lp;
    uint32_t v;

    for (i = 0; i < nline; i++) {
        lp = page + PS_PAGE_HEADER + PS_ITEM_ID_SIZE * i;
        v = ps_le32(lp);
        if (PS_LP_OFF(v) <= offset)
            ps_put_le32(lp, v + delta);
    }
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

/* PageAddItemExtended in shuffle mode (bufpage.page_add_item, overwrite false, not heap)
 * at `offnum` in 1 .. maxoff + 1: the later line pointers move up one slot, the `size`
 * bytes of `item` go to the new pd_upper. 0, or a negative code with the page unchanged
 * (BAD_OFFSET: offnum outside that range; NO_ROOM). */
static inline int ps_page_add_item_shuffle(unsigned char *page, const unsigned char *item, int64_t size,
                                           int64_t offnum, ps_page_fault *f)
{
    int64_t lower, upper, special, maxoff, new_upper, pos;

    if (ps_page_check_pointers(page, 0, &lower, &upper, &special, f))
        return PS_PAGE_BAD_POINTERS;
    maxoff = ps_page_max_offset(page);
    if (offnum < 1 || offnum > maxoff + 1)
        return ps_page_fail(f, PS_PAGE_BAD_OFFSET, offnum, 0, 0);
    if (size < 0 || size > PS_BLCKSZ)
        return PS_PAGE_NO_ROOM;
    new_upper = upper - ps_maxalign(size);
    if (lower + PS_ITEM_ID_SIZE > new_upper)
        return PS_PAGE_NO_ROOM;
    pos = PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE;
    if (offnum <= maxoff)
        memmove(page + pos + PS_ITEM_ID_SIZE, page + pos, (size_t)(lower - pos));
    ps_put_le32(page + pos, (uint32_t)new_upper | ((uint32_t)PS_LP_NORMAL << 15) | ((uint32_t)size << 17));
    memcpy(page + new_upper, item, (size_t)size);
    ps_put_le16(page + PS_OFF_LOWER, (uint16_t)(lower + PS_ITEM_ID_SIZE));
    ps_put_le16(page + PS_OFF_UPPER, (uint16_t)new_upper);
    return 0;
}

/* PageIndexTupleDelete (bufpage.page_index_tuple_delete): the line pointer goes, the tuples
 * below the item move up over its space. 0, or a negative code with the page unchanged. */
static inline int ps_page_index_tuple_delete(unsigned char *page, int64_t offnum, ps_page_fault *f)
{
    int64_t lower, upper, special, nline, raw, offset, size, pos;

    if (ps_page_check_pointers(page, 1, &lower, &upper, &special, f))
        return PS_PAGE_BAD_POINTERS;
    nline = ps_page_max_offset(page);
    raw = ps_page_index_item(page, offnum, nline, upper, special, f);
    if (raw < 0)
        return (int)raw;
    offset = PS_LP_OFF(raw);
    size = ps_maxalign(PS_LP_LEN(raw));
    pos = PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE;
    memmove(page + pos, page + pos + PS_ITEM_ID_SIZE, (size_t)(lower - pos - PS_ITEM_ID_SIZE));
    if (offset > upper)
        memmove(page + upper + size, page + upper, (size_t)(offset - upper));
    upper += size;
    lower -= PS_ITEM_ID_SIZE;
    ps_put_le16(page + PS_OFF_LOWER, (uint16_t)lower);
    ps_put_le16(page + PS_OFF_UPPER, (uint16_t)upper);
    if (lower > PS_PAGE_HEADER)
        ps_page_shift_items(page, nline - 1, offset, (uint32_t)size);
    return 0;
}

/* compactify_tuples (bufpage._compactify): the `nkeep` line pointers `keep` (in line-pointer
 * order) become the page's first ones, their items packed down from `special`, each moved
 * with its MAXALIGNed length (the padding travels with it); sets pd_lower and pd_upper. The
 * caller has checked every item lies in [pd_upper, special) and that they fit. */
static inline void ps_page_compactify(unsigned char *page, const uint32_t *keep, int64_t nkeep, int64_t special)
{
    unsigned char scratch[PS_BLCKSZ];
    int64_t i, upper = special, alen;
    uint32_t itemid;

    memcpy(scratch, page, PS_BLCKSZ);
    for (i = 0; i < nkeep; i++) {
        itemid = keep[i];
        alen = ps_maxalign(PS_LP_LEN(itemid));
        upper -= alen;
        memcpy(page + upper, scratch + PS_LP_OFF(itemid), (size_t)alen);
        ps_put_le32(page + PS_PAGE_HEADER + PS_ITEM_ID_SIZE * i, (itemid & ~(uint32_t)0x7FFF) | (uint32_t)upper);
    }
    ps_put_le16(page + PS_OFF_LOWER, (uint16_t)(PS_PAGE_HEADER + PS_ITEM_ID_SIZE * nkeep));
    ps_put_le16(page + PS_OFF_UPPER, (uint16_t)upper);
}

/* PageIndexMultiDelete (bufpage.page_index_multi_delete): `sorted_offs` ascending; up to two
 * items through the retail delete (last first), more by one compaction. 0, or a negative
 * code (the page unchanged, except for the retail deletes already done). */
static inline int ps_page_index_multi_delete(unsigned char *page, const uint16_t *sorted_offs, int64_t nitems,
                                             ps_page_fault *f)
{
    uint32_t keep[PS_BLCKSZ / PS_ITEM_ID_SIZE];
    int64_t lower, upper, special, nline, i, rc, nkeep = 0, nextitm = 0, totallen = 0, size, offset, offnum;
    uint32_t itemid;

    if (nitems <= 2) {
        for (i = nitems - 1; i >= 0; i--) {
            rc = ps_page_index_tuple_delete(page, sorted_offs[i], f);
            if (rc)
                return (int)rc;
        }
        return 0;
    }
    if (ps_page_check_pointers(page, 1, &lower, &upper, &special, f))
        return PS_PAGE_BAD_POINTERS;
    nline = ps_page_max_offset(page);  /* <= (BLCKSZ - header) / 4: keep[] holds them all */
    for (offnum = 1; offnum <= nline; offnum++) {
        itemid = ps_le32(page + PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE);
        size = PS_LP_LEN(itemid);
        offset = PS_LP_OFF(itemid);
        if (offset < upper || offset + size > special || (offset & 7))
            return ps_page_fail(f, PS_PAGE_CORRUPT_ITEM, offset, size, 0);
        if (nextitm < nitems && offnum == sorted_offs[nextitm]) {
            nextitm++;
        } else {
            keep[nkeep++] = itemid;
            totallen += ps_maxalign(size);
        }
    }
    if (nextitm != nitems)
        return PS_PAGE_BAD_OFFSETS;
    if (totallen > special - lower)
        return ps_page_fail(f, PS_PAGE_BAD_LENGTHS, totallen, special - lower, 0);
    ps_page_compactify(page, keep, nkeep, special);
    return 0;
}

/* PageIndexTupleDelete(offnum) then PageAddItem(item, offnum) in shuffle mode, in one pass
 * (bufpage.page_index_tuple_replace): the old tuple's space closes, the `newlen` bytes of
 * `item` go to the new pd_upper, the line pointer at `offnum` names them. 0, or a negative
 * code with the page unchanged (NO_ROOM: the new item does not fit). */
static inline int ps_page_index_tuple_replace(unsigned char *page, const unsigned char *item, int64_t newlen,
                                              int64_t offnum, ps_page_fault *f)
{
    int64_t lower, upper, special, nline, raw, offset, size, new_upper;

    if (ps_page_check_pointers(page, 1, &lower, &upper, &special, f))
        return PS_PAGE_BAD_POINTERS;
    nline = ps_page_max_offset(page);
    raw = ps_page_index_item(page, offnum, nline, upper, special, f);
    if (raw < 0)
        return (int)raw;
    offset = PS_LP_OFF(raw);
    size = ps_maxalign(PS_LP_LEN(raw));
    if (newlen < 0 || newlen > PS_BLCKSZ)
        return PS_PAGE_NO_ROOM;
    new_upper = upper + size - ps_maxalign(newlen);
    if (lower > new_upper)
        return PS_PAGE_NO_ROOM;
    if (offset > upper)
        memmove(page + upper + size, page + upper, (size_t)(offset - upper));
    if (nline > 1)
        ps_page_shift_items(page, nline, offset, (uint32_t)size);
    ps_put_le32(page + PS_PAGE_HEADER + (offnum - 1) * PS_ITEM_ID_SIZE,
                (uint32_t)new_upper | ((uint32_t)PS_LP_NORMAL << 15) | ((uint32_t)newlen << 17));
    memcpy(page + new_upper, item, (size_t)newlen);
    ps_put_le16(page + PS_OFF_UPPER, (uint16_t)new_upper);
    return 0;
}

#endif
