// RankWorkers: one long-lived thread per rank, job(r) on thread r, every run waits for all ranks.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "core/rank_workers.h"

namespace dsacp {
namespace {

TEST(RankWorkers, RunsEveryRankOnItsOwnThreadEveryTime) {
  RankWorkers w(4);
  ASSERT_EQ(w.size(), 4);
  std::vector<std::thread::id> first(4), again(4);
  w.run([&](int32_t r) { first[r] = std::this_thread::get_id(); });
  for (int step = 0; step < 50; ++step) {
    w.run([&](int32_t r) { again[r] = std::this_thread::get_id(); });
    EXPECT_EQ(again, first) << "step " << step;  // the same thread for a rank, step after step
  }
  std::set<std::thread::id> distinct(first.begin(), first.end());
  EXPECT_EQ(distinct.size(), 4u);
  EXPECT_EQ(distinct.count(std::this_thread::get_id()), 0u);  // never the caller's thread
}

TEST(RankWorkers, RunReturnsOnlyAfterEveryRankFinished) {
  RankWorkers w(3);
  for (int step = 0; step < 200; ++step) {
    std::atomic<int> done{0};
    std::vector<int> seen(3, -1);
    w.run([&](int32_t r) {
      if (r == step % 3) std::this_thread::yield();  // one rank later than the others
      seen[r] = step;
      done.fetch_add(1);
    });
    ASSERT_EQ(done.load(), 3);
    ASSERT_EQ(seen, std::vector<int>(3, step));
  }
}

TEST(RankWorkers, RanksCanWaitForEachOtherInsideARun) {
  // A rank's job may block until the others arrive (what collectives do): every rank runs at once.
  RankWorkers w(4);
  std::atomic<int> arrived{0};
  w.run([&](int32_t) {
    arrived.fetch_add(1);
    while (arrived.load() < 4) std::this_thread::yield();
  });
  EXPECT_EQ(arrived.load(), 4);
}

TEST(RankWorkers, RunsFromSeveralCallersAreSerialized) {
  RankWorkers w(2);
  std::atomic<int> inside{0}, most{0}, total{0};
  auto caller = [&] {
    for (int i = 0; i < 100; ++i) {
      w.run([&](int32_t) {
        const int now = inside.fetch_add(1) + 1;
        int m = most.load();
        while (now > m && !most.compare_exchange_weak(m, now)) {
        }
        total.fetch_add(1);
        inside.fetch_sub(1);
      });
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 400);
  EXPECT_LE(most.load(), 2);  // never more than one run's two ranks at once
}


// Issue #30: a thread that cannot be started (std::system_error) hung in the constructor (pthread_cond_destroy
// under waiting threads) or ended in std::terminate. Now the creation fails with a Status and every thread that
// did start is joined.
TEST(RankWorkers, AThreadThatCannotStartIsAStatusNotAHang) {
  for (int32_t fail_at : {0, 1, 5}) {
    auto w = RankWorkers::create(8, fail_at);
    ASSERT_FALSE(w.ok()) << fail_at;
    EXPECT_EQ(w.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(w.status().message().find("cannot start the thread of CP rank " + std::to_string(fail_at) + " of 8"),
              std::string::npos)
        << w.status().message();
  }
  auto ok = RankWorkers::create(3);
  ASSERT_TRUE(ok.ok());
  std::atomic<int> ran{0};
  (*ok)->run([&](int32_t) { ++ran; });
  EXPECT_EQ(ran.load(), 3);
}

}  // namespace
}  // namespace dsacp
