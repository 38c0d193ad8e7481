// dsacp replay CASE --out RESULT: one batch step from a case file (contract §4).
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "commands.h"
#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/mpi_context.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/replay.h"

namespace dsacp::cli {
namespace {

CommandSpec replay_spec() {
  CommandSpec s;
  s.name = "replay";
  s.usage = "dsacp replay CASE --out RESULT [options]";
  s.summary =
      "Loads the case's context into paged caches (pages in a shuffled order, NaN in every unused slot),\n"
      "runs the step (cache write, indexer + exact top-k, sparse MLA attention) in the given layout and writes\n"
      "the result file (the same whatever the layout):\n"
      "topk_indices I32 [T, K], out [T, H, Dl], lse F32 [T, H], rows in the case's token order.";
  s.positionals = {"CASE"};
  s.options = {
      {"--out", "RESULT", "result file to write (safetensors)", ""},
      {"--page-size", "N", "KV cache page size in tokens", "64"},
      {"--threads", "N", "CPU threads (0 = all cores)", "0"},
      {"--out-dtype", "f32|bf16", "dtype of out in the result file", "f32"},
      {"--page-seed", "N", "seed of the shuffled page order (0 = pages in order)", "24301"},
      {"--device", "cpu|cuda", "backend (cuda: sm_90a GPUs)", "cpu"},
      gpus_option(),
      {"--launcher", "threads|mpi|env",
       "CP ranks as threads of this process; one rank per MPI process (mpirun -np P*D; CPU ranks talk through "
       "MPI, GPU ranks through NCCL on GPU LOCAL_RANK); or one rank per process started by another launcher "
       "(torchrun style: RANK, WORLD_SIZE, LOCAL_RANK in the environment; --device cuda, NCCL)",
       "threads"},
      {"--nccl-id-file", "PATH", "--launcher env: rank 0 writes the NCCL id there, the others wait for it", ""},
      max_memory_option(),
      {"--index-dtype", "float|fp8",
       "fp8: an F8_E4M3 indexer-key cache; a case with f32/bf16 indexer tensors is quantized on load (as "
       "make-case --index-dtype fp8 does). A case in F8_E4M3 replays in FP8 either way",
       "float"},
      {"--index-scale-mode", "fp32|ue8m0", "the FP8 scale rule used when quantizing (--index-dtype fp8)", "fp32"},
      {"--kv-dtype", "float|fp8_ds_mla",
       "fp8_ds_mla: the latent cache as 656-byte records; a case with an f32/bf16 ctx_kv_latent is quantized on "
       "load (as make-case --kv-dtype fp8_ds_mla does). A case with an F8_E4M3 ctx_kv_latent replays so either way",
       "float"},
      {"--kv-scale-mode", "fp32|ue8m0", "the tile scale rule of the latent's quantization (--kv-dtype fp8_ds_mla)",
       "fp32"},
      {"--topk-form", "canonical|slot",
       "topk_indices as canonical positions, or as KV cache slots (FlashMLA's page * page_size + offset, -1 "
       "padded; under CP the slot on the rank that stores the key); the result file records the form",
       "canonical"},
      {"--lse-base", "e|2", "lse as the natural log, or base 2 (FlashInfer's); the result file records it", "e"},
      {"--topk-from", "RESULT",
       "a precomputed top-k: the topk_indices of a canonical result of this case; the step runs no indexer", ""},
  };
  for (const OptionSpec& o : layout_options(1, 1)) s.options.push_back(o);
  for (const OptionSpec& o : cuda_diagnostic_options()) s.options.push_back(o);
  return s;
}

// The first non-finite value of a tensor (its flat index), or -1.
int64_t first_non_finite(const Tensor& t) {
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16) return -1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.get_f32(i))) return i;
  }
  return -1;
}

// One warning line on stderr when the case's inputs hold NaN or Inf (they are allowed: contract §7), else when
// the result does (finite inputs whose scores or sums overflow fp32, e.g. a huge scale). Never more than one.
void warn_non_finite(const CaseFile& c, const StepResult& r) {
  const std::pair<const char*, const Tensor*> inputs[] = {
      {"q_nope", &c.q_nope},   {"q_rope", &c.q_rope}, {"kv_latent", &c.kv_latent}, {"k_rope", &c.k_rope},
      {"idx_q", &c.idx_q},     {"idx_w", &c.idx_w},   {"idx_k", &c.idx_k},         {"ctx_kv_latent", &c.ctx_kv_latent},
      {"ctx_k_rope", &c.ctx_k_rope}, {"ctx_idx_k", &c.ctx_idx_k}};
  for (const auto& [name, t] : inputs) {
    const int64_t i = first_non_finite(*t);
    if (i < 0) continue;
    std::fprintf(stderr,
                 "dsacp replay: warning: the case's inputs hold non-finite values (first: %s, element %lld = %g); "
                 "NaN index scores rank last in the top-k, other NaN/Inf reach the outputs they touch (contract §7)\n",
                 name, static_cast<long long>(i), static_cast<double>(t->get_f32(i)));
    return;
  }
  for (const auto& [name, t] : {std::pair{"out", &r.out}, std::pair{"lse", &r.lse}}) {
    const int64_t i = first_non_finite(*t);
    if (i < 0) continue;
    std::fprintf(stderr,
                 "dsacp replay: warning: the result's %s holds non-finite values (element %lld = %g) from finite "
                 "inputs: scores or sums overflow fp32 (scale %g)\n",
                 name, static_cast<long long>(i), static_cast<double>(t->get_f32(i)), static_cast<double>(c.scale));
    return;
  }
}

// The part of a process-per-rank replay after its communicators exist: the rank's step, the result gathered
// to rank 0, which writes it. An error of this rank aborts the communicators, so no peer waits for it (MPI:
// the job ends; NCCL in other processes: their waits time out).
int replay_as_rank(const std::string& case_path, const std::string& out_path, const ReplayOptions& options,
                   const CaseFile& c, Backend& backend, const CpComms& comms, const std::string& how) {
  const int32_t cr = comms.world->rank();
  auto abort_with = [&](const Status& s) {
    const int code = report_error("replay", s);
    comms.world->abort("rank " + std::to_string(cr) + ": " + s.to_string());
    return code;
  };
  auto result = replay_case_rank(backend, c, options, comms);
  if (!result.ok()) return abort_with(result.status().with_context(case_path + ", CP rank " + std::to_string(cr)));
  if (cr == 0) {
    warn_non_finite(c, *result);
    if (Status s = result_write(out_path, *result); !s.ok()) return abort_with(s);
    std::fprintf(stderr, "dsacp replay: %lld tokens, %zu requests, K=%d, P=%d x D=%d (%s, %d processes) -> %s\n",
                 static_cast<long long>(c.num_tokens()), c.requests.size(), c.topk, options.layout.P,
                 options.layout.D, how.c_str(), comms.world->size(), out_path.c_str());
  }
  // Every process leaves together: no rank tears down its communicators while rank 0 is still writing.
  if (Status s = comms.world->barrier(); !s.ok()) return abort_with(s);
  return 0;
}

// NCCL communicators of CP rank `rank` on `backend`'s GPU, bounded by --comm-timeout.
Result<OwnedCpComms> nccl_rank_comms(const NcclId& id, const CpLayout& layout, int rank, const Backend& backend) {
  NcclOptions o;
  o.device = backend.cuda_device();
  o.producer_stream = backend.native_stream();
  o.timeout = std::chrono::milliseconds(layout.comm_timeout_ms);
  o.window_bytes = layout.nccl_window_bytes;
  o.peer_exchange_bytes = layout.nccl_peer_exchange_bytes;
  return nccl_cp_comms(id, layout, rank, o);
}

// --launcher mpi: this process is CP rank cr = MPI world rank (r = cr / D, d = cr % D). Errors every process
// meets alike (the world size, the case file) are reported by rank 0 and every process returns. CPU ranks talk
// through MPI; GPU ranks through NCCL on GPU LOCAL_RANK (OMPI_COMM_WORLD_LOCAL_RANK), the NCCL id broadcast
// over MPI.
int replay_mpi(const std::string& case_path, const std::string& out_path, const ReplayOptions& options,
               const CudaBackendOptions& cuda_options, int threads,
               bool cuda) {
  auto fail = [](const Status& s) { return report_error("replay", s); };
  const CpLayout& layout = options.layout;
  auto mpi = MpiContext::init(std::chrono::milliseconds(layout.comm_timeout_ms));
  if (!mpi.ok()) return fail(mpi.status());
  MpiContext& ctx = **mpi;
  const bool leader = ctx.rank() == 0;
  if (ctx.size() != layout.num_ranks()) {
    const Status s = invalid_argument(
        "--launcher mpi: the MPI world has " + std::to_string(ctx.size()) +
        " processes, the layout P=" + std::to_string(layout.P) + " x D=" + std::to_string(layout.D) + " needs " +
        std::to_string(layout.num_ranks()) + " (mpirun -np " + std::to_string(layout.num_ranks()) + ")");
    return leader ? fail(s) : report_error_code(s);
  }
  const int32_t cr = ctx.rank();
  // Every process loads its case, then all agree (bounded by --comm-timeout) before any communicator exists:
  // a process whose input is bad ends the job instead of leaving its peers in the communicator setup.
  auto c = case_read(case_path);
  auto first_failed = ctx.first_failed(c.ok());
  if (!first_failed.ok()) return fail(first_failed.status());
  if (*first_failed < ctx.size()) {
    if (cr == *first_failed) return fail(c.status().with_context("MPI rank " + std::to_string(cr)));
    const Status s = invalid_argument("MPI rank " + std::to_string(*first_failed) +
                                      " could not load its case (its error is above); no rank ran the step");
    if (leader) return fail(s);
    return c.ok() ? report_error_code(s) : report_error_code(c.status());
  }
  auto world = ctx.world();
  if (!world.ok()) return fail(world.status());
  if (cuda) {
    // Rank 0 makes the NCCL id; MPI carries it to the others.
    NcclId id;
    Status made;
    if (leader) {
      auto made_id = nccl_make_id();
      if (made_id.ok()) id = *made_id;
      made = made_id.status();
    }
    if (!made.ok()) {
      (*world)->abort("rank 0: " + made.to_string());
      return fail(made);
    }
    if (Status s = (*world)->broadcast(id.bytes.data(), id.bytes.size(), 0); !s.ok()) return fail(s);
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    const int device = local != nullptr ? std::atoi(local) : cr;
    auto backend = make_cuda_backend(device, cuda_options);
    if (!backend.ok()) {
      (*world)->abort("rank " + std::to_string(cr) + ": " + backend.status().to_string());
      return fail(backend.status().with_context("CP rank " + std::to_string(cr)));
    }
    auto nccl = nccl_rank_comms(id, layout, cr, **backend);
    if (!nccl.ok()) {
      const int code = fail(nccl.status().with_context("CP rank " + std::to_string(cr)));
      (*world)->abort("rank " + std::to_string(cr) + ": " + nccl.status().to_string());
      return code;
    }
    return replay_as_rank(case_path, out_path, options, *c, **backend, nccl->view(), "MPI + NCCL");
  }
  auto pcp = ctx.split(cr % layout.D, cr / layout.D);  // same d, ranked by r
  if (!pcp.ok()) return fail(pcp.status());
  auto dcp = ctx.split(cr / layout.D, cr % layout.D);  // same r, ranked by d
  if (!dcp.ok()) return fail(dcp.status());
  std::unique_ptr<Backend> backend = make_cpu_backend(threads);
  return replay_as_rank(case_path, out_path, options, *c, *backend, CpComms{world->get(), pcp->get(), dcp->get()},
                        "MPI");
}

Result<int64_t> env_int(const char* name, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (v == nullptr) return invalid_argument(std::string("--launcher env: ") + name + " is not set");
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (*v == '\0' || *end != '\0' || x < lo || x > hi) {
    return invalid_argument(std::string("--launcher env: ") + name + "=\"" + v + "\", expected an integer in [" +
                            std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return x;
}

// --launcher env: one GPU rank per process, started by another launcher (RANK, WORLD_SIZE, LOCAL_RANK); NCCL
// id through --nccl-id-file. Every process reports its own errors (prefixed with its rank).
int replay_env(const std::string& case_path, const std::string& out_path, const ReplayOptions& options,
               const CudaBackendOptions& cuda_options, const std::string& id_path) {
  const CpLayout& layout = options.layout;
  auto rank = env_int("RANK", 0, 1 << 20);
  auto size = env_int("WORLD_SIZE", 1, 1 << 20);
  auto local = env_int("LOCAL_RANK", 0, 1 << 20);
  for (const Status& s : {rank.status(), size.status(), local.status()}) {
    if (!s.ok()) return report_error("replay", s);
  }
  const std::string who = "rank " + std::to_string(*rank);
  auto fail = [&](const Status& s) { return report_error("replay", s.with_context(who)); };
  if (*size != layout.num_ranks()) {
    return fail(invalid_argument("WORLD_SIZE=" + std::to_string(*size) + ", the layout P=" + std::to_string(layout.P) +
                                 " x D=" + std::to_string(layout.D) + " needs " + std::to_string(layout.num_ranks()) +
                                 " processes"));
  }
  if (*rank >= *size) return fail(invalid_argument("RANK must be < WORLD_SIZE"));
  if (id_path.empty()) return fail(invalid_argument("--launcher env needs --nccl-id-file PATH (shared by every rank)"));
  auto c = case_read(case_path);
  if (!c.ok()) return fail(c.status());
  auto backend = make_cuda_backend(static_cast<int>(*local), cuda_options);
  if (!backend.ok()) return fail(backend.status().with_context("LOCAL_RANK " + std::to_string(*local)));
  NcclId id;
  if (*rank == 0) {
    auto made = nccl_make_id();
    if (!made.ok()) return fail(made.status());
    id = *made;
    if (Status s = nccl_id_write(id_path, id); !s.ok()) return fail(s);
  } else {
    auto read = nccl_id_read(id_path, std::chrono::milliseconds(layout.comm_timeout_ms));
    if (!read.ok()) return fail(read.status());
    id = *read;
  }
  auto nccl = nccl_rank_comms(id, layout, static_cast<int>(*rank), **backend);
  if (!nccl.ok()) return fail(nccl.status());
  return replay_as_rank(case_path, out_path, options, *c, **backend, nccl->view(), "NCCL");
}

}  // namespace

int cmd_replay(const std::vector<std::string>& argv) {
  const CommandSpec spec = replay_spec();
  auto parsed = parse_args(spec, argv);
  if (!parsed.ok()) return report_error("replay", parsed.status());
  const ParsedArgs& args = *parsed;
  if (args.help()) {
    std::fputs(command_help(spec).c_str(), stdout);
    return 0;
  }
  auto fail = [](const Status& s) { return report_error("replay", s); };
  if (!args.has("--out")) return fail(invalid_argument("--out RESULT is required"));
  auto device = args.get_choice("--device", "cpu", {"cpu", "cuda"});
  if (!device.ok()) return fail(device.status());
  auto page_size = args.get_int("--page-size", 64, 1, 1 << 20);
  auto threads = args.get_int("--threads", 0, 0, 1024);
  auto page_seed = args.get_int("--page-seed", 24301, 0, INT64_MAX);
  auto out_dtype = args.get_choice("--out-dtype", "f32", {"f32", "bf16"});
  for (const Status& s : {page_size.status(), threads.status(), page_seed.status(), out_dtype.status()}) {
    if (!s.ok()) return fail(s);
  }

  auto launcher = args.get_choice("--launcher", "threads", {"threads", "mpi", "env"});
  auto gpus = args.get_int("--gpus", 0, 1, 1024);
  if (!gpus.ok()) return fail(gpus.status());
  if (!launcher.ok()) return fail(launcher.status());
  auto layout = read_layout(args, 1, 1);
  if (!layout.ok()) return fail(layout.status());
  ReplayOptions options;
  options.page_size = static_cast<int32_t>(*page_size);
  options.out_dtype = *out_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  options.page_shuffle_seed = static_cast<uint64_t>(*page_seed);
  options.layout = *layout;
  auto index_dtype = args.get_choice("--index-dtype", "float", {"float", "fp8"});
  if (!index_dtype.ok()) return fail(index_dtype.status());
  auto scale_mode = args.get_choice("--index-scale-mode", "fp32", {"fp32", "ue8m0"});
  if (!scale_mode.ok()) return fail(scale_mode.status());
  options.index_fp8 = *index_dtype == "fp8";
  options.index_scale_mode = *scale_mode == "ue8m0" ? Fp8ScaleMode::kUe8m0 : Fp8ScaleMode::kFp32;
  auto kv_dtype = args.get_choice("--kv-dtype", "float", {"float", "fp8_ds_mla"});
  if (!kv_dtype.ok()) return fail(kv_dtype.status());
  auto kv_scale_mode = args.get_choice("--kv-scale-mode", "fp32", {"fp32", "ue8m0"});
  if (!kv_scale_mode.ok()) return fail(kv_scale_mode.status());
  options.latent_fp8 = *kv_dtype == "fp8_ds_mla";
  options.latent_scale_mode = *kv_scale_mode == "ue8m0" ? Fp8ScaleMode::kUe8m0 : Fp8ScaleMode::kFp32;
  auto topk_form = args.get_choice("--topk-form", "canonical", {"canonical", "slot"});
  if (!topk_form.ok()) return fail(topk_form.status());
  auto lse_base = args.get_choice("--lse-base", "e", {"e", "2"});
  if (!lse_base.ok()) return fail(lse_base.status());
  options.topk_form = *topk_form == "slot" ? TopkForm::kSlot : TopkForm::kCanonical;
  options.lse_base = *lse_base == "2" ? LseBase::kTwo : LseBase::kNatural;
  StepResult topk_from;  // the precomputed top-k's result file (it lives until the replay is done)
  if (args.has("--topk-from")) {
    const std::string path = *args.get("--topk-from");
    auto r = result_read(path);
    if (!r.ok()) return fail(r.status());
    if (r->topk_form != TopkForm::kCanonical) {
      return fail(invalid_argument("--topk-from " + path + ": its topk_indices are slots (topk_form \"slot\"); a "
                                   "precomputed top-k is canonical positions"));
    }
    topk_from = std::move(*r);
    options.topk = &topk_from.topk_indices;
  }
  const std::string case_path = args.positionals()[0];
  const std::string out_path = *args.get("--out");
  if (args.has("--max-memory")) {
    auto max_memory = parse_bytes("--max-memory", *args.get("--max-memory"));
    if (!max_memory.ok()) return fail(max_memory.status());
    options.max_memory_bytes = *max_memory;
  }
  // The result must never replace the case: the same file by device and inode, whatever the spelling (./CASE,
  // a symbolic or hard link). Checked before anything is read or written.
  struct stat case_st {}, out_st {};
  if (::stat(case_path.c_str(), &case_st) == 0 && ::stat(out_path.c_str(), &out_st) == 0 &&
      case_st.st_dev == out_st.st_dev && case_st.st_ino == out_st.st_ino) {
    return fail(invalid_argument("--out " + out_path + " is the case file " + case_path +
                                 " itself (the same file): writing the result there would destroy the case"));
  }
  if (*launcher != "threads" && *gpus != 0) return fail(invalid_argument("--gpus applies to --launcher threads"));
  if (*launcher != "env" && args.has("--nccl-id-file")) {
    return fail(invalid_argument("--nccl-id-file applies to --launcher env"));
  }
  const CudaBackendOptions cuda_options = read_cuda_options(args);
  if (*launcher == "mpi") {
    return replay_mpi(case_path, out_path, options, cuda_options, static_cast<int>(*threads), *device == "cuda");
  }
  if (*launcher == "env") {
    if (*device != "cuda") {
      return fail(unsupported("--launcher env runs GPU ranks (--device cuda); CPU ranks as processes: --launcher mpi"));
    }
    return replay_env(case_path, out_path, options, cuda_options, args.get("--nccl-id-file").value_or(""));
  }

  auto c = case_read(case_path);
  if (!c.ok()) return fail(c.status());
  auto backends = make_rank_backends(*device, *gpus, *layout, static_cast<int>(*threads), cuda_options);
  if (!backends.ok()) return fail(backends.status());
  auto result = replay_case(backends->ranks, *c, options);
  if (!result.ok()) return fail(result.status().with_context(case_path));
  warn_non_finite(*c, *result);
  if (Status s = result_write(out_path, *result); !s.ok()) return fail(s);
  std::fprintf(stderr, "dsacp replay: %lld tokens, %zu requests, K=%d, P=%d x D=%d on %s -> %s\n",
               static_cast<long long>(c->num_tokens()), c->requests.size(), c->topk, layout->P, layout->D,
               backends->description.c_str(), out_path.c_str());
  return 0;
}

}  // namespace dsacp::cli
