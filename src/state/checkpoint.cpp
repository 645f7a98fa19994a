// HDF5 checkpoints (see checkpoint.h and docs/formats.md).
#include "mpitrain/checkpoint.h"

#include <cmath>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <variant>

#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/log.h"
#include "mpitrain/model_fields.h"
#include "mpitrain/tensor_io.h"
#include "mpitrain/tensor_parallel.h"

namespace mpitrain {
namespace {

// ---- durable file system steps -----------------------------------------------------------------

void make_dirs(const std::string& dir) {
  std::string partial;
  std::stringstream ss(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') partial = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
      throw UsageError(concat(dir, ": cannot create directory: ", std::strerror(errno)));
  }
}

}  // namespace

void ensure_writable_dir(const std::string& dir, const std::string& key) {
  try {
    make_dirs(dir);
  } catch (const UsageError& e) {
    throw UsageError(concat(key, ": ", e.what()));
  }
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw UsageError(concat(key, ": '", dir, "' exists and is not a directory"));
  if (::access(dir.c_str(), W_OK) != 0)
    throw UsageError(concat(key, ": directory '", dir, "' is not writable"));
}

namespace {

// Complete checkpoints in dir, by step, oldest first.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    long long step = 0;
    char tail[8] = {};
    const std::string name = e->d_name;
    if (std::sscanf(name.c_str(), "ckpt-%lld.h%2s", &step, tail) == 2 && std::string(tail) == "5" &&
        name == checkpoint_name(step))
      out.emplace_back(step, dir + "/" + name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_latest(const std::string& dir) {
  std::ifstream in(dir + "/latest");
  std::string name;
  if (in) std::getline(in, name);
  return name;
}

// ---- tensors in and out ------------------------------------------------------------------------

// Host fp32 contiguous, as the model holds it (no copy) or as a copy: the snapshot's tensors.
torch::Tensor host_fp32(const torch::Tensor& t, bool copy) {
  torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false, copy);
  return c.contiguous();
}

// A dataset that exists but may be something else (a group, after tampering): usage error.
// (found by fuzz_checkpoint: fuzz/regressions/fuzz_checkpoint/)
h5::Dataset open_dataset(hid_t loc, const std::string& file, const std::string& name) {
  const hid_t id = H5Dopen2(loc, name.c_str(), H5P_DEFAULT);
  if (id < 0) throw UsageError(concat(file, ": '", name, "' is not a readable dataset"));
  return h5::Dataset(id);
}

h5::Group open_group(hid_t loc, const std::string& file, const std::string& name) {
  const hid_t id = H5Gopen2(loc, name.c_str(), H5P_DEFAULT);
  if (id < 0) throw UsageError(concat(file, ": '", name, "' is not a readable group"));
  return h5::Group(id);
}

TensorRead plan_read(hid_t loc, const std::string& file, const std::string& name, const torch::Tensor& into,
                     uint64_t file_size) {
  if (!h5::exists(loc, name)) throw UsageError(concat(file, ": missing dataset '", name, "'"));
  TensorRead r{name, open_dataset(loc, file, name), into, std::nullopt, 0};
  auto dims = h5::shape(r.ds.get());
  std::vector<int64_t> shape(dims.begin(), dims.end());
  if (shape != into.sizes().vec())
    throw UsageError(concat(file, ": dataset '", name, "' has shape ", c10::IntArrayRef(shape),
                         ", the model expects ", into.sizes()));
  auto crc = h5::get_attr_int(r.ds.get(), "crc32");
  if (!crc) throw UsageError(concat(file, ": dataset '", name, "' has no crc32 attribute"));
  r.crc = static_cast<uint32_t>(*crc);
  const uint64_t bytes = static_cast<uint64_t>(into.numel()) * sizeof(float);
  r.offset = h5::raw_offset(r.ds.get(), H5T_NATIVE_FLOAT, bytes);
  if (r.offset && (*r.offset > file_size || file_size - *r.offset < bytes))
    throw UsageError(concat(file, ": dataset '", name, "' lies beyond the end of the file (truncated file?)"));
  return r;
}

int64_t require_int(hid_t obj, const std::string& file, const std::string& name) {
  auto v = h5::get_attr_int(obj, name);
  if (!v) throw UsageError(concat(file, ": missing attribute '", name, "'"));
  return *v;
}

// A required integer attribute in [lo, hi]; `shown` is its name in the message ("train/data_cursor").
int64_t require_int_in(hid_t obj, const std::string& file, const std::string& name, const std::string& shown,
                       int64_t lo, int64_t hi = INT64_MAX) {
  auto v = h5::get_attr_int(obj, name);
  if (!v) throw UsageError(concat(file, ": missing attribute '", shown, "'"));
  if (*v < lo || *v > hi)
    throw UsageError(concat(file, ": attribute '", shown, "' must be ",
                            hi == INT64_MAX ? concat(">= ", lo) : concat("between ", lo, " and ", hi), ", got ", *v));
  return *v;
}

// An optional attribute that, when present, must have the type the loader reads it as.
std::optional<std::string> optional_string(hid_t obj, const std::string& file, const std::string& name) {
  if (!h5::has_attr(obj, name)) return std::nullopt;
  auto v = h5::get_attr_string(obj, name);
  if (!v) throw UsageError(concat(file, ": attribute '", name, "' must be a string"));
  return v;
}

h5::File open_checkpoint(const std::string& path) {
  h5::File f = h5::open_read(path);
  auto format = h5::get_attr_string(f.get(), "format");
  if (!format || *format != kCheckpointFormat)
    throw UsageError(concat(path, ": attribute 'format' is '", format.value_or(""), "', expected '",
                         kCheckpointFormat, "'"));
  const int64_t version = require_int(f.get(), path, "version");
  if (version != kCheckpointVersion && version != 1)
    throw UsageError(concat(path, ": unsupported checkpoint version ", version, " (this mpitrain reads 1 and ",
                         kCheckpointVersion, ")"));
  return f;
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "ckpt-%08lld.h5", static_cast<long long>(step));
  return buf;
}

// ---- save --------------------------------------------------------------------------------------

FullOptimState full_state_of(AdamW& opt) {
  MPITRAIN_CHECK(!opt.sharded(), "full_state_of: a sharded AdamW holds slices (gather them: state_sync.h)");
  FullOptimState full;
  for (size_t i = 0; i < opt.size(); ++i) full.moments.push_back({opt.name(i), opt.exp_avg(i), opt.exp_avg_sq(i)});
  full.steps_taken = opt.steps_taken();
  return full;
}

CheckpointSnapshot snapshot_checkpoint(GPT& model, const FullOptimState& opt, const TrainState& st, bool copy) {
  torch::NoGradGuard no_grad;
  // copy: host buffers (pinned for CUDA tensors, whose copies are then DMA), filled by
  // snapshot_into. Else CPU fp32 contiguous tensors are referenced as they are.
  auto hold = [&](const torch::Tensor& t) {
    if (!copy) return host_fp32(t, /*copy=*/false);
    return torch::empty(t.sizes(), torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(t.is_cuda()));
  };
  CheckpointSnapshot snap;
  for (const auto& [name, p] : model->named_params()) snap.params.emplace_back(name, hold(p));
  snap.moments.reserve(opt.moments.size());
  for (const auto& m : opt.moments) snap.moments.push_back({m.name, hold(m.exp_avg), hold(m.exp_avg_sq)});
  if (copy) {
    snapshot_into(snap, model, opt, st);
    return snap;
  }
  snap.dims = model->dims();
  snap.steps_taken = opt.steps_taken;
  snap.state = st;
  return snap;
}

void snapshot_into(CheckpointSnapshot& into, GPT& model, const FullOptimState& opt, const TrainState& st) {
  torch::NoGradGuard no_grad;
  const auto params = model->named_params();
  MPITRAIN_CHECK(into.params.size() == params.size() && into.moments.size() == opt.moments.size(),
                 "snapshot_into: a snapshot of another model");
  int64_t gpu = -1;
  auto put = [&](torch::Tensor& dst, const torch::Tensor& src) {
    MPITRAIN_CHECK(dst.sizes() == src.sizes(), "snapshot_into: a snapshot of another model");
    if (src.is_cuda()) gpu = src.device().index();
    dst.copy_(src.detach(), /*non_blocking=*/src.is_cuda());  // pinned destination: asynchronous DMA
  };
  for (size_t i = 0; i < params.size(); ++i) put(into.params[i].second, params[i].second);
  for (size_t i = 0; i < opt.moments.size(); ++i) {
    put(into.moments[i].exp_avg, opt.moments[i].exp_avg);
    put(into.moments[i].exp_avg_sq, opt.moments[i].exp_avg_sq);
  }
  if (gpu >= 0) torch::cuda::synchronize(gpu);
  into.dims = model->dims();
  into.steps_taken = opt.steps_taken;
  into.state = st;
}

uint64_t CheckpointTensor::bytes() const {
  uint64_t n = sizeof(float);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<CheckpointTensor> checkpoint_tensors(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                                 const std::vector<std::pair<std::string, torch::Tensor>>& moments) {
  std::vector<CheckpointTensor> out;
  for (const auto& [name, p] : params) out.push_back({"model/" + name, p.sizes().vec()});
  for (const auto& [name, m] : moments) {
    out.push_back({"optim/" + name + "/exp_avg", m.sizes().vec()});
    out.push_back({"optim/" + name + "/exp_avg_sq", m.sizes().vec()});
  }
  return out;
}

struct CheckpointFileHandles {
  h5::File file;
  std::vector<h5::Dataset> datasets;
};

namespace {

// The architecture beyond GPT-2's five dimensions: the rows of model_fields() that apply to the
// family (flags as 0/1 integers).
void write_arch_attrs(hid_t root, const GPTDims& d) {
  for (const ModelField& f : model_fields()) {
    if (!field_applies(f, d.family_row())) continue;
    std::visit(
        [&](const auto& x) {
          if constexpr (std::is_same_v<std::decay_t<decltype(x)>, bool>) h5::set_attr(root, f.key, int64_t{x});
          else h5::set_attr(root, f.key, x);
        },
        f.get(d));
  }
}

UsageError write_failure(const std::string& tmp, const std::string& why) {
  std::remove(tmp.c_str());  // never leave half a file; the complete ones stay as they were
  return UsageError(concat(tmp, ": cannot write checkpoint (disk full or not writable?): ", why,
                           "; earlier checkpoints are untouched"));
}
}  // namespace

CheckpointFile::CheckpointFile(const std::string& dir, const GPTDims& d, int64_t steps_taken, const TrainState& st,
                               const std::vector<CheckpointTensor>& tensors)
    : dir_(dir), path_(dir + "/" + checkpoint_name(st.step)), tmp_(path_ + ".tmp"), state_(st) {
  make_dirs(dir);
  try {
    h5_ = std::make_unique<CheckpointFileHandles>();
    h5_->file = h5::create(tmp_, kDirectAlign);  // large datasets start on a block: direct writes
    const hid_t root = h5_->file.get();
    h5::set_attr(root, "format", std::string(kCheckpointFormat));
    h5::set_attr(root, "version", kCheckpointVersion);
    h5::set_attr(root, "mpitrain_version", std::string(MPITRAIN_VERSION));
    h5::set_attr(root, "step", st.step);
    h5::set_attr(root, "tokens_seen", st.tokens_seen);
    h5::set_attr(root, "world_size", st.world_size);
    h5::set_attr(root, "parallel_dp", st.dp);
    h5::set_attr(root, "parallel_tp", st.tp);
    h5::set_attr(root, "optim_zero", st.zero);
    if (st.islands > 1) h5::set_attr(root, "parallel_islands", st.islands);
    h5::set_attr(root, "config", st.config_yaml);
    h5::set_attr(root, "tokenizer", st.tokenizer);
    if (!st.tokenizer_file.empty()) h5::set_attr(root, "tokenizer_file", st.tokenizer_file);
    if (!st.tokenizer_sha256.empty()) h5::set_attr(root, "tokenizer_sha256", st.tokenizer_sha256);
    h5::set_attr(root, "eot_token", st.eot_token);
    h5::set_attr(root, "n_layer", d.n_layer);
    h5::set_attr(root, "n_head", d.n_head);
    h5::set_attr(root, "n_embd", d.n_embd);
    h5::set_attr(root, "seq_len", d.seq_len);
    h5::set_attr(root, "vocab_size", d.vocab_size);
    if (d.vocab_live > 0) h5::set_attr(root, "vocab_live", d.vocab_live);  // automatic padding after them
    write_arch_attrs(root, d);
    auto model_group = h5::create_group(root, "model");
    auto optim_group = h5::create_group(root, "optim");
    h5::set_attr(optim_group.get(), "steps_taken", steps_taken);
    // Every tensor's dataset is allocated first (metadata only); their bytes follow in file order.
    for (const auto& t : tensors) {
      const size_t slash = t.path.rfind('/');
      const std::string group = t.path.substr(0, slash), name = t.path.substr(slash + 1);
      if (!h5::exists(root, group)) h5::create_group(root, group);
      auto g = h5::open_group(root, group);
      auto [ds, at] = allocate_dataset(g.get(), name, t.shape);
      h5_->datasets.push_back(std::move(ds));
      offsets_.push_back(at);
    }
    if (H5Fflush(root, H5F_SCOPE_GLOBAL) < 0) throw Error("HDF5 flush failed (disk full?)");
  } catch (const Error& e) {
    h5_.reset();
    throw write_failure(tmp_, e.what());
  }
}

CheckpointFile::~CheckpointFile() {
  if (done_) return;
  h5_.reset();
  std::remove(tmp_.c_str());
}

UsageError CheckpointFile::failed(const std::string& why) {
  h5_.reset();
  done_ = true;
  return write_failure(tmp_, why);
}

std::string CheckpointFile::finish(const std::vector<uint32_t>& crcs, int64_t keep) {
  MPITRAIN_CHECK(crcs.size() == h5_->datasets.size(), "CheckpointFile::finish: one CRC per tensor");
  const TrainState& st = state_;
  try {
    for (size_t i = 0; i < crcs.size(); ++i)
      h5::set_attr(h5_->datasets[i].get(), "crc32", static_cast<int64_t>(crcs[i]));
    h5_->datasets.clear();
    const hid_t root = h5_->file.get();
    auto train_group = h5::create_group(root, "train");
    h5::set_attr(train_group.get(), "data_cursor", static_cast<int64_t>(st.data_cursor));
    if (st.loss_scale > 0) {  // fp16 runs: the dynamic loss scale continues where it was
      h5::set_attr(train_group.get(), "loss_scale", st.loss_scale);
      h5::set_attr(train_group.get(), "loss_scale_good_steps", st.loss_scale_good_steps);
    }
    if (!st.rng_states.empty()) {
      const size_t n = st.rng_states.front().size();
      std::vector<uint8_t> flat;
      for (const auto& s : st.rng_states) {
        MPITRAIN_CHECK(s.size() == n, "RNG states of different sizes");
        flat.insert(flat.end(), s.begin(), s.end());
      }
      auto ds = h5::write(train_group.get(), "rng_states", H5T_NATIVE_UINT8, {st.rng_states.size(), n}, flat.data());
      h5::set_attr(ds.get(), "crc32", static_cast<int64_t>(h5::crc32(flat.data(), flat.size())));
    }
    if (st.routing_bias.defined() && st.routing_bias.numel() > 0) {
      const torch::Tensor b = st.routing_bias.to(torch::kFloat32).contiguous();
      auto ds = h5::write(train_group.get(), "routing_bias", H5T_NATIVE_FLOAT,
                          {static_cast<hsize_t>(b.size(0)), static_cast<hsize_t>(b.size(1))}, b.data_ptr<float>());
      h5::set_attr(ds.get(), "crc32", static_cast<int64_t>(h5::crc32(b.data_ptr(), static_cast<size_t>(b.nbytes()))));
    }
    if (H5Fflush(root, H5F_SCOPE_GLOBAL) < 0) throw Error("HDF5 flush failed (disk full?)");
    h5_.reset();  // closed
  } catch (const Error& e) {
    throw failed(e.what());
  }
  done_ = true;
  fsync_path(tmp_, false);
  rename_durably(tmp_, path_, dir_);

  // `latest` names the file just completed; written the same way so it is never half a name.
  const std::string latest_tmp = dir_ + "/latest.tmp";
  {
    std::ofstream out(latest_tmp, std::ios::trunc);
    out << checkpoint_name(st.step) << "\n";
    if (!out.flush()) throw UsageError(concat(latest_tmp, ": cannot write (disk full?); the checkpoint itself is complete"));
  }
  fsync_path(latest_tmp, false);
  rename_durably(latest_tmp, dir_ + "/latest", dir_);

  // Keep the newest `keep`; the one just written is the newest by construction.
  auto all = list_checkpoints(dir_);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i)
    if (all[i].second != path_) std::remove(all[i].second.c_str());
  return path_;
}

void maybe_die_in_save_for_test(int64_t step) {
  if (const char* at = std::getenv("MPITRAIN_TEST_DIE_IN_SAVE"); at && std::atoll(at) == step) std::raise(SIGKILL);
}

std::string write_checkpoint(const std::string& dir, const CheckpointSnapshot& snap, int64_t keep) {
  std::vector<std::pair<std::string, torch::Tensor>> moments;
  for (const auto& m : snap.moments) moments.emplace_back(m.name, m.exp_avg);
  CheckpointFile file(dir, snap.dims, snap.steps_taken, snap.state, checkpoint_tensors(snap.params, moments));
  std::vector<RawWrite> writes;
  auto add = [&](const torch::Tensor& t) {
    MPITRAIN_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                   "a snapshot tensor is host fp32 contiguous");
    writes.push_back({static_cast<const uint8_t*>(t.data_ptr()), static_cast<uint64_t>(t.numel()) * sizeof(float),
                      file.offset(writes.size())});
  };
  for (const auto& [name, p] : snap.params) add(p);
  for (const auto& m : snap.moments) {
    add(m.exp_avg);
    add(m.exp_avg_sq);
  }
  std::vector<uint32_t> crcs;
  try {
    crcs = write_tensors(file.tmp_path(), writes, [&](size_t i) {
      if (i + 1 == snap.params.size()) maybe_die_in_save_for_test(snap.state.step);  // half-way through the file
    });
  } catch (const Error& e) {
    throw file.failed(e.what());
  }
  return file.finish(crcs, keep);
}

std::string save_checkpoint(const std::string& dir, GPT& model, AdamW& opt, const TrainState& st,
                            int64_t keep) {
  return write_checkpoint(dir, snapshot_checkpoint(model, full_state_of(opt), st, /*copy=*/false), keep);
}

// ---- asynchronous save ---------------------------------------------------------------------------

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

AsyncCheckpointWriter::AsyncCheckpointWriter(std::string dir, int64_t keep, bool async)
    : dir_(std::move(dir)), keep_(keep), async_(async) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  join();
  if (error_) {  // unwinding from another failure, or wait() was never called: log, do not throw
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      log::error(concat("checkpoint write failed: ", e.what()));
    } catch (...) {
      log::error("checkpoint write failed");
    }
  }
}

void AsyncCheckpointWriter::join() {
  if (thread_.joinable()) thread_.join();
}

void AsyncCheckpointWriter::wait() {
  join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void AsyncCheckpointWriter::prepare(GPT& model, const FullOptimState& opt) {
  if (!async_ || buffers_) return;
  buffers_ = std::make_shared<CheckpointSnapshot>(snapshot_checkpoint(model, opt, TrainState{}, /*copy=*/true));
}

std::string AsyncCheckpointWriter::save(GPT& model, const FullOptimState& opt, const TrainState& st) {
  if (!async_)
    return save_with(st.step, [] {}, [&] { return write_checkpoint(dir_, snapshot_checkpoint(model, opt, st, false), keep_); });
  return save_with(
      st.step,
      [&] {
        if (buffers_) snapshot_into(*buffers_, model, opt, st);  // the write in flight is done: reuse
        else buffers_ = std::make_shared<CheckpointSnapshot>(snapshot_checkpoint(model, opt, st, /*copy=*/true));
      },
      [this] { return write_checkpoint(dir_, *buffers_, keep_); });
}

std::string AsyncCheckpointWriter::save_with(int64_t step, const std::function<void()>& snapshot,
                                             std::function<std::string()> write) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  ++saves_;
  if (!async_) {
    snapshot();
    const std::string path = write();
    const double ms = ms_since(t0);
    stalled_ms_ += ms;
    log::info(concat("checkpoint step ", step, ": ", path, " written in ", static_cast<int64_t>(ms + 0.5),
                     " ms (synchronous: the loop waited for all of it)"));
    return path;
  }
  wait();  // at most one write in flight; a failed previous write ends the job here
  const double waited = ms_since(t0);
  const auto t1 = Clock::now();
  snapshot();
  const double snap_ms = ms_since(t1);
  thread_ = std::thread([this, step, write = std::move(write)] {
    const auto t2 = std::chrono::steady_clock::now();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // HDF5's error stack is per thread
    try {
      const std::string written = write();
      log::info(concat("checkpoint step ", step, ": ", written, " written in ",
                       static_cast<int64_t>(ms_since(t2) + 0.5), " ms (background)"));
    } catch (...) {
      error_ = std::current_exception();
    }
  });
  stalled_ms_ += ms_since(t0);
  log::info(concat("checkpoint step ", step, ": ",
                   waited >= 1 ? concat("waited ", static_cast<int64_t>(waited + 0.5), " ms for the previous write, ")
                               : std::string(),
                   "snapshot ", static_cast<int64_t>(snap_ms + 0.5), " ms (async write started)"));
  return dir_ + "/" + checkpoint_name(step);
}

// ---- resume ------------------------------------------------------------------------------------

std::optional<std::string> find_resume_checkpoint(const CheckpointConfig& cfg) {
  if (cfg.resume == "none") return std::nullopt;
  if (cfg.resume != "auto") {
    if (::access(cfg.resume.c_str(), R_OK) != 0)
      throw UsageError(concat("checkpoint.resume: no such checkpoint '", cfg.resume, "'"));
    return cfg.resume;
  }
  const std::string latest = read_latest(cfg.dir);
  if (!latest.empty() && ::access((cfg.dir + "/" + latest).c_str(), R_OK) == 0)
    return cfg.dir + "/" + latest;
  auto all = list_checkpoints(cfg.dir);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

std::vector<std::string> resume_candidates(const CheckpointConfig& cfg) {
  std::vector<std::string> out;
  auto first = find_resume_checkpoint(cfg);
  if (!first) return out;
  out.push_back(*first);
  if (cfg.resume != "auto") return out;
  auto all = list_checkpoints(cfg.dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (it->second != *first) out.push_back(it->second);
  return out;
}

namespace {

// The rows of model_fields() that apply to the block (the arch row first says which), each checked
// against its type and range; an absent optional one takes its fallback (files written before it
// existed, and a family's fields in the files of other families). A file without the family
// attribute (before model.family) has the family its parts say.
void read_arch_attrs(hid_t root, const std::string& path, GPTDims& d) {
  for (const ModelField& f : model_fields()) {
    if (f.llama_block && !d.llama()) continue;
    if (!h5::has_attr(root, f.key)) {
      if (f.required) throw UsageError(concat(path, ": missing attribute '", f.key, "'"));
      f.set(d, f.fallback);
      continue;
    }
    switch (f.type) {
      case ModelField::Type::integer:
        f.set(d, require_int_in(root, path, f.key, f.key, f.lo, f.hi));
        break;
      case ModelField::Type::flag:
        f.set(d, require_int_in(root, path, f.key, f.key, 0, 1) == 1);
        break;
      case ModelField::Type::number: {
        const auto v = h5::get_attr_double(root, f.key);
        if (!v || !std::isfinite(*v) || *v < static_cast<double>(f.lo))
          throw UsageError(concat(path, ": attribute '", f.key, "' must be a number >= ", f.lo));
        f.set(d, *v);
        break;
      }
      case ModelField::Type::text: {
        const std::string v = *optional_string(root, path, f.key);
        const std::string allowed = *f.values ? std::string(f.values) : family_names();
        if (("|" + allowed + "|").find("|" + v + "|") == std::string::npos)
          throw UsageError(concat(path, ": attribute '", f.key, "' must be one of ", allowed, ", got '", v, "'"));
        f.set(d, v);
        break;
      }
    }
  }
  complete_dims(d);  // a file before model.family names none
  if (const char* key = family_conflict(d.family_row(), d))
    throw UsageError(concat(path, ": attribute '", key, "' does not fit attribute 'family' (", d.family, ")"));
  if (const ModelField* f = field_conflict(d.family_row(), d))
    throw UsageError(concat(path, ": attribute '", f->key, "' (", field_text(*f, d), ") is ", f->families,
                            "'s only, not family ", d.family, "'s"));
}

// The declared model dimensions of the open checkpoint `root` (file name `path`), checked against
// its stored tensors.
GPTDims declared_dims(hid_t root, const std::string& path) {
  GPTDims d;
  d.n_layer = require_int_in(root, path, "n_layer", "n_layer", 1);
  d.n_head = require_int_in(root, path, "n_head", "n_head", 1);
  d.n_embd = require_int_in(root, path, "n_embd", "n_embd", 1);
  d.seq_len = require_int_in(root, path, "seq_len", "seq_len", 1);
  d.vocab_size = require_int_in(root, path, "vocab_size", "vocab_size", 1);
  if (h5::has_attr(root, "vocab_live"))  // absent: every row a class
    d.vocab_live = require_int_in(root, path, "vocab_live", "vocab_live", 1, d.vocab_size);
  read_arch_attrs(root, path, d);
  if (d.n_embd % d.n_head != 0 && d.head_size == 0)
    throw UsageError(concat(path, ": attribute 'n_embd' must be divisible by 'n_head' (", d.n_head, "), got ",
                            d.n_embd));
  if (d.llama() && d.n_head % d.n_kv_head != 0)
    throw UsageError(concat(path, ": attribute 'n_kv_head' must divide 'n_head' (", d.n_head, "), got ", d.n_kv_head));
  // The declared dimensions must be those of the stored tensors: `sample` builds the model from
  // them before reading any tensor, so a damaged attribute must not make it allocate gigabytes.
  auto expect_stored = [&](const std::string& name, std::vector<int64_t> want, const char* declared_by) {
    if (!h5::exists(root, name)) throw UsageError(concat(path, ": missing dataset '", name, "'"));
    h5::Dataset ds = open_dataset(root, path, name);
    const auto dims = h5::shape(ds.get());
    const std::vector<int64_t> got(dims.begin(), dims.end());
    if (got != want)
      throw UsageError(concat(path, ": dataset '", name, "' has shape ", c10::IntArrayRef(got), ", but the attributes ",
                              declared_by, " declare ", c10::IntArrayRef(want)));
    if (H5Dget_storage_size(ds.get()) < static_cast<hsize_t>(want[0] * want[1]) * sizeof(float))
      throw UsageError(concat(path, ": dataset '", name, "' is not fully stored (truncated or corrupt file?)"));
  };
  expect_stored("model/wte.weight", {d.vocab_size, d.n_embd}, "'vocab_size' and 'n_embd'");
  const std::string last = concat("model/h.", d.n_layer - 1, "."), after = concat("model/h.", d.n_layer, ".");
  const char* attention = d.llama() ? "attn.q_proj.weight" : "attn.c_attn.weight";
  if (d.llama()) {
    expect_stored(last + "attn.q_proj.weight", {d.attn_width(), d.n_embd},
                  "'n_layer', 'n_head', 'head_dim' and 'n_embd'");
    expect_stored(last + "attn.k_proj.weight", {d.n_kv_head * d.head_dim(), d.n_embd},
                  "'n_kv_head', 'n_head', 'head_dim' and 'n_embd'");
    const int64_t experts = d.experts_of_layer(d.n_layer - 1);
    if (experts > 0) {  // the last layer's router and last expert
      expect_stored(last + "mlp.gate.weight", {experts, d.n_embd}, "the experts' count and 'n_embd'");
      expect_stored(concat(last, "mlp.experts.", experts - 1, ".gate_proj.weight"), {d.mlp_units(d.n_layer - 1), d.n_embd},
                    "the experts' count and size and 'n_embd'");
    } else {
      expect_stored(last + "mlp.gate_proj.weight", {d.intermediate_size, d.n_embd}, "'intermediate_size' and 'n_embd'");
    }
    if (!d.tie_embeddings) expect_stored("model/lm_head.weight", {d.vocab_size, d.n_embd}, "'vocab_size' and 'n_embd'");
  } else {
    expect_stored("model/wpe.weight", {d.seq_len, d.n_embd}, "'seq_len' and 'n_embd'");
    expect_stored(last + attention, {3 * d.n_embd, d.n_embd}, "'n_layer' and 'n_embd'");
  }
  if (h5::exists(root, after + attention))
    throw UsageError(concat(path, ": attribute 'n_layer' declares ", d.n_layer, " layers, but the file holds more"));
  return d;
}

}  // namespace

GPTDims checkpoint_dims(const std::string& path) {
  h5::File f = open_checkpoint(path);
  return declared_dims(f.get(), path);
}

void load_checkpoint(const std::string& path, GPT& model, AdamW* opt, TrainState& st) {
  if (!opt) return load_checkpoint(path, model, static_cast<FullOptimState*>(nullptr), st);
  FullOptimState full = full_state_of(*opt);
  load_checkpoint(path, model, &full, st);
  opt->set_steps_taken(full.steps_taken);
}

namespace {

// What load_checkpoint reads and checks before any tensor: the architecture against the model's,
// the training state's scalars, and (with_optim) AdamW's step count, returned.
int64_t read_checkpoint_header(hid_t root, const std::string& path, GPT& model, bool with_optim, TrainState& st) {
  // The architecture first: equal tensor shapes are not enough (n_head changes the attention but
  // no shape, and a model with fewer layers would silently take the first layers of a deeper one).
  {
    const GPTDims have = declared_dims(root, path), want = model->dims();
    auto same = [&](const char* key, const std::string& h, const std::string& w) {
      if (h != w)
        throw ArchitectureMismatch(concat(path, ": the checkpoint's model has ", key, " ", h, ", the configured one ", w,
                                          " (model.", key, "); a checkpoint resumes only the architecture it was "
                                          "saved from"));
    };
    const std::vector<ModelField>& fields = model_fields();  // the block first: arch
    same(fields.front().key, field_text(fields.front(), have), field_text(fields.front(), want));
    for (const auto& [key, h, w] : {std::tuple{"n_layer", have.n_layer, want.n_layer},
                                    std::tuple{"n_head", have.n_head, want.n_head},
                                    std::tuple{"n_embd", have.n_embd, want.n_embd},
                                    std::tuple{"seq_len", have.seq_len, want.seq_len},
                                    std::tuple{"vocab_size", have.vocab_size, want.vocab_size}})
      same(key, concat(h), concat(w));
    for (auto f = fields.begin() + 1; f != fields.end(); ++f)
      if (!f->resume_may_change) same(f->key, field_text(*f, have), field_text(*f, want));
  }
  // The training state's scalars first: nonsense there is refused before any tensor is read.
  // (Negative counts would resume the loop, the lr schedule and the data order at nonsense.)
  st.step = require_int_in(root, path, "step", "step", 0);
  st.tokens_seen = require_int_in(root, path, "tokens_seen", "tokens_seen", 0);
  st.world_size = require_int_in(root, path, "world_size", "world_size", 1, INT_MAX);
  // The writer's layout (version 2; informative, any layout loads): absent in version 1 files.
  st.dp = h5::has_attr(root, "parallel_dp") ? require_int_in(root, path, "parallel_dp", "parallel_dp", 1, INT32_MAX)
                                            : st.world_size;
  st.tp = h5::has_attr(root, "parallel_tp") ? require_int_in(root, path, "parallel_tp", "parallel_tp", 1, INT32_MAX) : 1;
  st.zero = h5::has_attr(root, "optim_zero") ? require_int_in(root, path, "optim_zero", "optim_zero", 0, 3) : 0;
  st.islands = h5::has_attr(root, "parallel_islands")
                   ? require_int_in(root, path, "parallel_islands", "parallel_islands", 1, INT32_MAX)
                   : 1;
  st.config_yaml = optional_string(root, path, "config").value_or("");
  st.tokenizer = optional_string(root, path, "tokenizer").value_or("byte");
  st.tokenizer_file = optional_string(root, path, "tokenizer_file").value_or("");
  st.tokenizer_sha256 = optional_string(root, path, "tokenizer_sha256").value_or("");
  st.eot_token = -1;
  if (h5::has_attr(root, "eot_token"))  // a token of the model's vocabulary, or -1 (none)
    st.eot_token = require_int_in(root, path, "eot_token", "eot_token", -1, model->dims().vocab_size - 1);
  int64_t steps_taken = 0;
  if (with_optim) {
    if (!h5::exists(root, "optim")) throw UsageError(concat(path, ": missing group 'optim'"));
    auto g = open_group(root, path, "optim");
    steps_taken = require_int_in(g.get(), path, "steps_taken", "optim/steps_taken", 0);
  }
  if (!h5::exists(root, "train")) throw UsageError(concat(path, ": missing group 'train'"));
  auto train = open_group(root, path, "train");
  st.data_cursor = static_cast<uint64_t>(require_int_in(train.get(), path, "data_cursor", "train/data_cursor", 0));
  st.loss_scale = 0;
  st.loss_scale_good_steps = 0;
  if (auto scale = h5::get_attr_double(train.get(), "loss_scale")) {
    if (!(*scale > 0) || !std::isfinite(*scale))
      throw UsageError(concat(path, ": attribute 'train/loss_scale' must be a finite number > 0, got ", *scale));
    st.loss_scale = *scale;
    st.loss_scale_good_steps = require_int_in(train.get(), path, "loss_scale_good_steps",
                                              "train/loss_scale_good_steps", 0);
  }
  st.routing_bias = torch::Tensor();
  if (h5::exists(train.get(), "routing_bias")) {  // the sparse layers' routing bias (train.moe_bias_update_rate)
    h5::Dataset ds = open_dataset(train.get(), path, "routing_bias");
    const auto shape = h5::shape(ds.get());
    torch::Tensor b = torch::empty_like(model->routing_bias());  // [sparse layers, experts]
    const auto layers = static_cast<hsize_t>(b.size(0)), experts = static_cast<hsize_t>(b.size(1));
    if (shape.size() != 2 || shape[0] != layers || shape[1] != experts ||
        H5Dget_storage_size(ds.get()) != layers * experts * sizeof(float))
      throw UsageError(concat(path, ": dataset 'train/routing_bias' must hold [", layers, ", ", experts,
                              "] floats (the model's sparse layers and experts)"));
    h5::read(ds.get(), H5T_NATIVE_FLOAT, b.data_ptr<float>());
    auto crc = h5::get_attr_int(ds.get(), "crc32");
    if (!crc || static_cast<uint32_t>(*crc) != h5::crc32(b.data_ptr(), static_cast<size_t>(b.nbytes())))
      throw UsageError(concat(path, ": checksum mismatch in dataset 'train/routing_bias'"));
    st.routing_bias = b;
  }
  return steps_taken;
}

uint64_t file_size_of(const std::string& path) {
  struct stat file_stat {};
  if (::stat(path.c_str(), &file_stat) != 0) throw UsageError(concat(path, ": cannot stat: ", std::strerror(errno)));
  return static_cast<uint64_t>(file_stat.st_size);
}

// Every parameter's dataset of the checkpoint, found and its shape checked (nothing read).
std::vector<TensorRead> plan_param_reads(hid_t root, const std::string& path, GPT& model) {
  const uint64_t file_size = file_size_of(path);
  std::vector<TensorRead> reads;
  for (auto& [name, p] : model->named_params()) reads.push_back(plan_read(root, path, "model/" + name, p, file_size));
  return reads;
}

// The ranks' RNG states (train/rng_states), when the file has them, into st.rng_states.
void read_rng_states(hid_t train, const std::string& path, TrainState& st) {
  st.rng_states.clear();
  if (h5::exists(train, "rng_states")) {
    h5::Dataset ds = open_dataset(train, path, "rng_states");
    auto dims = h5::shape(ds.get());
    if (dims.size() != 2) throw UsageError(concat(path, ": dataset 'train/rng_states' must be 2-D"));
    // Allocate only what the file really stores (found by fuzz_checkpoint: a declared shape of
    // 65536 x 65536 that was never written asked for 4 GiB before the checksum could refuse it).
    if (dims[0] > static_cast<hsize_t>(std::max<int64_t>(st.world_size, 1)) || dims[1] > (1u << 20) ||
        H5Dget_storage_size(ds.get()) != dims[0] * dims[1])
      throw UsageError(concat(path, ": dataset 'train/rng_states' has shape [", dims[0], ", ", dims[1],
                              "] that does not match world_size ", st.world_size, " or its stored size"));
    std::vector<uint8_t> flat(dims[0] * dims[1]);
    h5::read(ds.get(), H5T_NATIVE_UINT8, flat.data());
    auto crc = h5::get_attr_int(ds.get(), "crc32");
    if (!crc || static_cast<uint32_t>(*crc) != h5::crc32(flat.data(), flat.size()))
      throw UsageError(concat(path, ": checksum mismatch in dataset 'train/rng_states'"));
    for (hsize_t r = 0; r < dims[0]; ++r)
      st.rng_states.emplace_back(flat.begin() + r * dims[1], flat.begin() + (r + 1) * dims[1]);
  }
}

}  // namespace

void load_checkpoint(const std::string& path, GPT& model, FullOptimState* opt, TrainState& st) {
  h5::File f = open_checkpoint(path);
  const hid_t root = f.get();
  const int64_t steps_taken = read_checkpoint_header(root, path, model, opt != nullptr, st);
  auto train = open_group(root, path, "train");

  // Every dataset is found and checked before any bytes are read.
  std::vector<TensorRead> reads = plan_param_reads(root, path, model);
  if (opt) {
    const uint64_t file_size = file_size_of(path);
    for (auto& m : opt->moments) {
      reads.push_back(plan_read(root, path, "optim/" + m.name + "/exp_avg", m.exp_avg, file_size));
      reads.push_back(plan_read(root, path, "optim/" + m.name + "/exp_avg_sq", m.exp_avg_sq, file_size));
    }
  }
  read_tensors(path, reads);
  if (opt) opt->steps_taken = steps_taken;

  read_rng_states(train.get(), path, st);
}

CheckpointParams::CheckpointParams(const std::string& path, GPT& model, TrainState& st, bool with_optim)
    : path_(path) {
  h5::File f = open_checkpoint(path);
  steps_taken_ = read_checkpoint_header(f.get(), path, model, with_optim, st);
  // Every dataset there, of the whole parameter's shape (a tensor-parallel model's are shards);
  // checked against a tensor of that shape without memory.
  const uint64_t file_size = file_size_of(path);
  for (const auto& [name, p] : model->named_params()) {
    names_.push_back(name);
    shapes_.push_back(tp_whole_shape(p.sizes(), model->tp_split(name), model->tp().size));
    const torch::Tensor shape = torch::zeros({1}).expand(shapes_.back());
    plan_read(f.get(), path, "model/" + name, shape, file_size);
    if (!with_optim) continue;
    for (const char* m : {"/exp_avg", "/exp_avg_sq"}) plan_read(f.get(), path, "optim/" + name + m, shape, file_size);
  }
  if (with_optim) read_rng_states(open_group(f.get(), path, "train").get(), path, st);
  with_optim_ = with_optim;
}

torch::Tensor CheckpointParams::read(size_t k, Part part) {
  MPITRAIN_CHECK(part == Part::param || with_optim_, "CheckpointParams: opened without AdamW's state");
  const std::string dataset = part == Part::param     ? "model/" + names_.at(k)
                              : part == Part::exp_avg ? "optim/" + names_.at(k) + "/exp_avg"
                                                      : "optim/" + names_.at(k) + "/exp_avg_sq";
  h5::File f = open_checkpoint(path_);
  torch::Tensor into = torch::empty(shapes_.at(k), torch::kFloat32);
  std::vector<TensorRead> reads;
  reads.push_back(plan_read(f.get(), path_, dataset, into, file_size_of(path_)));
  read_tensors(path_, reads);  // its checksum and values verified
  return into;
}

void CheckpointParams::verify_all() {
  for (size_t k = 0; k < size(); ++k) {
    read(k);
    if (!with_optim_) continue;
    read(k, Part::exp_avg);
    read(k, Part::exp_avg_sq);
  }
}

}  // namespace mpitrain
