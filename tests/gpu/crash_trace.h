// A fatal signal in a GPU test binary (SIGABRT from glibc's heap checks, SIGSEGV) prints the failing thread's
// stack to stderr before the process dies, as "binary(+0xOFFSET)" frames that `addr2line -f -C -e binary OFFSET`
// resolves (scripts/gpu-cp-check does). The GPU runs are few and short; a crash must leave its stack behind.
#pragma once

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>

namespace dsacp::testing {

inline void crash_trace_handler(int sig) {
  const char* what = sig == SIGABRT ? "\n*** SIGABRT: stack of the aborting thread:\n" : "\n*** fatal signal: stack:\n";
  (void)!write(STDERR_FILENO, what, std::strlen(what));
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

inline void install_crash_trace() {
  void* warm[1];
  (void)backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS}) signal(sig, crash_trace_handler);
}

}  // namespace dsacp::testing
