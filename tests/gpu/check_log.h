// The GPU test binaries' record of their checks: one "[  OK  ]" / "[ FAIL ]" line per check on stdout, the
// counts, and the JSON file the GPU scripts keep ({<header fields>"checks":N,"failures":M,"log":[lines]}).
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/json.h"

namespace dsacp::testing {

class CheckLog {
 public:
  void report(bool ok, const std::string& name, const std::string& detail = "") {
    ++checks_;
    if (!ok) ++failures_;
    std::string line = std::string(ok ? "[  OK  ] " : "[ FAIL ] ") + name + (detail.empty() ? "" : "  " + detail);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    if (!ok && on_failure) on_failure(line);
    lines_.push_back(std::move(line));
  }
  // Called with a failed check's line (the GoogleTest binaries fail the running test there).
  std::function<void(const std::string&)> on_failure;
  int checks() const { return checks_; }
  int failures() const { return failures_; }

  // `header` holds leading fields, each followed by a comma (e.g. "\"seed\":7,"); an empty path writes nothing.
  void write_json(const std::string& path, const std::string& header = "") const {
    if (path.empty()) return;
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return;
    std::fprintf(f, "{%s\"checks\":%d,\"failures\":%d,\"log\":[", header.c_str(), checks_, failures_);
    for (size_t i = 0; i < lines_.size(); ++i) {
      std::fprintf(f, "%s\n  %s", i ? "," : "", json::quote(lines_[i]).c_str());
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }

 private:
  int checks_ = 0, failures_ = 0;
  std::vector<std::string> lines_;
};

}  // namespace dsacp::testing
