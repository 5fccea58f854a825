// The prefill's two sentences for explain() and its pack GQA decision
// (issue 20 section 4), out of csrc/metal/routing.cpp, whose
// choose_metal_kernel asks them when it plans a prefill.
#include "metal/plan_detail.h"

namespace flash_metal::plan_detail {

// The paged prefill's K/V tiles (shaders/attention_prefill.h, fc_paged):
// inside one page, or row by row through the table. The sentence explain() prints.
std::string prefill_pages_note(const AttentionProblem& p, uint32_t block_k, bool pack_gqa) {
  const std::string bk = std::to_string(block_k), pages = std::to_string(p.page_size) + " keys";
  const bool one = p.kv_len <= p.page_size, whole = one || p.page_size % block_k == 0;
  return (one ? "; one page per sequence (the table's capacity, " + pages + ", is one page): every " + bk +
                    "-key tile lies in it"
              : "; pages of " + pages + (whole ? ", a multiple of the " : ", not a multiple of the ") + bk +
                    "-key block: " + (whole ? "every tile lies in one page" : "tiles may cross pages")) +
         (whole ? " and loads from its base (the dense loader where it applies), one table read per key block"
                : ", so each row is found through the table (the general per-element loader, a table read per "
                  "page a thread enters; page sizes that are a multiple of " + bk + " load whole tiles)") +
         (pack_gqa ? "; each (packed query block, kv head) threadgroup reads every key of its sequence it can see "
                     "once, K and V, only from the pages in use, for all the GQA group's heads"
                   : "; each (query block, query head) threadgroup reads every key of its sequence it can see once, "
                     "K and V, only from the pages in use") +
         "; the page walk adds " +
         (whole ? "6" : "12") + " live values per lane (in the estimate)";
}

// Pack GQA for the prefill (fc_pack_gqa, shaders/attention_prefill.h): with
// G = Hq / Hkv > 1, one threadgroup per (batch, kv head, block of block_q
// packed rows), packed row m being query row m / G of the group's head m % G,
// so the group's G heads share every K/V tile a threadgroup loads
// (FlashAttention-3's and FlashInfer's pack GQA). Each threadgroup still reads
// the keys its rows see once, so K/V traffic follows the threadgroup count:
// ceil(Nq * G / block_q) * Hkv instead of ceil(Nq / block_q) * Hq, never more.
// The saving is G-fold for short queries (Nq * G <= block_q: the whole group
// in one block, each K/V byte read once per GQA group, as the decode kernels
// read it), fills the ragged last block otherwise, and is nil for long
// queries with Nq a multiple of block_q (the same number of threadgroups,
// each reading all its keys; under causal masking the finer packed blocks
// stop at their own last row, a little less). The products and the softmax
// are the same per row. Routed only for short queries (below); the
// kernel itself takes any Nq, and the tests run it packed at ragged Nq too.
// Every prefill form can pack: contiguous, paged (attention_kvcache) and
// varlen (packed queries, with or without a table): a sequence's packed rows
// are G times its query rows wherever they start, so the kernel's code is the
// same and the grid covers max_seqlen_q * G (whose blocks past a shorter
// sequence's end return at once, as they do unpacked). Appends the reason's
// sentence; returns the decision.
bool prefill_pack_gqa(const AttentionProblem& p, uint32_t block_q, std::string* reason) {
  const int64_t g = p.gqa_ratio();
  if (g <= 1) return false;
  const std::string G = std::to_string(g);
  const int64_t rows = p.q_len * g;
  const int64_t packed = (rows + block_q - 1) / block_q * p.kv_heads;
  const int64_t unpacked = (p.q_len + block_q - 1) / block_q * p.q_heads;
  // Why only short queries (2 * Nq <= BQ: one head's rows fill at most half
  // a block, so every unpacked threadgroup is at least half idle): every
  // threadgroup reads each key its rows see once, so K/V traffic follows the
  // threadgroup count, and filling the idle rows with the group's other heads
  // cuts it. The Metal model, on a batch that fills the GPU (8 x 32(8) heads,
  // Nk 1024, D 64, causal, f16), predicts packing 1.27-1.74x faster on M3 Max,
  // M4 Pro and M5 at Nq 12-16 (M1 Max 1.00-1.32x), level at Nq 24 and 40, and
  // 9% slower at Nq 40 on one sequence, where fuller threadgroups lengthen a
  // grid smaller than the GPU (benchmarks/paged_prefill_model.py; a model,
  // not a measurement).
  if (2 * p.q_len > block_q) {
    *reason += "; GQA heads not packed (Nq = " + std::to_string(p.q_len) + " fills more than half a block of " +
               std::to_string(block_q) + " rows: packing would read K/V in " + std::to_string(packed) +
               " threadgroups instead of " + std::to_string(unpacked) +
               ", and the Metal model predicts it level or slower there; a model, not a measurement)";
    return false;
  }
  *reason += "; pack GQA (fc_pack_gqa): one threadgroup per (batch, kv head, block of " + std::to_string(block_q) +
             " packed rows), its rows the " + G + " query heads of the kv head's group (packed row m: query row m / " +
             G + " of head m % " + G + "), which share each K/V tile it loads: " + std::to_string(packed) +
             " threadgroups per " + (p.varlen ? "sequence" : "batch") + " read the K/V they see instead of " +
             std::to_string(unpacked) + " (Nq = " + std::to_string(p.q_len) +
             (p.varlen ? " = max_seqlen_q; each sequence's queries pack the same way)" : ")");
  return true;
}

}  // namespace flash_metal::plan_detail
