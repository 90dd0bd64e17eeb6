/* Writing a step's new K/V into the paged cache: one pass over both, parallel over tokens.
 *
 * `index_copy_` on CPU walks its rows one at a time with per-row dispatch, and needs key/value
 * contiguous (they are views into the fused QKV projection): ~60 us a call for a 256-row decode
 * step, several times the copy itself. Here head h of token t of key and value (row_bytes each,
 * tokens token_stride bytes apart) goes to row rows[t * heads + h] of k_cache and v_cache; any
 * dtype (it moves bytes).
 */
#include <stdint.h>
#include <string.h>

void store_kv(const char* key, const char* value, char* k_cache, char* v_cache, const int64_t* rows,
              int64_t tokens, int64_t heads, int64_t token_stride, int64_t row_bytes, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) \
        if (tokens * heads * row_bytes > (1 << 16))
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t row = rows[t * heads + h], at = t * token_stride + h * row_bytes;
            memcpy(k_cache + row * row_bytes, key + at, (size_t)row_bytes);
            memcpy(v_cache + row * row_bytes, value + at, (size_t)row_bytes);
        }
    }
}
