/* What both paged-attention kernels (paged_attention.c, paged_attention_avx512.c) do before any
 * arithmetic: find a sequence's context in the cache, and hold its offsets and scores. */
#ifndef TOKENLOOM_PAGED_CONTEXT_H
#define TOKENLOOM_PAGED_CONTEXT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A task's offsets and score rows go on the stack while they fit in STACK_WORDS (10 KB: 256 positions
 * for 4 query heads, ~75 for a run of 8 tokens of 4): short contexts never malloc (a malloc for every
 * prompt token cost 7% of a prefill). */
#define STACK_CONTEXT 256
#define MAX_STACK_GROUP 4
#define STACK_WORDS (STACK_CONTEXT * (1 + MAX_STACK_GROUP))

/* A task's buffer: n offsets, then `group` score rows of n floats; `stack_buf` when they fit, else
 * malloc'ed (NULL if that fails). Free it unless it is `stack_buf`. */
static inline int64_t *task_buffer(int64_t n, int64_t group, int64_t *stack_buf) {
    const size_t bytes = sizeof(int64_t) * (size_t)n + sizeof(float) * (size_t)(group * n);
    return bytes <= sizeof(int64_t) * STACK_WORDS ? stack_buf : malloc(bytes);
}

/* offsets[t] = where position t's row for one KV head starts (in elements), for t < ctx: block by
 * block through the sequence's block table, with no division per position (12% of a prefill). */
static inline void context_offsets(const int64_t *table, int64_t ctx, int64_t block_size, int64_t slot_stride,
                                   int64_t head_offset, int64_t *offsets) {
    for (int64_t t = 0, b = 0; t < ctx; b++)
        for (int64_t o = 0, base = table[b] * block_size; o < block_size && t < ctx; o++, t++)
            offsets[t] = (base + o) * slot_stride + head_offset;
}

/* Rows PREFETCH_AHEAD positions on are asked for while this one is used: one KV head's rows are strided
 * by the other heads' and scattered by blocks, which the hardware prefetcher follows poorly (decode
 * attention at 32 streams: 6.5 -> 4.2 ms; 8, 16, 64 ahead were slower). */
#define PREFETCH_AHEAD 32
static inline void prefetch_row(const void *row, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b);
}

/* The end of the longest run from row r0 on whose rows read the same context: each row's table equals
 * row r0's over the blocks that row reads (a prompt's tokens in one step, a decode row and its
 * speculative drafts, a prompt sharing cached prefix blocks). A row's table may differ past its own
 * blocks, so a task reads its context through its longest row's table (longest_row). */
static inline int64_t same_context_end(const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                                       int64_t rows, int64_t block_size, int64_t r0) {
    int64_t r = r0 + 1;
    for (; r < rows; r++) {
        const int64_t blocks = context_lens[r] > 0 ? (context_lens[r] + block_size - 1) / block_size : 0;
        if (memcmp(tables + r * max_blocks, tables + r0 * max_blocks, sizeof(int64_t) * (size_t)blocks)) break;
    }
    return r;
}

/* Splits rows [0, rows) into tasks of at most max_run rows that read one context, as even as a run
 * allows (9 rows: 5 + 4, not 8 + 1, so two threads get equal shares): starts[0..count] the task
 * boundaries (starts has room for rows + 1). Returns the number of tasks. */
static inline int64_t context_runs(const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                                   int64_t rows, int64_t block_size, int64_t max_run, int64_t *starts) {
    int64_t count = 0;
    for (int64_t r = 0; r < rows;) {
        const int64_t end = same_context_end(tables, max_blocks, context_lens, rows, block_size, r);
        const int64_t pieces = (end - r + max_run - 1) / max_run;
        for (int64_t i = 0; i < pieces; i++) starts[count++] = r + (end - r) * i / pieces;
        r = end;
    }
    starts[count] = rows;
    return count;
}

/* The row of [r0, r0 + rows) with the longest context (the first of equals): its table is every row's
 * over the blocks that row reads, and it reads them all. */
static inline int64_t longest_row(const int64_t *context_lens, int64_t r0, int64_t rows) {
    int64_t longest = r0;
    for (int64_t r = r0 + 1; r < r0 + rows; r++) longest = context_lens[r] > context_lens[longest] ? r : longest;
    return longest;
}

#endif
