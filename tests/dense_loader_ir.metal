// Test-only kernels (never shipped) for tests/metal/test_metal_dense_loader.py:
// the integer-math check over the optimised IR, and the dense loader's tile
// compared element by element with its source. The tile loader's dense
// path alone at the shapes the kernels instantiate, the whole loader (whose
// general path does 64-bit index math), and a planted dense-style loader
// with a 64-bit multiply and a runtime division per chunk.
#include "../shaders/prefill/attention_prefill.h"

namespace flash_metal {

// The dense loader at one (T, ROWS, DMAX, THREADS), edge rows included;
// then the tile's ROWS x DMAX block copied to dst (packed), so a test can
// compare it with the source rows (zeros past valid_rows).
template <typename T, int ROWS, int DMAX, int THREADS>
[[kernel]] void dense_tile(device const T* src [[buffer(0)]], constant int& row_stride [[buffer(1)]],
                           constant int& valid_rows [[buffer(2)]], device T* dst [[buffer(3)]],
                           threadgroup T* tile [[threadgroup(0)]], uint tid [[thread_index_in_threadgroup]]) {
  constexpr int LD = DMAX + kPrefillRowPadBytes / int(sizeof(T));
  prefill_load_tile_dense<ROWS, DMAX, LD, THREADS, true>(tile, src, row_stride, valid_rows, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(tid); i < ROWS * DMAX; i += THREADS) dst[i] = tile[(i / DMAX) * LD + i % DMAX];
}

// prefill_load_tile itself: fc_dense chooses at run time here, so both paths are in the IR.
template <typename T, int ROWS, int DMAX, int THREADS>
[[kernel]] void whole_loader(device const T* src [[buffer(0)]], constant AttentionParams& p [[buffer(1)]],
                             threadgroup T* tile [[threadgroup(0)]], uint tid [[thread_index_in_threadgroup]]) {
  constexpr int LD = DMAX + kPrefillRowPadBytes / int(sizeof(T));
  prefill_load_tile<ROWS, DMAX, LD, THREADS, false>(tile, src, p.q_row_stride, p.q_dim_stride, 0, p.head_dim, ROWS,
                                                    tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Planted: 16-byte chunks, but each chunk's row found by a runtime division
// and its offset by a 64-bit multiply.
[[kernel]] void planted_slow_tile(device const half* src [[buffer(0)]], constant long& row_stride [[buffer(1)]],
                                  constant int& chunks_per_row [[buffer(2)]], threadgroup half* tile [[threadgroup(0)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  device const uint4* s = reinterpret_cast<device const uint4*>(src);
  threadgroup uint4* t = reinterpret_cast<threadgroup uint4*>(tile);
  for (int it = 0; it < 4; ++it) {
    const int i = it * 128 + int(tid);
    const int r = i / chunks_per_row;
    const int c = i % chunks_per_row;
    t[r * (chunks_per_row + 1) + c] = s[int64_t(r) * (row_stride / 8) + c];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

#define FM_IR_INSTANTIATE(name, ...) template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
// The (T, tile rows, DMAX, THREADS) of the prefill and backward kernels'
// loads: Q and K/V tiles at DMAX 72 and 80 (chunks per row 9/18, 10/20: the
// row wrap), 128 and 256.
FM_IR_INSTANTIATE("dense_tile_half_r32_d72_t128", dense_tile<half, 32, 72, 128>)
FM_IR_INSTANTIATE("dense_tile_float_r32_d80_t128", dense_tile<float, 32, 80, 128>)
FM_IR_INSTANTIATE("dense_tile_half_r16_d128_t128", dense_tile<half, 16, 128, 128>)
FM_IR_INSTANTIATE("dense_tile_float_r8_d256_t64", dense_tile<float, 8, 256, 64>)
FM_IR_INSTANTIATE("whole_loader_half_r32_d72_t128", whole_loader<half, 32, 72, 128>)

}  // namespace flash_metal
