// CudaBackendOptions::timeline: a diagnostic timeline of the last step (deferred-error scope) on each GPU: for every
// backend call and NCCL collective, when the host issued it and when the GPU ran it (CUDA events), on one
// clock per device starting at the step's first call. Printed to stderr when the backend goes. Off (the
// default, until a backend enables it), every function here returns at once.
#pragma once

#include <cuda_runtime_api.h>

namespace dsacp::cuda::timeline {

bool enabled();
// Turns the timeline on for the process (a backend created with CudaBackendOptions::timeline).
void enable();

// A span being recorded: events around work enqueued on a stream, plus the host time it was issued.
struct Span {
  cudaEvent_t start = nullptr;
  double host_us = 0;
  bool active() const { return start != nullptr; }
};

// A new step on `device`: clears its entries, records the reference event on `stream`.
void begin_step(int device, cudaStream_t stream);
// Before enqueueing work on `stream` (inactive when off or outside a step).
Span open(int device, cudaStream_t stream);
// After enqueueing: records the end event and keeps the entry (`name` and `lane` must be string literals or
// outlive the step).
void close(int device, const Span& span, cudaStream_t stream, const char* name, const char* lane);
// A host-only span (a wait, an allocation), [begin, now).
double host_now_us(int device);
void host_span(int device, double begin_us, const char* name, const char* lane);
// After the step's work finished: computes the GPU times and keeps the text as the device's last step.
void end_step(int device);
// Prints the device's last step to stderr.
void print_last(int device);

}  // namespace dsacp::cuda::timeline
