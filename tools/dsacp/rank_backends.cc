// The backends the CP ranks of a command run on (--device, --gpus).
#include <algorithm>
#include <string>

#include "commands.h"

namespace dsacp::cli {

OptionSpec gpus_option() {
  return {"--gpus", "N",
          "with --device cuda: GPUs for the P*D ranks: P*D = one rank per GPU (NCCL between them), or 1 = every "
          "rank on GPU 0 (device copies between threads; for testing layouts wider than the machine)",
          "P*D when the machine has that many GPUs, else 1 for P*D = 1"};
}

Result<RankBackends> make_rank_backends(const std::string& device, int64_t gpus, const CpLayout& layout,
                                        int threads, const CudaBackendOptions& cuda_options) {
  RankBackends rb;
  const int32_t Pt = std::max(layout.num_ranks(), 1);
  if (device == "cpu") {
    if (gpus != 0) return invalid_argument("--gpus applies to --device cuda only");
    rb.owned.push_back(make_cpu_backend(threads));
    rb.ranks.assign(static_cast<size_t>(Pt), rb.owned[0].get());
    rb.description = "cpu";
    return rb;
  }
  auto devices = cuda_device_count();
  if (!devices.ok()) return devices.status().with_context("--device cuda");
  const int count = *devices;
  if (count < 1) return unsupported("--device cuda: no CUDA device found");
  if (gpus == 0) {
    if (Pt == 1 || Pt <= count) {
      gpus = Pt;
    } else {
      return invalid_argument("--device cuda: P=" + std::to_string(layout.P) + " x D=" + std::to_string(layout.D) +
                              " = " + std::to_string(Pt) + " ranks need " + std::to_string(Pt) +
                              " GPUs (one rank per GPU), this machine has " + std::to_string(count) +
                              "; --gpus 1 runs every rank on GPU 0");
    }
  }
  if (gpus != 1 && gpus != Pt) {
    return invalid_argument("--gpus must be " + std::to_string(Pt) + " (one rank per GPU) or 1 (every rank on GPU 0), got " +
                            std::to_string(gpus));
  }
  if (gpus > count) {
    return invalid_argument("--gpus " + std::to_string(gpus) + ": this machine has " + std::to_string(count) +
                            " CUDA devices");
  }
  for (int64_t g = 0; g < gpus; ++g) {
    auto b = make_cuda_backend(static_cast<int>(g), cuda_options);
    if (!b.ok()) return b.status().with_context("--device cuda, GPU " + std::to_string(g));
    rb.owned.push_back(std::move(b).value());
  }
  for (int32_t cr = 0; cr < Pt; ++cr) rb.ranks.push_back(rb.owned[gpus == 1 ? 0 : cr].get());
  rb.description = gpus == 1 ? "cuda (GPU 0" + std::string(Pt > 1 ? ", every rank" : "") + ")"
                             : "cuda (" + std::to_string(gpus) + " GPUs, NCCL)";
  return rb;
}

}  // namespace dsacp::cli
