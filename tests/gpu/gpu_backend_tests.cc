// The CUDA backend's behaviour: deferred error checks, the block cache, lanes, and unsupported shapes answered
// with what is supported.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "gpu/gpu_kernel_data.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

// Deferred error checks (what the executors use): launches return at once, the first data error comes back
// from synchronize() naming its launch; a scope left early drops its errors; uploads staged in the pinned ring
// are copies of the bytes at call time (the ring wraps past 8 MiB).
void test_deferred_errors(Backend& gpu) {
  const int dim = 8;
  const int64_t src_rows = 10, n = 4;
  std::vector<float> src(src_rows * dim);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
  Dev d_src = upload(gpu, src), d_good = upload(gpu, std::vector<int64_t>{0, 3, -1, 9}),
      d_bad = upload(gpu, std::vector<int64_t>{0, 3, 10, 9}), d_out = upload(gpu, std::vector<float>(n * dim, 0.f));
  GatherRowsParams good;
  good.src = d_src.buf.get();
  good.src_dtype = DType::kF32;
  good.src_rows = src_rows;
  good.dim = dim;
  good.index = d_good.ptr<int64_t>();
  good.num_rows = n;
  good.dst = d_out.buf.get();
  good.dst_dtype = DType::kF32;
  GatherRowsParams bad = good;
  bad.index = d_bad.ptr<int64_t>();
  Status g1, b1, g2, sync1, sync2;
  {
    DeferredErrors defer(gpu);
    g1 = gather_rows_run(gpu, good);
    b1 = gather_rows_run(gpu, bad);
    g2 = gather_rows_run(gpu, good);
    sync1 = gpu.synchronize();
    sync2 = gpu.synchronize();
  }
  report(g1.ok() && b1.ok() && g2.ok() && sync1.code() == StatusCode::kOutOfRange &&
             sync1.message().find("gather_rows: index[2]") != std::string::npos &&
             sync1.message().find("launch 2 of 3") != std::string::npos && sync2.ok(),
         "deferred: a bad index reports at synchronize, naming its launch", sync1.to_string());
  // begin_synchronize enqueues the read-back early; launches after it are still read back.
  Status staged, early_sync, late_sync, clean_sync;
  {
    DeferredErrors defer(gpu);
    (void)gather_rows_run(gpu, bad);
    staged = gpu.begin_synchronize();
    early_sync = gpu.synchronize();
    (void)gather_rows_run(gpu, good);
    (void)gpu.begin_synchronize();
    (void)gather_rows_run(gpu, bad);
    late_sync = gpu.synchronize();
    (void)gather_rows_run(gpu, good);
    (void)gpu.begin_synchronize();
    clean_sync = gpu.synchronize();
  }
  report(staged.ok() && early_sync.code() == StatusCode::kOutOfRange &&
             early_sync.message().find("gather_rows: index[2]") != std::string::npos &&
             late_sync.code() == StatusCode::kOutOfRange && late_sync.message().find("launch 2 of 2") != std::string::npos &&
             clean_sync.ok(),
         "deferred: begin_synchronize reads back early; a launch after it is still checked",
         early_sync.to_string() + " | " + late_sync.to_string() + " | " + clean_sync.to_string());
  {
    DeferredErrors defer(gpu);
    (void)gather_rows_run(gpu, bad);
  }  // left without synchronize: dropped
  Status after = gather_rows_run(gpu, good);
  report(after.ok() && gpu.synchronize().ok(), "deferred: a scope left early drops its errors", after.to_string());

  // 3000 uploads of 4 KiB from one host buffer rewritten between calls: 12 MiB through the 8 MiB ring.
  const size_t chunk = 1024, count = 3000;
  auto big = gpu.allocate(chunk * count * sizeof(int32_t));
  if (!big.ok()) return report(false, "deferred uploads", big.status().to_string());
  std::vector<int32_t> host(chunk);
  Status up, sync;
  {
    DeferredErrors defer(gpu);
    for (size_t k = 0; k < count && up.ok(); ++k) {
      for (size_t i = 0; i < chunk; ++i) host[i] = static_cast<int32_t>(splitmix64(k * chunk + i));
      up = gpu.copy_to_device(big->as<int32_t>() + k * chunk, host.data(), chunk * sizeof(int32_t));
    }
    sync = gpu.synchronize();
  }
  std::vector<int32_t> got(chunk * count);
  Status down = gpu.copy_to_host(got.data(), big->get(), got.size() * sizeof(int32_t));
  size_t wrong = 0;
  for (size_t j = 0; j < got.size(); ++j) wrong += got[j] != static_cast<int32_t>(splitmix64(j));
  report(up.ok() && sync.ok() && down.ok() && wrong == 0, "deferred: 3000 uploads through the pinned ring",
         std::to_string(wrong) + " words wrong " + up.to_string());
}

// The backend's block cache: a freed block comes back for the next allocation of its size class (in stream
// order, so data written through the new buffer is never overwritten by work queued for the old one); an
// allocation the device cannot hold fails with resource_exhausted after the cache is given back.
void test_block_cache(Backend& gpu, bool try_oom) {
  void* first = nullptr;
  {
    auto a = gpu.allocate(3u << 20);
    if (!a.ok()) return report(false, "block cache", a.status().to_string());
    first = a->get();
  }
  auto b = gpu.allocate((3u << 20) - 1000);  // the same size class
  report(b.ok() && b->get() == first, "block cache: a freed block is reused by the next allocation of its class",
         b.ok() ? "" : b.status().to_string());
  // Stream order: fill through buffer x, free it, reuse its block as y in the same deferred scope, fill y;
  // x's fill is queued before y's, so y reads back its own bytes.
  const size_t n = 1 << 18;
  std::vector<int32_t> ones(n, 1), twos(n, 2), got(n, 0);
  Status s1, s2, sync;
  void* reused = nullptr;
  {
    DeferredErrors defer(gpu);
    auto x = gpu.allocate(n * sizeof(int32_t));
    if (!x.ok()) return report(false, "block cache order", x.status().to_string());
    s1 = gpu.copy_to_device(x->get(), ones.data(), n * sizeof(int32_t));
    void* xp = x->get();
    *x = DeviceBuffer{};
    auto y = gpu.allocate(n * sizeof(int32_t));
    if (!y.ok()) return report(false, "block cache order", y.status().to_string());
    reused = y->get() == xp ? y->get() : nullptr;
    s2 = gpu.copy_to_device(y->get(), twos.data(), n * sizeof(int32_t));
    sync = gpu.synchronize();
    if (sync.ok()) sync = gpu.copy_to_host(got.data(), y->get(), n * sizeof(int32_t));
  }
  report(s1.ok() && s2.ok() && sync.ok() && reused != nullptr && got == twos,
         "block cache: reuse within a deferred scope is stream-ordered", sync.to_string());
  // Not under --quick (what compute-sanitizer runs): the failing cudaMallocAsync counts as an API error there.
  if (!try_oom) return;
  auto huge = gpu.allocate(size_t{1} << 42);  // 4 TiB
  report(!huge.ok() && huge.status().code() == StatusCode::kResourceExhausted &&
             huge.status().message().find("allocation of 4398046511104 bytes") != std::string::npos,
         "block cache: an allocation past the device fails with resource_exhausted",
         huge.ok() ? "allocated" : huge.status().to_string());
  auto after = gpu.allocate(1u << 20);
  report(after.ok(), "block cache: allocations work after a failed one", after.ok() ? "" : after.status().to_string());
}

// Lanes: the side lane is its own stream; work on it is ordered after the main lane's work before begin_lanes
// and before the main lane's work after end_lanes; a block freed in a session is not handed out again until the
// session ends; a second session on the same thread is refused.
void test_lanes(Backend& gpu) {
  const size_t n = size_t{1} << 26;  // 256 MiB of int32: a fill long enough for ordering mistakes to show
  auto big = gpu.allocate(n * sizeof(int32_t));
  auto copy = gpu.allocate(n * sizeof(int32_t));
  if (!big.ok() || !copy.ok()) return report(false, "lanes", "allocation failed");
  Status s;
  void* main_stream = gpu.native_stream();
  void* side_stream = nullptr;
  void* held = nullptr;
  bool reused_in_session = true;
  {
    DeferredErrors defer(gpu);
    s = gpu.fill(big->get(), DType::kI32, static_cast<int64_t>(n), 3.f);  // main, before the session
    LaneSession lanes(gpu);
    if (s.ok()) s = lanes.begin();
    Status again = gpu.begin_lanes();
    report(!again.ok() && again.message().find("already open") != std::string::npos,
           "lanes: a second session on one thread is refused", again.to_string());
    lanes.set_lane(1);
    side_stream = gpu.native_stream();
    // Side: reads what main wrote before the session, then overwrites it.
    if (s.ok()) s = gpu.copy_on_device(copy->get(), big->get(), n * sizeof(int32_t));
    if (s.ok()) s = gpu.fill(big->get(), DType::kI32, static_cast<int64_t>(n), 1.f);
    {
      auto x = gpu.allocate(3u << 20);
      if (x.ok()) held = x->get();
    }
    auto y = gpu.allocate(3u << 20);
    reused_in_session = y.ok() && y->get() == held;
    lanes.set_lane(0);
    if (s.ok()) s = lanes.end();
    if (s.ok()) s = gpu.synchronize();
  }
  report(s.ok() && side_stream != nullptr && side_stream != main_stream && gpu.native_stream() == main_stream,
         "lanes: the side lane is a stream of its own, the main lane comes back at the end", s.to_string());
  report(held != nullptr && !reused_in_session, "lanes: a block freed in a session is held until it ends");
  // The free list now holds the held block, then y's (freed after the session, so on top): two allocations of
  // the class take both.
  auto z1 = gpu.allocate(3u << 20);
  auto z2 = gpu.allocate(3u << 20);
  report(z1.ok() && z2.ok() && (z1->get() == held || z2->get() == held), "lanes: held blocks are reused after the session");
  // Main after the session: sees the side lane's fill; the side lane saw main's fill from before the session.
  std::vector<int32_t> a(n), b(n);
  Status d1 = gpu.copy_to_host(a.data(), big->get(), n * sizeof(int32_t));
  Status d2 = gpu.copy_to_host(b.data(), copy->get(), n * sizeof(int32_t));
  const bool a_ok = std::all_of(a.begin(), a.end(), [](int32_t v) { return v == 1; });
  const bool b_ok = std::all_of(b.begin(), b.end(), [](int32_t v) { return v == 3; });
  report(d1.ok() && d2.ok() && a_ok && b_ok, "lanes: side work ordered after main's before begin, before main's after end",
         std::string(a_ok ? "" : "side fill not seen ") + (b_ok ? "" : "main fill not seen by the side lane"));
}

void test_unsupported(Backend& gpu) {
  SparseMlaParams p;
  p.H = 8;  // every H runs; the latent width does not
  p.Dl = 256;
  p.Dr = 64;
  Status s = gpu.sparse_mla(p);
  report(s.code() == StatusCode::kUnsupported && s.message().find("Dl=256") != std::string::npos &&
             s.message().find("Dl = 512") != std::string::npos,
         "sparse_mla Dl=256 -> unsupported naming the supported set", s.to_string());
  IndexerTopkParams q;
  q.Hi = 48;
  q.Di = 128;
  q.q_dtype = DType::kBF16;
  q.keys.dtype = DType::kBF16;
  s = gpu.indexer_topk(q);
  report(s.code() == StatusCode::kUnsupported && s.message().find("Hi = 32 or 64") != std::string::npos,
         "indexer_topk Hi=48 -> unsupported naming the supported set", s.to_string());
  // The fused candidate merge needs the row-synchronized exchange, and its shape must be the top-k's.
  IndexerTopkParams fm;
  fm.Hi = 64;
  fm.Di = 128;
  fm.K = 2048;
  fm.q_dtype = DType::kBF16;
  fm.keys = {nullptr, DType::kBF16, 1, 64, 128};
  fm.rows.num_tokens = 2;
  fm.merge.num_rows = 2;
  fm.merge.num_parts = 2;
  fm.merge.K = 2048;
  s = gpu.indexer_topk(fm);
  report(s.code() == StatusCode::kInvalidArgument && s.message().find("row-synchronized") != std::string::npos,
         "indexer_topk with a fused merge but no row-synchronized exchange -> invalid argument", s.to_string());
  fm.signal.seq = fm.merge.wait.seq = 1;
  fm.signal.size = 2;
  fm.merge.K = 1024;
  s = gpu.indexer_topk(fm);
  report(s.code() == StatusCode::kInvalidArgument && s.message().find("K=1024") != std::string::npos &&
             s.message().find("K=2048") != std::string::npos,
         "indexer_topk with a fused merge of another K -> invalid argument naming both", s.to_string());
  fm.merge.K = 2048;
  fm.merge.num_parts = fm.signal.size = 4;
  s = gpu.indexer_topk(fm);
  report(s.code() == StatusCode::kUnsupported && s.message().find("4 x 2048") != std::string::npos,
         "indexer_topk with a fused merge of 4 x 2048 candidates -> unsupported", s.to_string());
  SparseMlaParams hb;
  hb.H = 128;
  hb.Dl = 512;
  hb.Dr = 64;
  hb.latent = {nullptr, DType::kBF16, 4, 64, 512};
  hb.rope = {nullptr, DType::kBF16, 4, 64, 64};
  // The ranks' partials merged inside attention need 64 heads a rank: 32 heads per block (which attention alone
  // runs, in 32-head groups) is refused with the reason, so that the CP step takes its other path.
  hb.head_blocks = 4;
  hb.peer.sync.seq = 1;
  hb.peer.sync.size = 4;
  hb.peer.sync.num_rows = 1;
  s = gpu.sparse_mla(hb);
  report(s.code() == StatusCode::kUnsupported && s.message().find("64 heads a rank") != std::string::npos &&
             s.message().find("head_blocks=4") != std::string::npos,
         "sparse_mla H=128 head_blocks=4 merged across ranks -> unsupported", s.to_string());
  hb.H = 16;
  hb.head_blocks = 2;
  hb.peer.sync.size = 2;
  s = gpu.sparse_mla(hb);
  report(s.code() == StatusCode::kUnsupported && s.message().find("64 heads a rank") != std::string::npos,
         "sparse_mla H=16 head_blocks=2 merged across ranks -> unsupported", s.to_string());
}

}  // namespace

class GpuBackend : public GpuTest {};

TEST_F(GpuBackend, Unsupported) { test_unsupported(gpu()); }
TEST_F(GpuBackend, DeferredErrors) { test_deferred_errors(gpu()); }
TEST_F(GpuBackend, BlockCache) { test_block_cache(gpu(), !gpu_test_options().quick); }
TEST_F(GpuBackend, Lanes) { test_lanes(gpu()); }

}  // namespace dsacp::testing
