# Cython declarations of the C page primitives in _bufpage.h (twins of bufpage.py's routines
# of the same names). Any redo kernel can `from pageserver.walredo._bufpage cimport ...` them;
# list _bufpage.h among its sources in protocol/_native_sources.py so a change rebuilds it.
from libc.stdint cimport int64_t, uint16_t, uint32_t

cdef extern from "_bufpage.h" nogil:
    const int PS_BLCKSZ
    const int PS_PAGE_HEADER
    const int PS_ITEM_ID_SIZE
    const int PS_MAX_HEAP_TUPLES_PER_PAGE
    const int PS_PAGE_BAD_POINTERS
    const int PS_PAGE_BAD_OFFSET
    const int PS_PAGE_SLOT_USED
    const int PS_PAGE_TOO_MANY
    const int PS_PAGE_NO_ROOM
    const int PS_PAGE_CORRUPT_ITEM
    const int PS_PAGE_BAD_OFFSETS
    const int PS_PAGE_BAD_LENGTHS
    ctypedef struct ps_page_fault:
        int64_t a
        int64_t b
        int64_t c
    uint16_t ps_le16(const unsigned char *p) noexcept
    uint32_t ps_le32(const unsigned char *p) noexcept
    void ps_put_le16(unsigned char *p, uint16_t v) noexcept
    void ps_put_le32(unsigned char *p, uint32_t v) noexcept
    int64_t ps_maxalign(int64_t n) noexcept
    int ps_page_pointers(const unsigned char *page, int64_t *lower, int64_t *upper, int64_t *special) noexcept
    void ps_page_init(unsigned char *page, int64_t special_size) noexcept
    int64_t ps_page_reserve_item(unsigned char *page, int64_t offnum, int64_t size, int is_heap,
                                 int64_t *maxoff_out) noexcept
    int64_t ps_page_max_offset(const unsigned char *page) noexcept
    int ps_page_check_pointers(const unsigned char *page, int aligned, int64_t *lower, int64_t *upper,
                               int64_t *special, ps_page_fault *f) noexcept
    int ps_page_add_item_shuffle(unsigned char *page, const unsigned char *item, int64_t size, int64_t offnum,
                                 ps_page_fault *f) noexcept
    int ps_page_index_tuple_delete(unsigned char *page, int64_t offnum, ps_page_fault *f) noexcept
    void ps_page_compactify(unsigned char *page, const uint32_t *keep, int64_t nkeep, int64_t special) noexcept
    int ps_page_index_multi_delete(unsigned char *page, const uint16_t *sorted_offs, int64_t nitems,
                                   ps_page_fault *f) noexcept
    int ps_page_index_tuple_replace(unsigned char *page, const unsigned char *item, int64_t newlen, int64_t offnum,
                                    ps_page_fault *f) noexcept
