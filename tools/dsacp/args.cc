#include "args.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/json.h"

namespace dsacp::cli {

std::string command_help(const CommandSpec& spec) {
  std::string s = "usage: " + spec.usage + "\n\n" + spec.summary + "\n";
  if (!spec.options.empty()) s += "\noptions:\n";
  for (const OptionSpec& o : spec.options) {
    std::string left = "  " + o.name + (o.value.empty() ? "" : " " + o.value);
    if (left.size() < 28) left.resize(28, ' ');
    else left += "\n" + std::string(28, ' ');
    s += left + o.help;
    if (!o.fallback.empty()) s += " (default " + o.fallback + ")";
    s += "\n";
  }
  s += "  --help                    this text\n";
  return s;
}

std::optional<std::string> ParsedArgs::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string ParsedArgs::get_or(const std::string& name, const std::string& fallback) const {
  auto v = get(name);
  return v ? *v : fallback;
}

// Strict: optional '-', then decimal digits and nothing else (no space on either side, no '+', no "0x").
Result<int64_t> parse_int(const std::string& what, const std::string& text, int64_t lo, int64_t hi) {
  auto bad = [&]() {
    return invalid_argument(what + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                            "], got " + json::quote_name(text, 40));
  };
  if (text.empty() || text.size() > 20) return bad();
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || v < lo || v > hi) return bad();
  return v;
}

Result<uint64_t> parse_bytes(const std::string& what, const std::string& text) {
  auto bad = [&]() {
    return invalid_argument(what + ": expected a byte count such as 512M, 24G or 1048576 (suffixes K, M, G, T: "
                            "powers of 1024), got " + json::quote_name(text, 40));
  };
  if (text.empty() || text.size() > 24 || text[0] < '0' || text[0] > '9') return bad();
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc()) return bad();
  const std::string suffix(p, text.data() + text.size());
  int shift = 0;
  if (suffix == "K" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "m") shift = 20;
  else if (suffix == "G" || suffix == "g") shift = 30;
  else if (suffix == "T" || suffix == "t") shift = 40;
  else if (!suffix.empty()) return bad();
  if (v == 0 || (shift > 0 && v > (~uint64_t{0} >> shift))) return bad();
  return v << shift;
}

Result<int64_t> ParsedArgs::get_int(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
  auto v = get(name);
  if (!v) return fallback;
  return parse_int(name, *v, lo, hi);
}

Result<double> ParsedArgs::get_double(const std::string& name, double fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  // Strict like parse_int: no space around the number, no hex. An underflow (1e-400) is a finite number
  // near 0 and accepted; an overflow is not.
  const std::string& t = *v;
  const bool starts_ok = !t.empty() && (t[0] == '-' || t[0] == '.' || (t[0] >= '0' && t[0] <= '9'));
  const bool hex = t.find_first_of("xX") != std::string::npos;
  errno = 0;
  char* end = nullptr;
  const double d = starts_ok && !hex ? std::strtod(t.c_str(), &end) : 0.0;
  if (!starts_ok || hex || end != t.c_str() + t.size() || !std::isfinite(d) ||
      (errno == ERANGE && std::fabs(d) > 1.0)) {
    return invalid_argument(name + ": expected a finite number, got " + json::quote_name(t, 40));
  }
  return d;
}

Result<std::pair<int64_t, int64_t>> ParsedArgs::get_range(const std::string& name,
                                                          std::pair<int64_t, int64_t> fallback, int64_t lo,
                                                          int64_t hi) const {
  auto v = get(name);
  if (!v) return fallback;
  const size_t colon = v->find(':');
  DSACP_ASSIGN_OR_RETURN(int64_t a, parse_int(name, v->substr(0, colon), lo, hi));
  int64_t b = a;
  if (colon != std::string::npos) {
    DSACP_ASSIGN_OR_RETURN(b, parse_int(name, v->substr(colon + 1), lo, hi));
  }
  if (a > b) return invalid_argument(name + ": range \"" + *v + "\" has its lower end above its upper end");
  return std::make_pair(a, b);
}

Result<std::string> ParsedArgs::get_choice(const std::string& name, const std::string& fallback,
                                           const std::vector<std::string>& choices) const {
  std::string v = get_or(name, fallback);
  std::string list;
  for (const auto& c : choices) {
    if (c == v) return v;
    list += (list.empty() ? "" : ", ") + c;
  }
  return invalid_argument(name + ": expected one of " + list + ", got " + json::quote_name(v, 40));
}

Result<ParsedArgs> parse_args(const CommandSpec& spec, const std::vector<std::string>& args) {
  ParsedArgs out;
  const std::string where = "dsacp " + spec.name;  // for "see dsacp run --help" (report_error names the command)
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a == "--help" || a == "-h") {
      out.help_ = true;
      return out;
    }
    if (a.rfind("--", 0) == 0) {
      std::string value;
      bool inline_value = false;
      if (size_t eq = a.find('='); eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
        inline_value = true;
      }
      const OptionSpec* opt = nullptr;
      for (const OptionSpec& o : spec.options) opt = o.name == a ? &o : opt;
      if (opt == nullptr) return invalid_argument("unknown option " + json::quote_name(a, 40) + " (see " + where + " --help)");
      if (out.values_.count(a)) return invalid_argument(a + " given twice");
      if (opt->value.empty()) {
        if (inline_value) return invalid_argument(a + " takes no value");
        out.values_[a] = "1";
        continue;
      }
      if (!inline_value) {
        if (i + 1 >= args.size()) return invalid_argument(a + " needs a value " + opt->value);
        value = args[++i];
      }
      out.values_[a] = value;
      continue;
    }
    out.positionals_.push_back(a);
  }
  if (out.positionals_.size() != spec.positionals.size()) {
    std::string names;
    for (const auto& p : spec.positionals) names += (names.empty() ? "" : " ") + p;
    return invalid_argument("expected " + std::to_string(spec.positionals.size()) + " argument(s) " +
                            (names.empty() ? "" : "(" + names + ") ") + "but got " +
                            std::to_string(out.positionals_.size()) + " (see " + where + " --help)");
  }
  return out;
}

}  // namespace dsacp::cli
