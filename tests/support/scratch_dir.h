// A test's scratch directory under the system temp directory, removed with everything in it when the guard is
// destroyed: at the end of the test, passed or failed (a failed ASSERT_* returns from the test body, and the local
// guard or the fixture holding it is destroyed all the same).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace dsacp::testing {

// temp_directory_path()/STEM_PID: one per process, so tests run in parallel (ctest -j) never share one.
inline std::filesystem::path scratch_dir_path(const std::string& stem) {
  return std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(::getpid()));
}

class ScratchDir {
 public:
  // Creates scratch_dir_path(stem) empty: whatever an earlier process of the same pid left there is removed.
  explicit ScratchDir(const std::string& stem) : path_(scratch_dir_path(stem)) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;  // a destructor never throws; a directory that cannot be removed is only left behind
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string str() const { return path_.string(); }
  // DIR/name.
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace dsacp::testing
