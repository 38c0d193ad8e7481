#include "dsacp/step_timing.h"

#include "layer/step_timing_internal.h"

namespace dsacp {

namespace {
thread_local StepPhaseTimes* g_times = nullptr;
thread_local StepLaunchTimes* g_launch = nullptr;
}  // namespace

StepPhaseRecorder::StepPhaseRecorder(StepPhaseTimes* times) : previous_(g_times) { g_times = times; }
StepPhaseRecorder::~StepPhaseRecorder() { g_times = previous_; }

StepPhaseTimes* current_step_phase_times() { return g_times; }

StepLaunchRecorder::StepLaunchRecorder(StepLaunchTimes* times) : previous_(g_launch) { g_launch = times; }
StepLaunchRecorder::~StepLaunchRecorder() { g_launch = previous_; }

StepLaunchTimes* current_step_launch_times() { return g_launch; }

}  // namespace dsacp
