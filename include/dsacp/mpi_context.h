// MPI for CP ranks that are separate processes (CPU backend, host memory). Host-only header: no mpi.h here,
// so code that includes it builds with or without MPI; without MPI (DSACP_ENABLE_MPI=OFF) MpiContext::init
// answers `unsupported: built without MPI`.
//
// The MPI Communicator moves host bytes with nonblocking MPI collectives (MPI_Iallgather, MPI_Ialltoall,
// MPI_Ibcast, MPI_Ibarrier on MPI_BYTE). wait() polls MPI_Test with a short sleep until the operation is
// done or the communicator's timeout passes: then it fails with kTimeout naming the operation and the
// communicator marks itself failed (every later collective on it fails at once). abort(reason) prints the
// reason and calls MPI_Abort: every process of the job then exits with an error instead of hanging — the
// one place where dsacp library code ends the process, since a rank of a multi-process job has no other
// way to release its peers.
//
// Lifetimes: a communicator's handles must be waited on or destroyed before the communicator. MPI is finalized
// when the context and every communicator made from it are gone.
#pragma once

#include <chrono>
#include <memory>

#include "dsacp/communicator.h"
#include "dsacp/status.h"

namespace dsacp {

// True when dsacp was built with MPI.
bool mpi_available();

// The process's MPI environment: initializes MPI (MPI_THREAD_FUNNELED: only the thread that created the
// context calls MPI) and finalizes it in the destructor. At most one per process, for the process's life
// (MPI cannot be initialized twice).
class MpiContext {
 public:
  // `timeout` bounds every wait of the communicators this context makes.
  static Result<std::unique_ptr<MpiContext>> init(std::chrono::milliseconds timeout = std::chrono::seconds(600));
  virtual ~MpiContext() = default;
  virtual int rank() const = 0;  // in MPI_COMM_WORLD
  virtual int size() const = 0;
  // A communicator over every process (a duplicate of MPI_COMM_WORLD). Collective over every process.
  // `timeout` bounds its waits (0: the context's timeout).
  virtual Result<std::unique_ptr<Communicator>> world(std::chrono::milliseconds timeout = {}) = 0;
  // Collective over every process: the processes with the same `color` (>= 0) form a group, ranked by `key`
  // (then by world rank) — MPI_Comm_split.
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key, std::chrono::milliseconds timeout = {}) = 0;
  // Collective over every process, bounded by the context's timeout, and the first one to call after init()
  // (before any communicator is made, whose creation would wait for a peer without bound): every process says
  // whether it is fit to go on (its input loaded); the answer is the lowest world rank that said no, or size()
  // when every process said yes. A process that never joins (it failed before init, or hangs) makes the wait
  // time out: then the reason is printed and the job ended with MPI_Abort, the only way to release the peers.
  virtual Result<int> first_failed(bool ok) = 0;
};

}  // namespace dsacp
