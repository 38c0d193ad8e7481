// The local (threads) Communicator: collectives, async handles in flight, timeouts and aborts.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/communicator.h"

namespace dsacp {
namespace {

// Runs fn(comm) on `size` threads, one rank each.
void run_ranks(const std::shared_ptr<LocalGroup>& group, int size, const std::function<void(Communicator&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto comm = group->make_communicator(r);
      fn(*comm);
    });
  }
  for (auto& t : threads) t.join();
}

class LocalCommunicatorTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalCommunicatorTest, AllGatherAllToAllBroadcast) {
  const int P = GetParam();
  auto group = LocalGroup::create(P, std::chrono::seconds(20));
  std::atomic<int> failures{0};
  run_ranks(group, P, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<int> send(3), recv(3 * P);
    for (int i = 0; i < 3; ++i) send[i] = 100 * r + i;
    if (!c.all_gather(send.data(), recv.data(), 3 * sizeof(int)).ok()) ++failures;
    for (int k = 0; k < P; ++k) {
      for (int i = 0; i < 3; ++i) failures += recv[k * 3 + i] != 100 * k + i;
    }
    std::vector<int> a2a_send(P), a2a_recv(P);
    for (int k = 0; k < P; ++k) a2a_send[k] = 10 * r + k;  // to rank k
    if (!c.all_to_all(a2a_send.data(), a2a_recv.data(), sizeof(int)).ok()) ++failures;
    for (int k = 0; k < P; ++k) failures += a2a_recv[k] != 10 * k + r;
    int value = r == P - 1 ? 4242 : -1;
    if (!c.broadcast(&value, sizeof value, P - 1).ok()) ++failures;
    failures += value != 4242;
    if (!c.barrier().ok()) ++failures;
  });
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(LocalCommunicatorTest, AllGatherAlongADimension) {
  const int P = GetParam();
  auto group = LocalGroup::create(P, std::chrono::seconds(20));
  std::atomic<int> failures{0};
  // Each rank holds [outer=2, local=3, inner=2]; gathered along dim 1 -> [2, 3P, 2].
  run_ranks(group, P, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<float> send(12), recv(12 * P), scratch(12 * P);
    for (int o = 0; o < 2; ++o)
      for (int l = 0; l < 3; ++l)
        for (int i = 0; i < 2; ++i) send[(o * 3 + l) * 2 + i] = 1000.f * o + 100.f * r + 10.f * l + i;
    if (!c.all_gather_dim(send.data(), recv.data(), scratch.data(), 2, 3, 2, sizeof(float)).ok()) ++failures;
    for (int o = 0; o < 2; ++o)
      for (int g = 0; g < 3 * P; ++g)
        for (int i = 0; i < 2; ++i) {
          const int k = g / 3, l = g % 3;
          failures += recv[(o * 3 * P + g) * 2 + i] != 1000.f * o + 100.f * k + 10.f * l + i;
        }
  });
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(LocalCommunicatorTest, SeveralCollectivesInFlightWaitedInAnyOrder) {
  const int P = GetParam();
  auto group = LocalGroup::create(P, std::chrono::seconds(20));
  std::atomic<int> failures{0};
  run_ranks(group, P, [&](Communicator& c) {
    const int r = c.rank();
    int a = r, b = 10 + r;
    std::vector<int> ra(P), rb(P);
    auto ha = c.all_gather_async(&a, ra.data(), sizeof(int));
    auto hb = c.all_gather_async(&b, rb.data(), sizeof(int));
    if (!ha.ok() || !hb.ok()) {
      ++failures;
      return;
    }
    // Odd ranks wait in reverse order: progress must not depend on it.
    if (r % 2) {
      failures += !(*hb)->wait().ok();
      failures += !(*ha)->wait().ok();
    } else {
      failures += !(*ha)->wait().ok();
      failures += !(*hb)->wait().ok();
    }
    for (int k = 0; k < P; ++k) failures += ra[k] != k || rb[k] != 10 + k;
  });
  EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalCommunicatorTest, ::testing::Values(1, 2, 3, 4, 8),
                         [](const auto& info) { return "P" + std::to_string(info.param); });

// The local group completes a collective on the host (its last rank copies for everyone): it does not order
// itself on the device, so the CP step keeps such collectives off backend lanes; a producer stream is ignored.
// A host backend has one lane: the lane calls do nothing and its work stays in call order.
TEST(LocalCommunicator, CompletesOnTheHostAndHostBackendsHaveOneLane) {
  auto group = LocalGroup::create(1, std::chrono::seconds(5));
  auto c = group->make_communicator(0);
  EXPECT_FALSE(c->orders_on_device());
  int stream_token = 0;
  c->set_producer_stream(&stream_token);
  int x = 7, y = 0;
  ASSERT_TRUE(c->all_gather(&x, &y, sizeof x).ok());
  EXPECT_EQ(y, 7);
  auto cpu = make_cpu_backend(1);
  EXPECT_EQ(cpu->num_lanes(), 1);
  LaneSession lanes(*cpu);
  ASSERT_TRUE(lanes.begin().ok());
  lanes.set_lane(1);
  EXPECT_EQ(cpu->native_stream(), nullptr);
  EXPECT_TRUE(lanes.end().ok());
  EXPECT_TRUE(lanes.end().ok());  // a second end is a no-op
}

// Windows are a device transport's: the local group answers every window call with kUnsupported (the CP step then
// uses its collectives), a row-synchronized exchange included.
TEST(LocalCommunicator, HasNoWindows) {
  auto group = LocalGroup::create(2, std::chrono::seconds(5));
  auto c = group->make_communicator(0);
  EXPECT_EQ(c->window_next(64).status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(c->window_publish().status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(c->window_rows(4).status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(c->window_rows_done().status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(c->window_rows_check().code(), StatusCode::kUnsupported);
}

TEST(LocalCommunicator, MissingRankTimesOutInsteadOfHanging) {
  auto group = LocalGroup::create(2, std::chrono::milliseconds(200));
  auto c0 = group->make_communicator(0);
  int x = 1, y[2];
  Status s = c0->all_gather(&x, y, sizeof x);  // rank 1 never comes
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_NE(s.message().find("1 of 2 ranks arrived"), std::string::npos) << s.message();
  // The group is now failed: later collectives fail at once.
  EXPECT_FALSE(c0->barrier().ok());
}

TEST(LocalCommunicator, AbortReachesEveryRank) {
  auto group = LocalGroup::create(3, std::chrono::seconds(30));
  std::atomic<int> errors{0};
  run_ranks(group, 3, [&](Communicator& c) {
    if (c.rank() == 1) {
      c.abort("out of pages");
      return;
    }
    Status s = c.barrier();
    if (!s.ok() && s.message().find("rank 1 failed: out of pages") != std::string::npos) ++errors;
  });
  EXPECT_EQ(errors.load(), 2);
}

TEST(LocalCommunicator, MismatchedCollectivesAreAnError) {
  auto group = LocalGroup::create(2, std::chrono::seconds(10));
  std::atomic<int> errors{0};
  run_ranks(group, 2, [&](Communicator& c) {
    int x = 0, y[2];
    Status s = c.rank() == 0 ? c.all_gather(&x, y, sizeof x) : c.all_gather(&x, y, 2);
    if (!s.ok()) ++errors;
  });
  EXPECT_EQ(errors.load(), 2);
}

// A group with a copy function (how ranks on one GPU move device buffers): every byte goes through it.
TEST(LocalCommunicator, CopyFunctionMovesEveryBuffer) {
  std::atomic<int> copies{0};
  CopyFn copy = [&](void* dst, const void* src, size_t n) {
    ++copies;
    std::memcpy(dst, src, n);
    return Status();
  };
  const int P = 3;
  auto group = LocalGroup::create(P, std::chrono::seconds(20), copy);
  std::atomic<int> failures{0};
  run_ranks(group, P, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<int> send(4), recv(4 * P);
    for (int i = 0; i < 4; ++i) send[i] = 10 * r + i;
    if (!c.all_gather(send.data(), recv.data(), 4 * sizeof(int)).ok()) ++failures;
    for (int k = 0; k < P; ++k) failures += recv[k * 4] != 10 * k;
    std::vector<int> a2a(P, r), back(P, -1);
    if (!c.all_to_all(a2a.data(), back.data(), sizeof(int)).ok()) ++failures;
    for (int k = 0; k < P; ++k) failures += back[k] != k;
    // all_gather_dim through the copy function: [2, 1, 3] blocks -> [2, P, 3].
    std::vector<int> blk(6), dim(6 * P), scratch(6 * P);
    for (int i = 0; i < 6; ++i) blk[i] = 100 * r + i;
    if (!c.all_gather_dim(blk.data(), dim.data(), scratch.data(), 2, 1, 3, sizeof(int)).ok()) ++failures;
    for (int o = 0; o < 2; ++o)
      for (int k = 0; k < P; ++k) failures += dim[(o * P + k) * 3] != 100 * k + o * 3;
  });
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(copies.load(), 0);
}

TEST(LocalCommunicator, FailingCopyFailsEveryRank) {
  CopyFn copy = [](void*, const void*, size_t) { return Status(StatusCode::kBackendError, "device copy broke"); };
  auto group = LocalGroup::create(2, std::chrono::seconds(20), copy);
  std::atomic<int> errors{0};
  std::atomic<int> named{0};
  run_ranks(group, 2, [&](Communicator& c) {
    int x = c.rank(), y[2];
    Status s = c.all_gather(&x, y, sizeof x);
    if (!s.ok()) ++errors;
    if (s.message().find("device copy broke") != std::string::npos) ++named;
  });
  EXPECT_EQ(errors.load(), 2);
  EXPECT_EQ(named.load(), 2);
}

// Grouped collectives (one NCCL group on GPUs; started one by one here) give what the single ones give.
TEST(LocalCommunicator, GroupedCollectives) {
  const int P = 3;
  auto group = LocalGroup::create(P, std::chrono::seconds(20));
  std::atomic<int> failures{0};
  run_ranks(group, P, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<int> a(2, r), b(5, 7 * r), ra(2 * P), rb(5 * P);
    auto h = c.all_gather_group_async({{a.data(), ra.data(), 2 * sizeof(int)}, {b.data(), rb.data(), 5 * sizeof(int)}});
    if (!h.ok() || !(*h)->wait().ok()) ++failures;
    for (int k = 0; k < P; ++k) failures += ra[2 * k] != k || rb[5 * k + 4] != 7 * k;
    std::vector<int> x(P), y(P * 2), rx(P), ry(P * 2);
    for (int k = 0; k < P; ++k) {
      x[k] = 10 * r + k;
      y[2 * k] = y[2 * k + 1] = 20 * r + k;
    }
    auto g = c.all_to_all_group_async({{x.data(), rx.data(), sizeof(int)}, {y.data(), ry.data(), 2 * sizeof(int)}});
    if (!g.ok() || !(*g)->wait().ok()) ++failures;
    for (int k = 0; k < P; ++k) failures += rx[k] != 10 * k + r || ry[2 * k + 1] != 20 * k + r;
  });
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace dsacp
