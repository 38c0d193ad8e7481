// The MPI communicator, run under `mpirun -np 4` (ctest label `mpi`). Every rank runs every test in the same
// order; a failing rank makes mpirun exit non-zero. With `--abort-case` the program instead checks that
// Communicator::abort ends the whole job while a peer waits in a collective (ctest expects the failure).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "dsacp/mpi_context.h"

namespace dsacp {
namespace {

MpiContext* g_mpi = nullptr;

std::unique_ptr<Communicator> world_comm(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  auto w = g_mpi->world(timeout);
  EXPECT_TRUE(w.ok()) << w.status().to_string();
  return w.ok() ? std::move(w).value() : nullptr;
}

// A byte pattern that names the sender, the receiver block and the position.
uint8_t pattern(int from, int block, size_t i) { return static_cast<uint8_t>(from * 37 + block * 11 + i * 3 + 1); }

TEST(MpiCommunicator, RankAndSize) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->size(), g_mpi->size());
  EXPECT_EQ(w->rank(), g_mpi->rank());
  EXPECT_GE(w->size(), 2) << "run under mpirun -np 4";
}

TEST(MpiCommunicator, AllGather) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  const int n = w->size(), me = w->rank();
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{13}, size_t{1} << 20}) {
    std::vector<uint8_t> send(bytes), recv(bytes * n + 1, 0xAB);
    for (size_t i = 0; i < bytes; ++i) send[i] = pattern(me, 0, i);
    ASSERT_TRUE(w->all_gather(send.data(), recv.data(), bytes).ok()) << bytes;
    for (int k = 0; k < n; ++k) {
      for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(recv[k * bytes + i], pattern(k, 0, i)) << "block " << k;
    }
    EXPECT_EQ(recv[bytes * n], 0xAB) << "wrote past the receive buffer";
  }
}

TEST(MpiCommunicator, AllToAll) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  const int n = w->size(), me = w->rank();
  const size_t bytes = 1000;
  std::vector<uint8_t> send(bytes * n), recv(bytes * n, 0);
  for (int k = 0; k < n; ++k) {
    for (size_t i = 0; i < bytes; ++i) send[k * bytes + i] = pattern(me, k, i);
  }
  ASSERT_TRUE(w->all_to_all(send.data(), recv.data(), bytes).ok());
  for (int k = 0; k < n; ++k) {
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(recv[k * bytes + i], pattern(k, me, i)) << "from rank " << k;
  }
}

TEST(MpiCommunicator, BroadcastFromEveryRoot) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  for (int root = 0; root < w->size(); ++root) {
    std::vector<uint8_t> buf(777);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = pattern(w->rank(), 0, i);
    ASSERT_TRUE(w->broadcast(buf.data(), buf.size(), root).ok());
    for (size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf[i], pattern(root, 0, i)) << "root " << root;
  }
  std::vector<uint8_t> buf(4);
  EXPECT_EQ(w->broadcast_async(buf.data(), buf.size(), w->size()).status().code(), StatusCode::kInvalidArgument);
}

TEST(MpiCommunicator, Barrier) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(w->barrier().ok());
}

TEST(MpiCommunicator, AllGatherDim) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  const int n = w->size(), me = w->rank();
  const int64_t outer = 3, local = 2, inner = 5;
  std::vector<int32_t> send(outer * local * inner), recv(outer * n * local * inner, -1), scratch(recv.size());
  auto value = [](int64_t o, int64_t j, int64_t x) { return static_cast<int32_t>(o * 10000 + j * 100 + x); };
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < local; ++j) {
      for (int64_t x = 0; x < inner; ++x) send[(o * local + j) * inner + x] = value(o, me * local + j, x);
    }
  }
  ASSERT_TRUE(w->all_gather_dim(send.data(), recv.data(), scratch.data(), outer, local, inner, sizeof(int32_t)).ok());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < n * local; ++j) {
      for (int64_t x = 0; x < inner; ++x) ASSERT_EQ(recv[(o * n * local + j) * inner + x], value(o, j, x));
    }
  }
}

TEST(MpiCommunicator, AsyncWaitsInAnyOrder) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  const int n = w->size(), me = w->rank();
  const size_t bytes = 4096;
  std::vector<uint8_t> g_send(bytes), g_recv(bytes * n), a_send(bytes * n), a_recv(bytes * n), b_buf(bytes);
  for (size_t i = 0; i < bytes; ++i) g_send[i] = pattern(me, 1, i);
  for (int k = 0; k < n; ++k) {
    for (size_t i = 0; i < bytes; ++i) a_send[k * bytes + i] = pattern(me, k, i);
  }
  for (size_t i = 0; i < bytes; ++i) b_buf[i] = pattern(me, 2, i);
  auto g = w->all_gather_async(g_send.data(), g_recv.data(), bytes);
  auto a = w->all_to_all_async(a_send.data(), a_recv.data(), bytes);
  auto b = w->broadcast_async(b_buf.data(), bytes, n - 1);
  ASSERT_TRUE(g.ok() && a.ok() && b.ok());
  // Each rank waits in its own order: the last posted first on odd ranks, the middle one first on even ones.
  std::vector<CollectiveHandle*> order = {g->get(), a->get(), b->get()};
  if (me % 2 == 1)
    std::reverse(order.begin(), order.end());
  else
    std::swap(order[0], order[1]);
  for (CollectiveHandle* h : order) ASSERT_TRUE(h->wait().ok());
  for (int k = 0; k < n; ++k) {
    for (size_t i = 0; i < bytes; ++i) {
      ASSERT_EQ(g_recv[k * bytes + i], pattern(k, 1, i));
      ASSERT_EQ(a_recv[k * bytes + i], pattern(k, me, i));
    }
  }
  for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(b_buf[i], pattern(n - 1, 2, i));
  // A handle dropped without wait() completes in its destructor.
  {
    auto h = w->all_gather_async(g_send.data(), g_recv.data(), bytes);
    ASSERT_TRUE(h.ok());
  }
  ASSERT_TRUE(w->barrier().ok());
}

TEST(MpiCommunicator, SplitGroups) {
  // Two groups: even and odd world ranks, ranked in reverse world order.
  auto g = g_mpi->split(g_mpi->rank() % 2, -g_mpi->rank(), std::chrono::seconds(20));
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  Communicator& c = **g;
  const int world = g_mpi->size(), me = g_mpi->rank();
  const int members = (world + 1 - me % 2) / 2;
  ASSERT_EQ(c.size(), members);
  const int32_t mine = me;
  std::vector<int32_t> all(members);
  ASSERT_TRUE(c.all_gather(&mine, all.data(), sizeof(int32_t)).ok());
  for (int k = 0; k < members; ++k) EXPECT_EQ(all[k] % 2, me % 2);
  for (int k = 1; k < members; ++k) EXPECT_GT(all[k - 1], all[k]) << "ranked by key (descending world rank)";
  EXPECT_EQ(all[c.rank()], me);
  EXPECT_EQ(g_mpi->split(-1, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(MpiCommunicator, CountsAboveIntMaxAreRefused) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  const size_t huge = size_t{1} << 31;
  auto g = w->all_gather_async(nullptr, nullptr, huge);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(g.status().message().find("INT_MAX"), std::string::npos) << g.status().message();
  EXPECT_FALSE(w->all_to_all_async(nullptr, nullptr, huge).ok());
  EXPECT_FALSE(w->broadcast_async(nullptr, huge, 0).ok());
  // The communicator is still usable.
  ASSERT_TRUE(w->barrier().ok());
}

TEST(MpiCommunicator, SkippedCollectiveTimesOutOnThePeers) {
  auto w = world_comm();
  ASSERT_NE(w, nullptr);
  // A group of its own with a short timeout; rank 0 never joins its all-gather.
  auto g = g_mpi->split(0, g_mpi->rank(), std::chrono::milliseconds(300));
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  static std::vector<uint8_t> send(64), recv(64 * 64);  // outlive the (never completed) operation
  if (g_mpi->rank() != 0) {
    const auto start = std::chrono::steady_clock::now();
    const Status s = (*g)->all_gather(send.data(), recv.data(), send.size());
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("all_gather timed out"), std::string::npos) << s.message();
    EXPECT_GE(waited, 0.25);
    EXPECT_LT(waited, 10.0);
    // The communicator is failed now: the next collective fails at once instead of waiting again.
    const Status again = (*g)->barrier();
    EXPECT_EQ(again.code(), StatusCode::kBackendError) << again.to_string();
    EXPECT_NE(again.message().find("timed out"), std::string::npos) << again.message();
  }
  // Everyone meets again on the healthy world communicator.
  ASSERT_TRUE(w->barrier().ok());
}

// --abort-case: rank 1 aborts while the others wait in a barrier; MPI_Abort must end every process.
int abort_case() {
  auto w = g_mpi->world(std::chrono::seconds(30));
  if (!w.ok()) return 3;
  if (g_mpi->rank() == 1) (*w)->abort("abort-case: rank 1 gives up on purpose");
  const Status s = (*w)->barrier();
  std::fprintf(stderr, "abort-case: rank %d left the barrier (%s): the abort did not end the job\n", g_mpi->rank(),
               s.to_string().c_str());
  return 0;
}

}  // namespace
}  // namespace dsacp

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  bool abort_case = false;
  for (int i = 1; i < argc; ++i) abort_case |= std::strcmp(argv[i], "--abort-case") == 0;
  auto mpi = dsacp::MpiContext::init(std::chrono::seconds(30));
  if (!mpi.ok()) {
    std::fprintf(stderr, "dsacp_mpi_tests: %s\n", mpi.status().to_string().c_str());
    return 1;
  }
  dsacp::g_mpi = mpi->get();
  if (abort_case) return dsacp::abort_case();
  const int rc = RUN_ALL_TESTS();
  mpi->reset();  // MPI_Finalize
  return rc;
}
