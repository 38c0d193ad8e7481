// The Communicator over an MPI communicator, for CP ranks that are processes (host memory). See
// dsacp/mpi_context.h. Built only with DSACP_HAVE_MPI; otherwise every entry point answers `unsupported`.
#include "dsacp/mpi_context.h"

#ifdef DSACP_HAVE_MPI

// The C API only (OpenMPI would otherwise pull in its deprecated C++ bindings, which need libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdio>
#include <string>
#include <thread>

namespace dsacp {
namespace {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

// Every MPI call goes through this: the error names the call and carries MPI's own message.
Status mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return Status();
  return Status(StatusCode::kBackendError, std::string(call) + " failed: " + mpi_error_string(code));
}

// Finalizes MPI when the context and every communicator made from it are gone.
struct MpiSession {
  ~MpiSession() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

class MpiCommunicator;

class MpiHandle final : public CollectiveHandle {
 public:
  MpiHandle(MpiCommunicator* comm, MPI_Request request, const char* op) : comm_(comm), request_(request), op_(op) {}
  ~MpiHandle() override {
    if (!waited_) (void)wait();
  }
  Status wait() override;

 private:
  MpiCommunicator* comm_;
  MPI_Request request_;
  const char* op_;
  bool waited_ = false;
  Status result_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<MpiSession> session, MPI_Comm comm, int rank, int size,
                  std::chrono::milliseconds timeout)
      : session_(std::move(session)), comm_(comm), rank_(rank), size_(size), timeout_(timeout) {}
  ~MpiCommunicator() override {
    // A communicator with an operation that timed out still has it in flight: leave it to MPI_Finalize.
    if (!failed_) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::unique_ptr<CollectiveHandle>> all_gather_async(const void* send, void* recv, size_t bytes) override {
    DSACP_ASSIGN_OR_RETURN(int count, checked_count("all_gather", bytes));
    MPI_Request req;
    DSACP_RETURN_IF_ERROR(
        fail_on_error(MPI_Iallgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_, &req), "MPI_Iallgather"));
    return std::unique_ptr<CollectiveHandle>(new MpiHandle(this, req, "all_gather"));
  }
  Result<std::unique_ptr<CollectiveHandle>> all_to_all_async(const void* send, void* recv, size_t bytes) override {
    DSACP_ASSIGN_OR_RETURN(int count, checked_count("all_to_all", bytes));
    MPI_Request req;
    DSACP_RETURN_IF_ERROR(
        fail_on_error(MPI_Ialltoall(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_, &req), "MPI_Ialltoall"));
    return std::unique_ptr<CollectiveHandle>(new MpiHandle(this, req, "all_to_all"));
  }
  Result<std::unique_ptr<CollectiveHandle>> broadcast_async(void* buf, size_t bytes, int root) override {
    if (root < 0 || root >= size_) {
      return invalid_argument("broadcast root " + std::to_string(root) + " outside [0, " + std::to_string(size_) + ")");
    }
    DSACP_ASSIGN_OR_RETURN(int count, checked_count("broadcast", bytes));
    MPI_Request req;
    DSACP_RETURN_IF_ERROR(fail_on_error(MPI_Ibcast(buf, count, MPI_BYTE, root, comm_, &req), "MPI_Ibcast"));
    return std::unique_ptr<CollectiveHandle>(new MpiHandle(this, req, "broadcast"));
  }
  Status barrier() override {
    if (failed_) return failure_status();
    MPI_Request req;
    DSACP_RETURN_IF_ERROR(fail_on_error(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier"));
    MpiHandle h(this, req, "barrier");
    return h.wait();
  }
  void abort(const std::string& reason) override {
    std::fprintf(stderr, "dsacp: MPI rank %d aborts the job: %s\n", rank_, reason.c_str());
    std::fflush(stderr);
    MPI_Abort(comm_, 1);
  }

  // Polls `request` until it completes or the timeout passes.
  Status wait_request(MPI_Request& request, const char* op) {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      if (Status s = fail_on_error(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test"); !s.ok()) {
        return s.with_context(op);
      }
      if (done) return Status();
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited >= timeout_) {
        Status s(StatusCode::kTimeout, "MPI rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": " +
                                           op + " timed out after " + std::to_string(timeout_.count()) +
                                           " ms (a peer never joined it)");
        fail(s.message());
        return s;
      }
      // Spin briefly (fast collectives), then yield the core: ranks often share cores.
      if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(polls > 1024 ? 500 : 50));
    }
  }

 private:
  Result<int> checked_count(const char* op, size_t bytes) {
    if (failed_) return failure_status();
    if (bytes > static_cast<size_t>(INT_MAX)) {
      return unsupported(std::string("MPI ") + op + " of " + std::to_string(bytes) +
                         " bytes per rank: more than INT_MAX bytes per call is not supported");
    }
    return static_cast<int>(bytes);
  }
  Status fail_on_error(int code, const char* call) {
    Status s = mpi_check(code, call);
    if (!s.ok()) {
      s = s.with_context("MPI rank " + std::to_string(rank_));
      fail(s.message());
    }
    return s;
  }
  void fail(const std::string& reason) {
    if (!failed_) {
      failed_ = true;
      failure_ = reason;
    }
  }
  Status failure_status() const { return Status(StatusCode::kBackendError, "communicator failed: " + failure_); }

  std::shared_ptr<MpiSession> session_;
  MPI_Comm comm_;
  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  bool failed_ = false;
  std::string failure_;
};

Status MpiHandle::wait() {
  if (!waited_) {
    waited_ = true;
    result_ = comm_->wait_request(request_, op_);
  }
  return result_;
}

class MpiContextImpl final : public MpiContext {
 public:
  MpiContextImpl(std::shared_ptr<MpiSession> session, int rank, int size, std::chrono::milliseconds timeout)
      : session_(std::move(session)), rank_(rank), size_(size), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::unique_ptr<Communicator>> world(std::chrono::milliseconds timeout) override {
    if (timeout.count() < 0) return invalid_argument("MPI timeout must be >= 0 ms");
    MPI_Comm comm;
    DSACP_RETURN_IF_ERROR(mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup"));
    return wrap(comm, timeout);
  }
  Result<std::unique_ptr<Communicator>> split(int color, int key, std::chrono::milliseconds timeout) override {
    if (color < 0) return invalid_argument("MPI split color must be >= 0, got " + std::to_string(color));
    if (timeout.count() < 0) return invalid_argument("MPI timeout must be >= 0 ms");
    MPI_Comm comm;
    DSACP_RETURN_IF_ERROR(mpi_check(MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm), "MPI_Comm_split"));
    return wrap(comm, timeout);
  }
  Result<int> first_failed(bool ok) override {
    int mine = ok ? size_ : rank_, lowest = size_;
    MPI_Request req;
    DSACP_RETURN_IF_ERROR(
        mpi_check(MPI_Iallreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &req), "MPI_Iallreduce"));
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      DSACP_RETURN_IF_ERROR(mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test"));
      if (done) return lowest;
      if (std::chrono::steady_clock::now() - start >= timeout_) {
        std::fprintf(stderr,
                     "dsacp: MPI rank %d aborts the job: not every process joined the start-up check within %lld ms "
                     "(a process failed before it or hangs)\n",
                     rank_, static_cast<long long>(timeout_.count()));
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        return Status(StatusCode::kTimeout, "MPI start-up check timed out");  // not reached
      }
      if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(polls > 1024 ? 500 : 50));
    }
  }

 private:
  Result<std::unique_ptr<Communicator>> wrap(MPI_Comm comm, std::chrono::milliseconds timeout) {
    int rank = 0, size = 0;
    Status s = mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    if (s.ok()) s = mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    if (!s.ok()) {
      MPI_Comm_free(&comm);
      return s;
    }
    return std::unique_ptr<Communicator>(
        new MpiCommunicator(session_, comm, rank, size, timeout.count() > 0 ? timeout : timeout_));
  }
  std::shared_ptr<MpiSession> session_;
  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace

bool mpi_available() { return true; }

Result<std::unique_ptr<MpiContext>> MpiContext::init(std::chrono::milliseconds timeout) {
  if (timeout.count() < 1) return invalid_argument("MPI timeout must be >= 1 ms");
  int initialized = 0;
  DSACP_RETURN_IF_ERROR(mpi_check(MPI_Initialized(&initialized), "MPI_Initialized"));
  if (initialized) return invalid_argument("MPI is already initialized in this process (one MpiContext per process)");
  int provided = 0;
  DSACP_RETURN_IF_ERROR(
      mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread"));
  auto session = std::make_shared<MpiSession>();
  if (provided < MPI_THREAD_FUNNELED) {
    return unsupported("MPI_Init_thread: the MPI library provides no MPI_THREAD_FUNNELED support");
  }
  // Errors come back as codes (checked at every call) instead of MPI's default of ending the job.
  DSACP_RETURN_IF_ERROR(
      mpi_check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler"));
  int rank = 0, size = 0;
  DSACP_RETURN_IF_ERROR(mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank"));
  DSACP_RETURN_IF_ERROR(mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size"));
  return std::unique_ptr<MpiContext>(new MpiContextImpl(std::move(session), rank, size, timeout));
}

}  // namespace dsacp

#else  // !DSACP_HAVE_MPI

namespace dsacp {

bool mpi_available() { return false; }

Result<std::unique_ptr<MpiContext>> MpiContext::init(std::chrono::milliseconds) {
  return unsupported("built without MPI (configure with DSACP_ENABLE_MPI=ON and an MPI library installed)");
}

}  // namespace dsacp

#endif  // DSACP_HAVE_MPI
