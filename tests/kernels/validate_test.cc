// validate(): every bad parameter is refused with a message naming the kernel, the field, expected and given.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "dsacp/backend.h"

namespace dsacp {
namespace {

// Buffers only need to be non-null for validate(); it never reads them.
float g_f[4];
int32_t g_i[4];
int64_t g_l[4];

IndexerTopkParams good_indexer() {
  IndexerTopkParams p;
  p.rows = {2, g_i, g_i};
  p.Hi = 4;
  p.Di = 128;
  p.K = 8;
  p.q = g_f;
  p.q_dtype = DType::kBF16;
  p.w = g_f;
  p.keys = {g_f, DType::kBF16, 10, 64, 128};
  p.block_table = {g_i, 1, 4};
  p.topk = g_i;
  return p;
}

SparseMlaParams good_mla() {
  SparseMlaParams p;
  p.rows = {2, g_i, g_i};
  p.H = 2;
  p.Dl = 512;
  p.Dr = 64;
  p.K = 8;
  p.scale = 0.1f;
  p.q_nope = g_f;
  p.q_rope = g_f;
  p.latent = {g_f, DType::kBF16, 10, 64, 512};
  p.rope = {g_f, DType::kBF16, 10, 64, 64};
  p.block_table = {g_i, 1, 4};
  p.topk = g_i;
  p.out = g_f;
  p.lse = g_f;
  return p;
}

template <typename P>
struct BadCase {
  const char* name;
  std::function<void(P&)> mutate;
  const char* message;  // expected substring
};

template <typename P>
void expect_refused(P (*good)(), const std::vector<BadCase<P>>& cases) {
  ASSERT_TRUE(validate(good()).ok()) << validate(good()).to_string();
  for (const auto& c : cases) {
    P p = good();
    c.mutate(p);
    const Status st = validate(p);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(st.message().find(c.message), std::string::npos) << c.name << ": " << st.message();
  }
}

TEST(KernelValidate, IndexerTopk) {
  using P = IndexerTopkParams;
  expect_refused<P>(good_indexer,
                    {{"key dim", [](P& p) { p.keys.dim = 64; }, "indexer_topk: keys.dim must equal Di=128, got 64"},
                     {"K", [](P& p) { p.K = 0; }, "indexer_topk: K must be >= 1, got 0"},
                     {"Hi", [](P& p) { p.Hi = -1; }, "Hi must be >= 1, got -1"},
                     {"page size", [](P& p) { p.keys.page_size = 0; }, "keys.page_size must be >= 1, got 0"},
                     {"num_pages", [](P& p) { p.keys.num_pages = 0; }, "keys.num_pages must be >= 1, got 0"},
                     {"pool null", [](P& p) { p.keys.data = nullptr; }, "keys.data must not be null"},
                     {"q dtype", [](P& p) { p.q_dtype = DType::kI32; }, "q_dtype must be F32 or BF16, got I32"},
                     {"q null", [](P& p) { p.q = nullptr; }, "indexer_topk: q must not be null"},
                     {"w null", [](P& p) { p.w = nullptr; }, "w must not be null"},
                     {"topk null", [](P& p) { p.topk = nullptr; }, "topk must not be null"},
                     {"rows", [](P& p) { p.rows.key_len = nullptr; }, "rows.key_len must not be null"},
                     {"tokens", [](P& p) { p.rows.num_tokens = -1; }, "rows.num_tokens must be >= 0, got -1"},
                     {"bt", [](P& p) { p.block_table.max_pages = 0; }, "block_table.max_pages must be >= 1, got 0"},
                     {"overflow", [](P& p) { p.keys.num_pages = int64_t{1} << 50; }, "overflows int64"}});
  // No tokens: output pointers may be null.
  P p = good_indexer();
  p.rows = {0, nullptr, nullptr};
  p.q = nullptr;
  p.topk = nullptr;
  EXPECT_TRUE(validate(p).ok());
}

TEST(KernelValidate, SparseMla) {
  using P = SparseMlaParams;
  expect_refused<P>(
      good_mla, {{"latent dim", [](P& p) { p.latent.dim = 500; }, "sparse_mla: latent.dim must equal Dl=512, got 500"},
                 {"rope dim", [](P& p) { p.rope.dim = 32; }, "rope.dim must equal Dr=64, got 32"},
                 {"page sizes", [](P& p) { p.rope.page_size = 32; }, "rope.page_size must equal latent.page_size=64"},
                 {"pages", [](P& p) { p.rope.num_pages = 9; }, "rope.num_pages must equal latent.num_pages=10, got 9"},
                 {"H", [](P& p) { p.H = 0; }, "H must be >= 1, got 0"},
                 {"K", [](P& p) { p.K = 0; }, "K must be >= 1, got 0"},
                 {"scale", [](P& p) { p.scale = NAN; }, "scale must be finite"},
                 {"out dtype", [](P& p) { p.out_dtype = DType::kI32; }, "out_dtype must be F32 or BF16, got I32"},
                 {"out null", [](P& p) { p.out = nullptr; }, "out must not be null"},
                 {"lse null", [](P& p) { p.lse = nullptr; }, "lse must not be null"},
                 {"q null", [](P& p) { p.q_rope = nullptr; }, "q_rope must not be null"}});
}

TEST(KernelValidate, CacheWriteAndLseMerge) {
  CacheWriteParams cw{g_f, DType::kF32, Fp8ScaleMode::kFp32, nullptr, 2, g_l, {g_f, DType::kBF16, 2, 2, 2}, {}, {}};
  EXPECT_TRUE(validate(cw).ok());
  cw.slots = nullptr;
  EXPECT_NE(validate(cw).message().find("cache_write: slots must not be null"), std::string::npos);
  cw.slots = g_l;
  cw.rows_dtype = DType::kI32;
  EXPECT_NE(validate(cw).message().find("rows_dtype must be F32 or BF16, got I32"), std::string::npos);
  cw.rows_dtype = DType::kF32;
  cw.pool.dim = 0;
  EXPECT_NE(validate(cw).message().find("pool.dim must be >= 1, got 0"), std::string::npos);

  LseMergeParams lm{2, 3, 4, g_f, g_f, g_f, g_f};
  EXPECT_TRUE(validate(lm).ok());
  lm.num_parts = 0;
  EXPECT_NE(validate(lm).message().find("lse_merge: num_parts must be >= 1, got 0"), std::string::npos);
  lm.num_parts = 2;
  lm.part_lse = nullptr;
  EXPECT_NE(validate(lm).message().find("part_lse must not be null"), std::string::npos);
  lm.part_lse = g_f;
  lm.out_dtype = DType::kI32;
  EXPECT_NE(validate(lm).message().find("out_dtype must be F32 or BF16, got I32"), std::string::npos);
}

TEST(KernelValidate, TopkRemapRefusesOverlappingBuffers) {
  int32_t row[16] = {};
  TopkRemapParams p;
  p.num_rows = 2;
  p.K = 4;
  p.topk = row;
  p.local = row + 8;  // adjacent, not overlapping
  p.Pt = 2;
  EXPECT_TRUE(validate(p).ok()) << validate(p).to_string();
  p.local = row + 7;
  EXPECT_NE(validate(p).message().find("topk_remap: topk and local overlap"), std::string::npos);
  p.local = row;
  EXPECT_EQ(validate(p).code(), StatusCode::kInvalidArgument);
}

TEST(KernelValidate, RunRefusesBeforeTheBackendSeesAnything) {
  auto backend = make_cpu_backend(1);
  IndexerTopkParams p = good_indexer();
  p.keys.dim = 64;
  EXPECT_EQ(indexer_topk_run(*backend, p).code(), StatusCode::kInvalidArgument);
}

// Row-synchronized window exchanges (WindowRowSync) are a device feature: the CPU backend refuses each kernel
// that would signal or wait, naming the kernel, and check_sparse_mla answers as sparse_mla would.
TEST(KernelValidate, CpuBackendRefusesWindowRowSync) {
  auto backend = make_cpu_backend(1);
  WindowRowSync sync;
  sync.seq = 3;
  sync.size = 2;
  sync.num_rows = 2;
  IndexerTopkParams ip = good_indexer();
  ip.signal = sync;
  Status st = backend->indexer_topk(ip);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("indexer_topk"), std::string::npos) << st.message();
  SparseMlaParams mp = good_mla();
  EXPECT_TRUE(backend->check_sparse_mla(mp).ok());
  mp.peer.sync = sync;
  st = backend->check_sparse_mla(mp);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("peer"), std::string::npos) << st.message();
  EXPECT_EQ(backend->sparse_mla(mp).code(), StatusCode::kUnsupported);
  TopkMergeParams tp;
  tp.num_parts = 2;
  tp.num_rows = 2;
  tp.K = 4;
  tp.wait = sync;
  st = backend->topk_merge(tp);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("topk_merge"), std::string::npos) << st.message();
  // A bad parameter is still reported as such by check_sparse_mla.
  SparseMlaParams bad = good_mla();
  bad.Dl = 256;
  EXPECT_EQ(backend->check_sparse_mla(bad).code(), StatusCode::kInvalidArgument);
  // The top-k's fused merge (IndexerTopkParams::merge) is refused too, even without a signal.
  IndexerTopkParams fused = good_indexer();
  fused.merge.num_rows = fused.rows.num_tokens;
  fused.merge.num_parts = 2;
  fused.merge.K = fused.K;
  st = backend->indexer_topk(fused);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("fused candidate merge"), std::string::npos) << st.message();
  // begin_synchronize has nothing to enqueue on the CPU.
  EXPECT_TRUE(backend->begin_synchronize().ok());
}

}  // namespace
}  // namespace dsacp
