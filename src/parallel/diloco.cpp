// DiLoCo's outer steps between islands (see diloco.h).
#include "mpitrain/diloco.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/model.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {
namespace {

constexpr const char* kStateFormat = "mpitrain-diloco";  // the per-rank state files (checkpoints below)
constexpr int64_t kStateVersion = 1;

// `parts` flattened and concatenated, fp32, on their device (the slots, the AdamW moments).
torch::Tensor flat_of(const std::vector<torch::Tensor>& parts) {
  std::vector<torch::Tensor> flat;
  flat.reserve(parts.size());
  for (const auto& p : parts) flat.push_back(p.detach().reshape({-1}).to(torch::kFloat32));
  return flat.empty() ? torch::zeros({0}, torch::kFloat32) : torch::cat(flat);
}

void write_vector(hid_t root, const std::string& name, const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  h5::Dataset d = h5::write(root, name, H5T_NATIVE_FLOAT, {static_cast<hsize_t>(c.numel())}, c.data_ptr<float>());
  h5::set_attr(d.get(), "crc32", static_cast<int64_t>(h5::crc32(c.data_ptr<float>(), static_cast<size_t>(c.nbytes()))));
}

// Dataset `name` of `length` floats, its CRC checked; UsageError naming the file otherwise.
torch::Tensor read_vector(hid_t root, const std::string& path, const std::string& name, int64_t length) {
  if (!h5::exists(root, name)) throw UsageError(concat(path, ": no dataset '", name, "' (not a DiLoCo state file?)"));
  h5::Dataset d(H5Dopen2(root, name.c_str(), H5P_DEFAULT), path + ": " + name);
  const auto shape = h5::shape(d.get());
  if (shape.size() != 1 || static_cast<int64_t>(shape[0]) != length)
    throw UsageError(concat(path, ": dataset '", name, "' has ", shape.empty() ? 0 : shape[0], " values, this rank holds ",
                            length, " (another model or layout)"));
  torch::Tensor t = torch::empty({length}, torch::kFloat32);
  h5::read(d.get(), H5T_NATIVE_FLOAT, t.data_ptr<float>());
  const auto crc = h5::get_attr_int(d.get(), "crc32");
  if (!crc || static_cast<uint32_t>(*crc) != h5::crc32(t.data_ptr<float>(), static_cast<size_t>(t.nbytes())))
    throw UsageError(concat(path, ": dataset '", name, "' fails its CRC32 check (the file is damaged)"));
  return t;
}

}  // namespace

int64_t fragment_of(const std::string& name, int64_t fragments) {
  const int64_t block = block_of(name);
  return block < 0 ? 0 : block % fragments;
}

std::string diloco_layout(int64_t world, int64_t islands, int64_t dp, int64_t tp, int64_t zero) {
  const int64_t pp = world / std::max<int64_t>(1, islands * dp * tp);  // (a pipeline inside each island)
  return concat(world, " ranks = ", islands, islands == 1 ? " island" : " islands", pp > 1 ? concat(" x pp ", pp) : std::string(),
                " x dp ", dp, " x tp ", tp,
                ", optim.zero ", zero);
}

Diloco::Diloco(const DilocoConfig& cfg, Mesh& mesh, AdamW& opt, int zero, int64_t n_layer)
    : cfg_(cfg), mesh_(mesh), opt_(opt), zero_(zero), islands_(*mesh.islands()) {
  MPITRAIN_CHECK(cfg_.fragments <= n_layer, "Diloco: more fragments than blocks (train.cpp refuses it by name)");
  const bool replicated = zero == 0;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < opt.size(); ++i) {
    slots_.push_back(opt.param(i));
    slot_offset_.push_back(total_);
    slot_fragment_.push_back(fragment_of(opt.name(i), cfg_.fragments));
    total_ += opt.param(i).numel();
  }
  const int dp = mesh_.dp_size();
  // (Expert parallelism: the dp ranks hold different experts, so no two hold the same flat vector:
  // each keeps its whole outer state.)
  chunked_ = replicated && dp > 1 && mesh_.layout().ep == 1;
  if (chunked_) {
    chunk_ = (total_ + dp - 1) / dp;
    begin_ = std::min<int64_t>(total_, chunk_ * mesh_.dp_rank());
    length_ = std::min<int64_t>(total_, begin_ + chunk_) - begin_;
  } else {
    chunk_ = length_ = total_;
  }
  outer_ = flat().narrow(0, begin_, length_).clone();
  momentum_ = torch::zeros_like(outer_);
  if (cfg_.dtype == "int8") error_ = torch::zeros_like(outer_);
  {  // every island from island 0's start (the same seed or files give the same; this makes sure)
    Watchdog::Scope watch("broadcast(diloco start)");
    islands_.broadcast(outer_, 0);
  }
  write_back(outer_);
  // MPI moves a non-blocking collective on only inside MPI calls: with overlap, a thread calls
  // MPI_Testall on the exchanges in flight every millisecond (MPI_THREAD_MULTIPLE only; else the
  // steps' own MPI calls and one test per step move them).
  poll_ = cfg_.overlap > 0 && islands_.name() == "mpi" && mpi::thread_multiple();
}

Diloco::~Diloco() { progress_stop(); }

torch::Tensor Diloco::flat() const { return flat_of(slots_); }

torch::Tensor Diloco::slots_range(int64_t at, int64_t n) const {
  std::vector<torch::Tensor> parts;
  int64_t off = 0;
  for (const auto& s : slots_) {
    const int64_t lo = std::max(at, off), hi = std::min(at + n, off + s.numel());
    if (lo < hi) parts.push_back(s.detach().reshape({-1}).narrow(0, lo - off, hi - lo).to(torch::kFloat32));
    off += s.numel();
  }
  return parts.empty() ? torch::zeros({0}, torch::kFloat32) : torch::cat(parts);
}

void Diloco::slots_write(int64_t at, const torch::Tensor& values) {
  const int64_t n = values.numel();
  int64_t off = 0;
  for (auto& s : slots_) {
    const int64_t lo = std::max(at, off), hi = std::min(at + n, off + s.numel());
    if (lo < hi) s.detach().view({-1}).narrow(0, lo - off, hi - lo).copy_(values.narrow(0, lo - at, hi - lo));
    off += s.numel();
  }
}

void Diloco::write_back(const torch::Tensor& part) {
  torch::Tensor whole = part;
  if (chunked_) {
    torch::Tensor mine = torch::zeros({chunk_}, part.options());
    mine.narrow(0, 0, length_).copy_(part);
    torch::Tensor all = torch::empty({chunk_ * mesh_.dp_size()}, part.options());
    Watchdog::Scope watch("all_gather(diloco)");
    mesh_.dp().all_gather(mine, all);
    whole = all.narrow(0, 0, total_);
  }
  slots_write(chunked_ ? 0 : begin_, whole);
}

Diloco::Ranges Diloco::ranges(int64_t p, int64_t lo, int64_t hi) const {
  Ranges out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slot_fragment_[i] != p) continue;
    const int64_t a = std::max(lo, slot_offset_[i]), b = std::min(hi, slot_offset_[i] + slots_[i].numel());
    if (a >= b) continue;
    if (!out.empty() && out.back().second == a) out.back().second = b;  // adjacent slots: one range
    else out.emplace_back(a, b);
  }
  return out;
}

int64_t Diloco::count(const Ranges& r) {
  int64_t n = 0;
  for (const auto& [a, b] : r) n += b - a;
  return n;
}

torch::Tensor Diloco::take(const torch::Tensor& part, int64_t p) const {
  std::vector<torch::Tensor> pieces;
  for (const auto& [a, b] : ranges(p, begin_, begin_ + length_)) pieces.push_back(part.narrow(0, a - begin_, b - a));
  return pieces.empty() ? torch::zeros({0}, part.options()) : torch::cat(pieces);
}

void Diloco::put(torch::Tensor& part, int64_t p, const torch::Tensor& values) const {
  int64_t at = 0;
  for (const auto& [a, b] : ranges(p, begin_, begin_ + length_)) {
    part.narrow(0, a - begin_, b - a).copy_(values.narrow(0, at, b - a));
    at += b - a;
  }
}

torch::Tensor Diloco::take_slots(int64_t p) const {
  std::vector<torch::Tensor> pieces;
  for (const auto& [a, b] : ranges(p, begin_, begin_ + length_)) pieces.push_back(slots_range(a, b - a));
  return pieces.empty() ? torch::zeros({0}, outer_.options()) : torch::cat(pieces);
}

// Fragment p of this rank's part to the slots. ZeRO off with dp > 1 (each dp rank reduced its own
// 1/dp of the model): an all-gather over the island's dp group, each rank's piece padded to the
// longest, then each piece to its place.
void Diloco::write_fragment(int64_t p, const torch::Tensor& values) {
  auto write = [&](const Ranges& r, const torch::Tensor& v) {
    int64_t at = 0;
    for (const auto& [a, b] : r) {
      slots_write(a, v.narrow(0, at, b - a));
      at += b - a;
    }
  };
  if (!chunked_) {
    write(ranges(p, begin_, begin_ + length_), values);
    return;
  }
  const int dp = mesh_.dp_size();
  std::vector<Ranges> of(static_cast<size_t>(dp));
  int64_t longest = 0;
  for (int d = 0; d < dp; ++d) {
    const int64_t lo = std::min<int64_t>(total_, chunk_ * d);
    of[static_cast<size_t>(d)] = ranges(p, lo, std::min(total_, lo + chunk_));
    longest = std::max(longest, count(of[static_cast<size_t>(d)]));
  }
  torch::Tensor mine = torch::zeros({longest}, values.options());
  mine.narrow(0, 0, values.numel()).copy_(values);
  torch::Tensor all = torch::empty({longest * dp}, values.options());
  {
    Watchdog::Scope watch("all_gather(diloco)");
    mesh_.dp().all_gather(mine, all);
  }
  for (int d = 0; d < dp; ++d) write(of[static_cast<size_t>(d)], all.narrow(0, longest * d, count(of[static_cast<size_t>(d)])));
}

bool Diloco::after_step(int64_t step, int64_t total) {
  torch::NoGradGuard no_grad;
  progress_stop();
  const auto t0 = std::chrono::steady_clock::now();
  bool changed = false, acted = false;
  while (!pending_.empty() && (pending_.front().due <= step || step >= total)) {
    apply(pending_.front(), /*mixing=*/true);
    pending_.pop_front();
    changed = true;
  }
  const int64_t H = cfg_.inner_steps, F = cfg_.fragments;
  for (int64_t p = 0; p < F; ++p) {
    if (step < total && step % H != p * H / F) continue;
    start(p, step + (step < total ? cfg_.overlap : 0));
    acted = true;
    if (pending_.back().due <= step) {  // no overlap (or the last step): applied at once
      apply(pending_.back(), /*mixing=*/false);
      pending_.pop_back();
      changed = true;
    }
  }
  for (auto& ex : pending_)
    for (auto& w : ex.works) w->progress();
  if (changed || acted) seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!pending_.empty()) progress_start();
  return changed;
}

void Diloco::start(int64_t p, int64_t due) {
  torch::Tensor delta = take(outer_, p) - take_slots(p);  // the pseudo-gradient
  const int64_t n = delta.numel();
  Exchange ex;
  ex.fragment = p;
  ex.due = due;
  if (cfg_.dtype == "int8") {
    // int8 on the wire: x = delta + the error left over from the last exchange, in blocks of
    // kInt8Block values, each sent as int8 round(x / s) with its fp32 scale s = max |x| / 127; the
    // error feedback keeps x - s q for the next exchange, so what rounding drops is delayed, not
    // lost. The islands all-gather the blocks and scales and every rank adds the dequantised
    // values in island order: the same mean on every island. (An all-gather, not an all-reduce:
    // int8 sums overflow. Each rank receives (islands - 1) x ~1.02 bytes per value, a ring
    // all-reduce of fp32 about 8.)
    const int64_t blocks = (n + kInt8Block - 1) / kInt8Block, islands = islands_.size();
    torch::Tensor x = torch::zeros({blocks * kInt8Block}, delta.options());
    x.narrow(0, 0, n).copy_(delta + take(error_, p));
    const torch::Tensor xb = x.view({blocks, kInt8Block});
    ex.scale = xb.abs().amax(1).div(127.0);
    const torch::Tensor divisor = torch::where(ex.scale > 0, ex.scale, torch::ones_like(ex.scale)).unsqueeze(1);
    const torch::Tensor q = xb.div(divisor).round().clamp(-127, 127).to(torch::kInt8);
    put(error_, p, (xb - q.to(torch::kFloat32) * ex.scale.unsqueeze(1)).view({-1}).narrow(0, 0, n));
    ex.wire = q.view({-1});
    ex.all_q = torch::empty({islands * blocks * kInt8Block}, q.options());
    ex.all_scale = torch::empty({islands * blocks}, ex.scale.options());
    bytes_ += static_cast<uint64_t>(q.nbytes() + ex.scale.nbytes());
    ex.works.push_back(islands_.all_gather_async(ex.wire, ex.all_q));
    ex.works.push_back(islands_.all_gather_async(ex.scale, ex.all_scale));
  } else {
    ex.wire = cfg_.dtype == "bf16" ? delta.to(torch::kBFloat16) : delta;
    bytes_ += static_cast<uint64_t>(ex.wire.nbytes());
    ex.works.push_back(islands_.all_reduce_async(ex.wire, ReduceOp::avg));
  }
  pending_.push_back(std::move(ex));
}

void Diloco::complete(Exchange& ex) {
  if (ex.mean.defined()) return;
  {
    Watchdog::Scope watch("wait(diloco exchange)");
    for (auto& w : ex.works) w->wait();
  }
  ex.works.clear();
  if (cfg_.dtype == "int8") {
    const int64_t islands = islands_.size(), blocks = ex.scale.numel();
    const int64_t n = count(ranges(ex.fragment, begin_, begin_ + length_));
    torch::Tensor sum = torch::zeros({blocks, kInt8Block}, torch::dtype(torch::kFloat32).device(ex.scale.device()));
    const torch::Tensor qs = ex.all_q.view({islands, blocks, kInt8Block}), ss = ex.all_scale.view({islands, blocks, 1});
    for (int64_t i = 0; i < islands; ++i) sum.add_(qs[i].to(torch::kFloat32) * ss[i]);  // island order
    ex.mean = sum.div_(static_cast<double>(islands)).view({-1}).narrow(0, 0, n);
  } else {
    ex.mean = ex.wire.to(torch::kFloat32);
  }
  ex.wire = ex.scale = ex.all_q = ex.all_scale = torch::Tensor();
}

void Diloco::apply(Exchange& ex, bool mixing) {
  complete(ex);
  const int64_t p = ex.fragment;
  torch::Tensor outer = take(outer_, p), momentum = take(momentum_, p);
  // Nesterov SGD as torch.optim.SGD(momentum=mu, nesterov=True): m = mu m + delta; step delta + mu m.
  momentum.mul_(cfg_.outer_momentum).add_(ex.mean);
  outer.add_(ex.mean.add(momentum, cfg_.outer_momentum), -cfg_.outer_lr);
  put(momentum_, p, momentum);
  put(outer_, p, outer);
  torch::Tensor next = outer;
  if (mixing && cfg_.overlap > 0 && cfg_.mix > 0)  // the tau steps trained meanwhile count too
    next = take_slots(p).mul_(cfg_.mix).add_(outer, 1.0 - cfg_.mix);
  write_fragment(p, next);
  ++outer_steps_;
}

void Diloco::progress_start() {
  if (!poll_ || poller_.joinable()) return;
  poll_stop_ = false;
  poller_ = std::thread([this] {
    while (!poll_stop_.load()) {
      for (auto& ex : pending_)
        for (auto& w : ex.works) w->progress();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}

void Diloco::progress_stop() {
  if (!poller_.joinable()) return;
  poll_stop_ = true;
  poller_.join();
}

std::string Diloco::describe(int64_t total_params) const {
  const MeshLayout& l = mesh_.layout();
  const double per_value = cfg_.dtype == "int8" ? 1.0 + 4.0 / kInt8Block : cfg_.dtype == "bf16" ? 2 : 4;
  const double mib = static_cast<double>(length_) * per_value / (1 << 20);
  const std::string streaming =
      cfg_.fragments == 1 && cfg_.overlap == 0
          ? std::string()
          : concat("; streaming: ", cfg_.fragments, " fragments (blocks L mod ", cfg_.fragments, "), one synced every ",
                   static_cast<double>(cfg_.inner_steps) / static_cast<double>(cfg_.fragments), " steps",
                   cfg_.overlap > 0 ? concat(", each applied ", cfg_.overlap, " steps after it starts (mix ", cfg_.mix, ")")
                                    : std::string(" (blocking)"));
  return concat("diloco: ", l.islands, " islands of ", l.island_size(), " ranks; an outer step every ",
                cfg_.inner_steps, " steps and after the last (Nesterov SGD, lr ", cfg_.outer_lr, ", momentum ",
                cfg_.outer_momentum, "); ", cfg_.dtype, " on the wire: ", mib, " MiB per rank per outer step (",
                length_, " of the model's ", total_params, " values", chunked_ ? concat(", 1/", l.dp, " each") : "",
                ")", streaming, "; theta_outer and its momentum: ", 2.0 * static_cast<double>(length_) * 4 / (1 << 20),
                " MiB per rank");
}

// ---- checkpoints -------------------------------------------------------------------------------

std::string Diloco::state_dir(const std::string& checkpoint_path) {
  const std::string stem = checkpoint_path.size() > 3 && checkpoint_path.compare(checkpoint_path.size() - 3, 3, ".h5") == 0
                               ? checkpoint_path.substr(0, checkpoint_path.size() - 3)
                               : checkpoint_path;
  return stem + ".diloco";
}

std::string Diloco::file_of(const std::string& dir, int rank) const {
  char name[32];
  std::snprintf(name, sizeof name, "/rank-%05d.h5", rank);
  return dir + name;
}

void Diloco::save(const std::string& dir, int64_t step, int64_t keep) {
  torch::NoGradGuard no_grad;
  progress_stop();  // the exchanges in flight complete (their means are saved, applied when due)
  for (auto& ex : pending_) complete(ex);
  const MeshLayout& l = mesh_.layout();
  const std::string path = file_of(dir, mesh_.rank()), tmp = path + ".tmp";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  try {
    {
      h5::File file = h5::create(tmp);
      const hid_t root = file.get();
      h5::set_attr(root, "format", std::string(kStateFormat));
      h5::set_attr(root, "version", kStateVersion);
      h5::set_attr(root, "step", step);
      h5::set_attr(root, "rank", static_cast<int64_t>(mesh_.rank()));
      h5::set_attr(root, "layout", diloco_layout(l.world, l.islands, l.dp, l.tp, zero_));
      h5::set_attr(root, "outer_steps", outer_steps_);
      write_vector(root, "outer", outer_);
      write_vector(root, "momentum", momentum_);
      if (error_.defined()) write_vector(root, "int8_error", error_);
      if (island_state_.defined()) write_vector(root, "island_state", island_state_.reshape({-1}).to(torch::kFloat32));
      h5::set_attr(root, "fragments", cfg_.fragments);
      h5::set_attr(root, "exchanges", static_cast<int64_t>(pending_.size()));
      for (size_t i = 0; i < pending_.size(); ++i) {
        write_vector(root, concat("exchange_", i), pending_[i].mean);
        h5::set_attr(root, concat("exchange_", i, "_fragment"), pending_[i].fragment);
        h5::set_attr(root, concat("exchange_", i, "_due"), pending_[i].due);
      }
      if (writes_inner()) {
        h5::set_attr(root, "adamw_steps", opt_.steps_taken());
        std::vector<torch::Tensor> m, v;
        for (size_t i = 0; i < opt_.size(); ++i) {
          m.push_back(opt_.exp_avg(i));
          v.push_back(opt_.exp_avg_sq(i));
        }
        write_vector(root, "slots", flat());
        write_vector(root, "exp_avg", flat_of(m));
        write_vector(root, "exp_avg_sq", flat_of(v));
      }
    }
    fsync_path(tmp);
    rename_durably(tmp, path, dir);
  } catch (const std::exception& e) {
    std::filesystem::remove(tmp, ec);
    throw UsageError(concat(path, ": cannot write this rank's DiLoCo state (", e.what(), "); checkpoint.dir"));
  }
  // This rank's files of older state directories (each rank its own: without a shared filesystem
  // each host has its ranks' files).
  const std::filesystem::path parent = std::filesystem::path(dir).parent_path();
  std::vector<std::string> dirs;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() == 19 && name.rfind("ckpt-", 0) == 0 && name.compare(13, 6, ".diloco") == 0) dirs.push_back(name);
  }
  std::sort(dirs.begin(), dirs.end());  // ckpt-<8 digits>: by step
  for (size_t i = 0; i + static_cast<size_t>(keep) + 1 < dirs.size(); ++i) {
    const std::string old = (parent / dirs[i]).string();
    if (old == dir) continue;
    std::filesystem::remove(file_of(old, mesh_.rank()), ec);
    std::filesystem::remove(old, ec);  // only once empty: the last rank's removal takes it
  }
}

void Diloco::load(const std::string& dir, int64_t step) {
  torch::NoGradGuard no_grad;
  const MeshLayout& l = mesh_.layout();
  const std::string path = file_of(dir, mesh_.rank());
  const std::string layout = diloco_layout(l.world, l.islands, l.dp, l.tp, zero_);
  torch::Tensor slots, m, v;
  int64_t adamw_steps = 0;
  // Every rank reads its file first and they agree (a missing or wrong file on any rank ends
  // every rank, named once), before the broadcasts below.
  agree(mesh_.world_mpi(), [&] {
    if (!std::filesystem::exists(path))
      throw UsageError(concat(path, ": missing: this rank's DiLoCo state for the checkpoint it resumes (rank ",
                              mesh_.rank(), " writes it there; without a shared filesystem, on its own host)"));
    h5::File file = h5::open_read(path);
    const hid_t root = file.get();
    if (h5::get_attr_string(root, "format").value_or("") != kStateFormat ||
        h5::get_attr_int(root, "version").value_or(0) != kStateVersion)
      throw UsageError(concat(path, ": not a DiLoCo state file of this version (format ", kStateFormat, " ",
                              kStateVersion, ")"));
    if (h5::get_attr_int(root, "step").value_or(-1) != step)
      throw UsageError(concat(path, ": holds step ", h5::get_attr_int(root, "step").value_or(-1),
                              ", the checkpoint resumed is of step ", step));
    const std::string written = h5::get_attr_string(root, "layout").value_or("?");
    if (written != layout)
      throw UsageError(concat(path, ": written by a run of ", written, "; this run is ", layout,
                              ": a DiLoCo checkpoint resumes in the layout that wrote it (parallel.islands, parallel.tp, "
                              "optim.zero and the world size)"));
    outer_.copy_(read_vector(root, path, "outer", length_));
    momentum_.copy_(read_vector(root, path, "momentum", length_));
    if (error_.defined()) error_.copy_(read_vector(root, path, "int8_error", length_));
    if (island_state_.defined() && h5::exists(root, "island_state"))
      island_state_ = read_vector(root, path, "island_state", island_state_.numel()).view(island_state_.sizes()).clone();
    outer_steps_ = h5::get_attr_int(root, "outer_steps").value_or(0);
    // Exchanges in flight when it was written: applied after the steps they were due.
    const int64_t exchanges = h5::get_attr_int(root, "exchanges").value_or(0);
    const int64_t fragments = h5::get_attr_int(root, "fragments").value_or(1);
    if (exchanges < 0 || exchanges > fragments)
      throw UsageError(concat(path, ": attribute exchanges = ", exchanges, " is not in [0, ", fragments, "]"));
    if (exchanges > 0 && fragments != cfg_.fragments)
      throw UsageError(concat(path, ": written with diloco.fragments ", fragments, " and ", exchanges,
                              " exchange(s) in flight; this run has diloco.fragments ", cfg_.fragments,
                              ": resume with diloco.fragments ", fragments));
    pending_.clear();
    for (int64_t i = 0; i < exchanges; ++i) {
      Exchange ex;
      ex.fragment = h5::get_attr_int(root, concat("exchange_", i, "_fragment")).value_or(-1);
      ex.due = h5::get_attr_int(root, concat("exchange_", i, "_due")).value_or(-1);
      if (ex.fragment < 0 || ex.fragment >= fragments || ex.due <= step)
        throw UsageError(concat(path, ": exchange_", i, " has fragment ", ex.fragment, " due after step ", ex.due,
                                " (not a fragment in flight after step ", step, ")"));
      const int64_t n = count(ranges(ex.fragment, begin_, begin_ + length_));
      ex.mean = read_vector(root, path, concat("exchange_", i), n).to(outer_.device());
      pending_.push_back(std::move(ex));
    }
    if (writes_inner()) {
      adamw_steps = h5::get_attr_int(root, "adamw_steps").value_or(-1);
      if (adamw_steps < 0) throw UsageError(concat(path, ": no attribute adamw_steps"));
      slots = read_vector(root, path, "slots", total_);
      m = read_vector(root, path, "exp_avg", total_);
      v = read_vector(root, path, "exp_avg_sq", total_);
    }
  });
  if (chunked_) {  // the first rank of the dp group read them: to the others
    if (!writes_inner()) {
      slots = torch::empty({total_}, torch::kFloat32);
      m = torch::empty({total_}, torch::kFloat32);
      v = torch::empty({total_}, torch::kFloat32);
    }
    torch::Tensor steps = torch::tensor({adamw_steps}, torch::kInt64);
    const auto device = slots_.empty() ? torch::Device(torch::kCPU) : slots_.front().device();
    for (torch::Tensor* t : {&slots, &m, &v}) {
      torch::Tensor on = t->to(device);
      mesh_.dp().broadcast(on, 0);
      *t = on.to(torch::kCPU);
    }
    mesh_.dp().broadcast(steps, 0);
    adamw_steps = steps.item<int64_t>();
  }
  int64_t at = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int64_t n = slots_[i].numel();
    slots_[i].detach().copy_(slots.narrow(0, at, n).view(slots_[i].sizes()));
    opt_.exp_avg(i).copy_(m.narrow(0, at, n).view(opt_.exp_avg(i).sizes()));
    opt_.exp_avg_sq(i).copy_(v.narrow(0, at, n).view(opt_.exp_avg_sq(i).sizes()));
    at += n;
  }
  opt_.set_steps_taken(adamw_steps);
}

}  // namespace mpitrain
