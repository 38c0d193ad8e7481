// A small strict command-line parser: declared options only, every value checked, clear one-line errors.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dsacp/status.h"

namespace dsacp::cli {

struct OptionSpec {
  std::string name;      // "--page-size"
  std::string value;     // "N" (empty for a switch)
  std::string help;
  std::string fallback;  // default shown in help; empty = none
};

struct CommandSpec {
  std::string name;         // "replay"
  std::string usage;        // "dsacp replay CASE --out RESULT [options]"
  std::string summary;
  std::vector<std::string> positionals;  // names of required positionals ("CASE")
  std::vector<OptionSpec> options;
};

std::string command_help(const CommandSpec& spec);

class ParsedArgs {
 public:
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> get(const std::string& name) const;
  std::string get_or(const std::string& name, const std::string& fallback) const;
  // Integer in [lo, hi]; "--page-size: expected an integer in [1, 1024], got \"abc\"".
  Result<int64_t> get_int(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const;
  Result<double> get_double(const std::string& name, double fallback) const;
  // "A:B" or "A" (then B = A), both in [lo, hi], A <= B.
  Result<std::pair<int64_t, int64_t>> get_range(const std::string& name, std::pair<int64_t, int64_t> fallback,
                                                int64_t lo, int64_t hi) const;
  Result<std::string> get_choice(const std::string& name, const std::string& fallback,
                                 const std::vector<std::string>& choices) const;
  const std::vector<std::string>& positionals() const { return positionals_; }
  bool help() const { return help_; }

 private:
  friend Result<ParsedArgs> parse_args(const CommandSpec&, const std::vector<std::string>&);
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
  bool help_ = false;
};

Result<ParsedArgs> parse_args(const CommandSpec& spec, const std::vector<std::string>& args);

Result<int64_t> parse_int(const std::string& what, const std::string& text, int64_t lo, int64_t hi);
// "512M", "24G", "1048576": bytes (K, M, G, T are powers of 1024), >= 1.
Result<uint64_t> parse_bytes(const std::string& what, const std::string& text);

}  // namespace dsacp::cli
