// Status and Result<T>: the library's only error channel. Library code never throws, exits or aborts
// across the public API; every failure carries a message that names what was wrong and what was expected.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace dsacp {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // the caller handed in something malformed (shape, dtype, value)
  kOutOfRange,        // an index or length outside what is allowed
  kUnsupported,       // valid input that this backend does not support
  kResourceExhausted, // out of pages, out of memory
  kIoError,           // file system
  kDataLoss,          // a file's content is corrupt or truncated
  kInternal,          // a bug in dsacp
  kTimeout,           // a bounded wait ran out
  kBackendError,      // a CUDA / NCCL / MPI call failed
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: q_nope: expected shape [T=4, H=2, Dl=8], got [4, 2, 7]"
  std::string to_string() const;
  // Prefixes the message with context: "case file x.safetensors: " + message.
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string msg) { return Status(StatusCode::kInvalidArgument, std::move(msg)); }
inline Status out_of_range(std::string msg) { return Status(StatusCode::kOutOfRange, std::move(msg)); }
inline Status unsupported(std::string msg) { return Status(StatusCode::kUnsupported, std::move(msg)); }
inline Status resource_exhausted(std::string msg) { return Status(StatusCode::kResourceExhausted, std::move(msg)); }
inline Status io_error(std::string msg) { return Status(StatusCode::kIoError, std::move(msg)); }
inline Status data_loss(std::string msg) { return Status(StatusCode::kDataLoss, std::move(msg)); }
inline Status internal_error(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }

// Result<T>: a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "Result constructed from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return std::get<T>(v_); }
  const T& operator*() const& { return std::get<T>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dsacp

#define DSACP_CONCAT_INNER(a, b) a##b
#define DSACP_CONCAT(a, b) DSACP_CONCAT_INNER(a, b)

#define DSACP_RETURN_IF_ERROR(expr)            \
  do {                                         \
    ::dsacp::Status dsacp_status_ = (expr);    \
    if (!dsacp_status_.ok()) return dsacp_status_; \
  } while (0)

#define DSACP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define DSACP_ASSIGN_OR_RETURN(lhs, expr) \
  DSACP_ASSIGN_OR_RETURN_IMPL(DSACP_CONCAT(dsacp_result_, __LINE__), lhs, expr)
