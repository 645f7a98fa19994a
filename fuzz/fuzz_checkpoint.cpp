// libFuzzer target: HDF5 checkpoints (load_checkpoint, checkpoint_dims).
//
// Structure-aware: a valid checkpoint of a tiny GPT (1 layer, 1 head, width 4, seq_len 4,
// vocab 8) and its AdamW state is saved once with save_checkpoint. Each input is decoded
// (FuzzedDataProvider) into up to 6 MUTATIONS of a fresh copy, applied with the HDF5 API rather than
// as random bytes (HDF5 1.10 has known crashes on malformed metadata that are not ours to fix):
//   - rewrite or delete an attribute (format, version, step, n_embd, crc32, steps_taken, ...) with
//     an int64 / double / string / uint8-array value;
//   - delete a dataset or group;
//   - replace a dataset by one of another shape, type, layout or checksum, by a group, or by a
//     soft link (dangling or to another dataset);
//   - add unrelated attributes or datasets (harmless);
//   - flip bytes inside a dataset's raw data (located with H5Dget_offset/H5Dget_storage_size, so
//     only data changes: the CRC32 must catch it);
//   - truncate the file.
// Then load_checkpoint into a fresh-state model (+ AdamW, or none) and checkpoint_dims.
//
// Oracle: the only acceptable exception is mpitrain::UsageError; an unmodified or harmlessly
// modified checkpoint must load and give back every tensor bitwise (a change of the declared
// dims, n_head included, is not harmless: load_checkpoint refuses another architecture); a load
// into a model of other dimensions must fail; a load after flipping data bytes of a float32 (or
// the uint8 RNG) dataset that the load reads must fail; no HDF5 identifier is left open after an
// input.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <climits>
#include <sstream>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "harness.h"
#include "hdf5_ids.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_checkpoint";

namespace {

// ---- the fixed state: the scratch dir, the original checkpoint, the models -------------------

GPTDims tiny_dims() {
  GPTDims d;
  d.n_layer = 1;
  d.n_head = 1;
  d.n_embd = 4;
  d.seq_len = 4;
  d.vocab_size = 8;
  return d;
}

struct Object {
  std::string path;  // "/model/wte.weight"
  bool dataset = false;
  bool group = false;
  bool soft = false;
};

struct World {
  std::string dir;       // per-process scratch directory
  std::string original;  // the valid checkpoint's bytes
  std::string work;      // path of the copy each input mutates
  GPTDims dims = tiny_dims();
  std::vector<std::pair<std::string, torch::Tensor>> params;  // saved values (clones)
  std::vector<torch::Tensor> exp_avg, exp_avg_sq;
  int64_t steps_taken = 0;
  TrainState state;
  std::set<std::string> loaded;  // datasets load_checkpoint reads (with an optimizer)
  std::vector<Object> tree;       // the original file's links
  // The load targets: same dimensions, and other dimensions (n_layer 2).
  std::optional<GPT> same, other;
  std::optional<AdamW> same_opt, other_opt;
  Hdf5Ids ids;  // live HDF5 identifiers between inputs
};

World* g = nullptr;

std::vector<Object> objects(hid_t f);

void remove_scratch() {
  if (!g) return;
  for (const char* name : {"work.h5", "latest", "ckpt-00000007.h5"})
    std::remove((g->dir + "/" + name).c_str());
  ::rmdir(g->dir.c_str());
}

void setup() {
  torch::set_num_threads(1);
  h5::silence_errors();
  // Keep HDF5's freed blocks (see fuzz_shard.cpp): under ASan, fresh metadata caches per file
  // open otherwise dominate the run time.
  H5set_free_list_limits(64 << 20, 16 << 20, 64 << 20, 16 << 20, 64 << 20, 16 << 20);
  g = new World;
  g->dir = make_scratch_dir();
  std::atexit(remove_scratch);
  g->work = g->dir + "/work.h5";

  // A model and optimizer with non-trivial state: one real step.
  torch::manual_seed(1);
  GPT model(g->dims);
  AdamW opt(model->named_params(), OptimConfig{});
  auto x = torch::randint(0, g->dims.vocab_size, {2, g->dims.seq_len}, torch::kInt64);
  model->loss(x, x).backward();
  opt.step(1e-2);
  opt.zero_grad();

  g->state.step = 7;
  g->state.tokens_seen = 56;
  g->state.data_cursor = 14;
  g->state.world_size = 2;
  g->state.config_yaml = "model:\n  preset: custom\n";
  g->state.tokenizer = "byte";
  g->state.eot_token = 7;
  g->state.rng_states = {{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}};
  const std::string path = save_checkpoint(g->dir, model, opt, g->state, 1);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  g->original = bytes.str();

  for (auto& [name, p] : model->named_params()) {
    g->params.emplace_back(name, p.detach().clone());
    g->loaded.insert("/model/" + name);
  }
  for (size_t i = 0; i < opt.size(); ++i) {
    g->exp_avg.push_back(opt.exp_avg(i).clone());
    g->exp_avg_sq.push_back(opt.exp_avg_sq(i).clone());
    g->loaded.insert("/optim/" + opt.name(i) + "/exp_avg");
    g->loaded.insert("/optim/" + opt.name(i) + "/exp_avg_sq");
  }
  g->loaded.insert("/train/rng_states");
  g->steps_taken = opt.steps_taken();
  g->tree = objects(h5::open_read(path).get());

  g->same.emplace(g->dims);
  g->same_opt.emplace((*g->same)->named_params(), OptimConfig{});
  GPTDims other_dims = g->dims;
  other_dims.n_layer = 2;
  g->other.emplace(other_dims);
  g->other_opt.emplace((*g->other)->named_params(), OptimConfig{});

  // One load and one refused load first, so that whatever HDF5 registers lazily is in the
  // baseline of live IDs.
  TrainState st;
  load_checkpoint(path, *g->same, &*g->same_opt, st);
  checkpoint_dims(path);
  try {
    load_checkpoint(path, *g->other, &*g->other_opt, st);
  } catch (const UsageError&) {
  }
  g->ids = Hdf5Ids::now();
}

// ---- looking at the file -----------------------------------------------------------------------

// Every link in the file (once, for the original; the mutations then keep their own list up to
// date, which is much cheaper than walking the file after each one).
std::vector<Object> objects(hid_t f) {
  std::vector<Object> out;
  H5Lvisit(
      f, H5_INDEX_NAME, H5_ITER_INC,
      [](hid_t loc, const char* name, const H5L_info_t* info, void* op) -> herr_t {
        Object o;
        o.path = std::string("/") + name;
        o.soft = info->type != H5L_TYPE_HARD;
        if (!o.soft) {  // the header's basic info only: much cheaper than opening it
#if H5_VERSION_GE(1, 12, 0)
          H5O_info2_t oi;
          const herr_t rc = H5Oget_info_by_name3(loc, name, &oi, H5O_INFO_BASIC, H5P_DEFAULT);
#else
          H5O_info_t oi;
          const herr_t rc = H5Oget_info_by_name2(loc, name, &oi, H5O_INFO_BASIC, H5P_DEFAULT);
#endif
          if (rc >= 0) {
            o.dataset = oi.type == H5O_TYPE_DATASET;
            o.group = oi.type == H5O_TYPE_GROUP;
          }
        }
        static_cast<std::vector<Object>*>(op)->push_back(o);
        return 0;
      },
      &out);
  return out;
}

const Object* pick(FuzzedDataProvider& in, const std::vector<Object>& objs, bool datasets_only) {
  std::vector<const Object*> c;
  for (const Object& o : objs)
    if (!datasets_only || o.dataset) c.push_back(&o);
  if (c.empty()) return nullptr;
  return c[in.ConsumeIntegralInRange<size_t>(0, c.size() - 1)];
}

// ---- mutations ---------------------------------------------------------------------------------

// Everything the oracle needs to know about what was done.
struct Effects {
  bool any = false;           // anything changed at all
  bool harmful_load = false;  // load_checkpoint may (and usually must) fail now
  bool harmful_dims = false;  // checkpoint_dims may fail now
  bool data_changed = false;  // loaded values may differ from the saved ones even if it loads
  bool truncated = false;
  // Datasets whose stored checksum is now known NOT to match their data (bytes flipped, or the
  // crc32 attribute of an original dataset changed): a load that reads them must fail.
  std::set<std::string> must_detect;
  // Datasets replaced, relinked, deleted or with a rewritten checksum: nothing is known about
  // whether their checksum matches any more.
  std::set<std::string> modified;
  // The integer values n_head and n_embd now hold (checkpoint_dims wants n_embd % n_head == 0).
  int64_t n_head = 1, n_embd = 4;
  // Integer attributes whose last write is a value the readers must refuse (by name; a later
  // write of another kind, or a deletion, removes the entry: the outcome is then judged above).
  std::set<std::string> nonsense;

  void touch(const std::string& path) {
    must_detect.erase(path);
    modified.insert(path);
    // checkpoint_dims checks the declared dims against the stored /model tensors' shapes (wte,
    // wpe, the last layer) and that no further layer exists: any change under /model may fail it.
    if (path == "/model" || path.rfind("/model/", 0) == 0) harmful_dims = true;
  }
};

const int64_t kInterestingInts[] = {0, 1, -1, 2, 3, 4, 8, 7, 1LL << 31, 1LL << 32, INT64_MAX,
                                    INT64_MIN};

// Root attributes: the required integers of load_checkpoint, of checkpoint_dims, and the rest.
const char* const kLoadInts[] = {"step", "tokens_seen", "world_size"};
const char* const kDimsInts[] = {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"};
const char* const kOptional[] = {"config", "tokenizer", "eot_token", "mpitrain_version", "parallel_dp", "parallel_tp",
                                 "optim_zero"};

bool in_list(const std::string& s, std::initializer_list<const char*> l) {
  for (const char* x : l)
    if (s == x) return true;
  return false;
}

// Whether the readers accept the integer `v` as attribute `name` (the rules of load_checkpoint and
// checkpoint_dims): counts are >= 0, world_size is a possible MPI world size that has room for the
// 2 rows of train/rng_states, eot_token is -1 or a token of the 8-token vocabulary, dimensions
// are >= 1 (n_head and n_embd: their divisibility is checked at the end of mutate()). Attributes
// read as strings (config, tokenizer) are not integers; mpitrain_version and fuzz_extra are
// never read.
bool acceptable_int(const std::string& name, int64_t v) {
  if (name == "fuzz_extra" || name == "mpitrain_version") return true;
  if (name == "version") return v == kCheckpointVersion || v == 1;  // version 1 still loads
  if (in_list(name, {"parallel_dp", "parallel_tp"})) return v >= 1 && v <= INT32_MAX;
  if (name == "optim_zero") return v == 0 || v == 1;
  if (in_list(name, {"step", "tokens_seen", "steps_taken", "data_cursor"})) return v >= 0;
  if (name == "world_size") return v >= 2 && v <= INT32_MAX;
  if (name == "eot_token") return v >= -1 && v < 8;
  if (in_list(name, {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"})) return v >= 1;
  return false;  // format, config, tokenizer: strings
}

// Attributes that may be absent (or hold any string, for the string ones).
bool optional_attr(const std::string& name) {
  return in_list(name, {"fuzz_extra", "config", "tokenizer", "eot_token", "mpitrain_version", "parallel_dp",
                        "parallel_tp", "optim_zero"});
}


// Removes `path` and everything under it from the list.
void forget(std::vector<Object>& objs, const std::string& path) {
  objs.erase(std::remove_if(objs.begin(), objs.end(),
                            [&](const Object& o) {
                              return o.path == path || o.path.rfind(path + "/", 0) == 0;
                            }),
             objs.end());
}

void set_attr_op(FuzzedDataProvider& in, hid_t f, const std::vector<Object>& objs, Effects& fx) {
  // Where: the root (most often), /optim, /train, or a dataset's crc32.
  std::string obj_path = "/", name;
  const int where = in.ConsumeIntegralInRange<int>(0, 9);
  if (where <= 5) {
    static const std::vector<std::string> names = [] {
      std::vector<std::string> v{"format", "version", "fuzz_extra"};
      for (const char* n : kLoadInts) v.emplace_back(n);
      for (const char* n : kDimsInts) v.emplace_back(n);
      for (const char* n : kOptional) v.emplace_back(n);
      return v;
    }();
    name = names[in.ConsumeIntegralInRange<size_t>(0, names.size() - 1)];
  } else if (where == 6) {
    obj_path = "/optim", name = "steps_taken";
  } else if (where == 7) {
    obj_path = "/train", name = "data_cursor";
  } else {
    const Object* o = pick(in, objs, true);
    if (!o) return;
    obj_path = o->path, name = "crc32";
  }
  hid_t obj = H5Oopen(f, obj_path.c_str(), H5P_DEFAULT);
  if (obj < 0) return;

  // What: an integer, a double, a string, bytes, or nothing (delete).
  const int kind = in.ConsumeIntegralInRange<int>(0, 6);
  bool harmless = false;
  std::optional<int64_t> wrote_int;  // the value, when an integer was written
  try {
    switch (kind) {
      case 0:
      case 1: {
        std::optional<int64_t> old = h5::get_attr_int(obj, name);
        int64_t v = kind == 0 ? in.PickValueInArray(kInterestingInts)
                              : old.value_or(0) + in.ConsumeIntegralInRange<int64_t>(-1, 1);
        if (name == "crc32") harmless = old && *old == v;
        // checkpoint_dims compares these with the stored tensors' shapes, and load_checkpoint
        // with the model's dims (n_head too): only the same value is harmless.
        else if (in_list(name, {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"})) harmless = old && *old == v;
        else harmless = acceptable_int(name, v);  // an integer where one is expected, in range
        h5::set_attr(obj, name, v);
        if (name == "n_head") fx.n_head = v;
        if (name == "n_embd") fx.n_embd = v;
        wrote_int = v;
        note("attr " + obj_path + " " + name + " = " + std::to_string(v));
        break;
      }
      case 2: {
        double v = in.ConsumeFloatingPoint<double>();
        harmless = in_list(name, {"fuzz_extra", "mpitrain_version"});  // never read
        h5::set_attr(obj, name, v);
        note("attr " + obj_path + " " + name + " = (double)");
        break;
      }
      case 3:
      case 4: {
        std::string v = kind == 3 ? in.ConsumeRandomLengthString(40)
                                  : std::string(name == "format" ? kCheckpointFormat : "1");
        harmless = in_list(name, {"fuzz_extra", "config", "tokenizer", "mpitrain_version"}) ||
                   (name == "format" && v == kCheckpointFormat);
        h5::set_attr(obj, name, v);
        note("attr " + obj_path + " " + name + " = '" + v + "'");
        break;
      }
      case 5: {
        std::vector<uint8_t> v = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(1, 3));
        if (v.empty()) v.push_back(0);
        // A one-element uint8 array reads back as an integer.
        harmless = in_list(name, {"fuzz_extra", "mpitrain_version"}) ||
                   (v.size() == 1 && acceptable_int(name, v[0]));
        if (name == "crc32" || in_list(name, {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"})) {
          auto old = h5::get_attr_int(obj, name);  // (dims: compared with the stored shapes)
          harmless = v.size() == 1 && old && *old == v[0];
        }
        h5::set_attr(obj, name, v);
        if (v.size() == 1 && name == "n_head") fx.n_head = v[0];
        if (v.size() == 1 && name == "n_embd") fx.n_embd = v[0];
        if (v.size() == 1) wrote_int = v[0];
        note("attr " + obj_path + " " + name + " = bytes");
        break;
      }
      default:
        if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
        harmless = optional_attr(name);
        note("attr " + obj_path + " " + name + " deleted");
    }
  } catch (const Error&) {  // HDF5 refused to write it: nothing changed
  }
  H5Oclose(obj);
  fx.any = true;
  if (name != "crc32") {
    // world_size 1 is refused only because of train/rng_states' 2 rows: not nonsense by itself.
    const bool nonsense = wrote_int && !acceptable_int(name, *wrote_int) &&
                          !(name == "world_size" && *wrote_int == 1) &&
                          in_list(name, {"step", "tokens_seen", "world_size", "eot_token", "steps_taken",
                                         "data_cursor", "n_layer", "n_head", "n_embd", "seq_len",
                                         "vocab_size"});
    if (nonsense) fx.nonsense.insert(name);
    else fx.nonsense.erase(name);
  }
  // checkpoint_dims reads n_*; load_checkpoint reads them too (through checkpoint_dims, then
  // compared with the model's) and the rest.
  if (name == "crc32" && obj_path != "/") {
    if (!harmless && g->loaded.count(obj_path) && !fx.modified.count(obj_path)) {
      fx.modified.insert(obj_path);
      fx.must_detect.insert(obj_path);
    } else if (!harmless) {
      fx.touch(obj_path);
    }
  }
  const bool dims_attr = in_list(name, {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"});
  const bool shared = name == "format" || name == "version";
  if (!harmless) {
    if (dims_attr || shared) fx.harmful_dims = true;
    fx.harmful_load = true;
  }
}

// Writes a new dataset `path` (after deleting what was there) from the input's description.
// False if the old one is gone and no new one was made.
bool replace_dataset_op(FuzzedDataProvider& in, hid_t f, const Object& target, Effects& fx) {
  // The old contents, as float, and its shape, when it was a dataset.
  std::vector<hsize_t> old_dims;
  std::vector<float> old_vals;
  std::optional<int64_t> old_crc;
  const bool rng = target.path == "/train/rng_states";
  const bool was_original = !fx.modified.count(target.path);
  if (target.dataset) {
    h5::Dataset d(H5Dopen2(f, target.path.c_str(), H5P_DEFAULT));
    old_dims = h5::shape(d.get());
    uint64_t n = 1;
    for (hsize_t x : old_dims) n *= x;
    if (n <= (1u << 20)) {  // not an earlier replacement's huge extent
      old_vals.resize(n);
      try {
        if (n) h5::read(d.get(), H5T_NATIVE_FLOAT, old_vals.data());
      } catch (const UsageError&) {
        old_vals.clear();
      }
    }
    old_crc = h5::get_attr_int(d.get(), "crc32");
  }
  if (H5Ldelete(f, target.path.c_str(), H5P_DEFAULT) < 0) return true;
  fx.any = true;
  fx.touch(target.path);

  // Shape.
  std::vector<hsize_t> dims = old_dims;
  bool huge = false;
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 1: if (!dims.empty()) dims[0] += 1; break;
    case 2: if (!dims.empty() && dims[0] > 0) dims[0] -= 1; break;
    case 3: dims.push_back(1); break;
    case 4: if (!dims.empty()) dims.pop_back(); break;
    case 5: dims.assign(in.ConsumeIntegralInRange<size_t>(0, 3), in.ConsumeIntegralInRange<hsize_t>(0, 9)); break;
    case 6: if (!dims.empty()) dims.back() = 0; break;
    case 7:  // a large declared extent, never written: the file stays small
      huge = true;
      dims = {hsize_t{1} << in.ConsumeIntegralInRange<int>(8, 16), hsize_t{1} << in.ConsumeIntegralInRange<int>(8, 16)};
      break;
    default: break;  // same shape
  }
  // Type (file type; data is always written from native float).
  static hid_t (*const types[])() = {
      [] { return H5T_NATIVE_FLOAT; }, [] { return H5T_IEEE_F32BE; }, [] { return H5T_NATIVE_DOUBLE; },
      [] { return H5T_NATIVE_INT32; }, [] { return H5T_NATIVE_UINT8; },  [] { return H5T_NATIVE_INT64; }};
  const size_t type_index = in.ConsumeIntegralInRange<size_t>(0, std::size(types) - 1);
  const hid_t type = types[type_index]();
  const bool chunked = in.ConsumeIntegralInRange<int>(0, 3) == 0;
  uint64_t n = 1;
  for (hsize_t x : dims) n *= x;
  huge = huge || n > (1u << 20);  // e.g. the same shape as an earlier huge replacement
  const int data_mode = huge ? 3 : in.ConsumeIntegralInRange<int>(0, 3);  // 0 old, 1 input, 2 zeros, 3 none
  const int crc_mode = in.ConsumeIntegralInRange<int>(0, 3);  // 0 old, 1 correct, 2 none, 3 input

  std::vector<float> vals;
  if (data_mode != 3) {
    vals.resize(n);
    for (uint64_t i = 0; i < n; ++i)
      vals[i] = data_mode == 0 ? (i < old_vals.size() ? old_vals[i] : 0.0f)
                : data_mode == 1 ? static_cast<float>(in.ConsumeIntegral<int8_t>()) / 8
                                 : 0.0f;
  }
  h5::Dataspace space(dims.empty() ? H5Screate(H5S_SCALAR)
                                   : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  h5::PropList dcpl(H5Pcreate(H5P_DATASET_CREATE));
  if (chunked && !dims.empty() && n > 0) {
    std::vector<hsize_t> chunk(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) chunk[i] = std::max<hsize_t>(1, std::min<hsize_t>(dims[i], 64));
    H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data());
  }
  hid_t raw = H5Dcreate2(f, target.path.c_str(), type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT);
  if (raw < 0) {
    fx.harmful_load = fx.data_changed = true;
    return false;
  }
  h5::Dataset d(raw);
  if (data_mode != 3 && n > 0)
    H5Dwrite(d.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, vals.data());
  std::optional<int64_t> crc;
  if (crc_mode == 0) crc = old_crc;
  if (crc_mode == 1 && !huge) {  // the checksum of what the loader will read back
    std::vector<uint8_t> bytes(n * (rng ? 1 : 4));
    if (n == 0 || H5Dread(d.get(), rng ? H5T_NATIVE_UINT8 : H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL,
                          H5P_DEFAULT, bytes.data()) >= 0)
      crc = static_cast<int64_t>(h5::crc32(bytes.data(), bytes.size()));
  }
  if (crc_mode == 3) crc = in.ConsumeIntegral<uint32_t>();
  if (crc) h5::set_attr(d.get(), "crc32", *crc);

  // Identical contents in float32 of either byte order, same shape and checksum: a faithful
  // rewrite (e.g. by a big-endian writer), which must load.
  if (target.dataset && was_original && !rng && dims == old_dims && type_index <= 1 &&
      data_mode == 0 && crc_mode <= 1 && old_crc) {
    // harmless
  } else {
    fx.harmful_load = fx.data_changed = true;
  }
  note("replaced " + target.path + " (type " + std::to_string(type_index) + ", " +
       std::to_string(dims.size()) + "-D, " + std::to_string(n) + " elements, data " +
       std::to_string(data_mode) + ", crc " + std::to_string(crc_mode) + ")");
  return true;
}

void mutate(FuzzedDataProvider& in, Effects& fx, std::vector<Object>& objs,
            std::vector<std::pair<double, uint8_t>>* flips) {
  hid_t fid = H5Fopen(g->work.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (fid < 0) bug("cannot reopen the copy of the checkpoint");
  h5::File f(fid);
  const int ops = in.ConsumeIntegralInRange<int>(0, 6);
  note(std::to_string(ops) + " mutations");
  for (int op = 0; op < ops; ++op) {
    switch (in.ConsumeIntegralInRange<int>(0, 9)) {
      case 0:
      case 1:
        set_attr_op(in, f.get(), objs, fx);
        break;
      case 2: {  // delete a link
        const Object* o = pick(in, objs, false);
        if (!o || H5Ldelete(f.get(), o->path.c_str(), H5P_DEFAULT) < 0) break;
        note("deleted " + o->path);
        fx.any = fx.harmful_load = fx.data_changed = true;
        fx.touch(o->path);
        forget(objs, std::string(o->path));
        break;
      }
      case 3:
      case 4: {  // replace a dataset
        const Object* o = pick(in, objs, true);
        if (o && !replace_dataset_op(in, f.get(), *o, fx)) forget(objs, std::string(o->path));
        break;
      }
      case 5: {  // replace an object by a group, a dangling soft link, or a link to a dataset
        const Object* o = pick(in, objs, false);
        const Object* to = pick(in, objs, true);
        if (!o || H5Ldelete(f.get(), o->path.c_str(), H5P_DEFAULT) < 0) break;
        const std::string path = o->path, to_path = to ? to->path : "";
        fx.any = fx.harmful_load = fx.data_changed = true;
        fx.touch(path);
        forget(objs, path);
        Object now;
        now.path = path;
        switch (in.ConsumeIntegralInRange<int>(0, 2)) {
          case 0:
            if (H5Gclose(H5Gcreate2(f.get(), path.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)) < 0) break;
            now.group = true;
            objs.push_back(now);
            note("replaced " + path + " by a group");
            break;
          case 1:
            if (H5Lcreate_soft("/nowhere", f.get(), path.c_str(), H5P_DEFAULT, H5P_DEFAULT) < 0) break;
            now.soft = true;
            objs.push_back(now);
            note("replaced " + path + " by a dangling soft link");
            break;
          default:
            if (to_path.empty() || to_path == path ||
                H5Lcreate_soft(to_path.c_str(), f.get(), path.c_str(), H5P_DEFAULT, H5P_DEFAULT) < 0)
              break;
            now.soft = true;
            objs.push_back(now);
            note("replaced " + path + " by a soft link to " + to_path);
        }
        break;
      }
      case 6: {  // add something unrelated: harmless
        const float v = 1.5f;
        hsize_t one = 1;
        h5::Dataspace s(H5Screate_simple(1, &one, nullptr));
        const char* where = in.PickValueInArray({"/fuzz_extra", "/model/fuzz_extra", "/train/fuzz_extra"});
        hid_t d = H5Dcreate2(f.get(), where, H5T_NATIVE_FLOAT, s.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (d >= 0) {
          H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, &v);
          H5Dclose(d);
          Object o;
          o.path = where;
          o.dataset = true;
          objs.push_back(o);
          fx.any = true;
          note(std::string("added ") + where);
        }
        break;
      }
      case 7:
      case 8:  // flip raw data bytes (applied after closing, see below)
        flips->emplace_back(in.ConsumeProbability<double>(),
                            static_cast<uint8_t>(in.ConsumeIntegralInRange<int>(1, 255)));
        break;
      default:  // truncate at the end
        fx.truncated = true;
    }
  }
  if (fx.n_head >= 1 && fx.n_embd >= 1 && fx.n_embd % fx.n_head != 0) fx.harmful_dims = true;
  // load_checkpoint runs checkpoint_dims first: whatever may fail that may fail the load.
  if (fx.harmful_dims) fx.harmful_load = true;
}

// Flips bytes inside datasets' raw data: each flip picks a dataset (by the fraction) and a byte
// in its contiguous storage (chunked or unwritten ones are skipped).
void apply_flips(FuzzedDataProvider& in, const std::vector<Object>& objs,
                 const std::vector<std::pair<double, uint8_t>>& flips, Effects& fx) {
  std::vector<std::string> datasets;
  for (const Object& o : objs)
    if (o.dataset) datasets.push_back(o.path);
  if (datasets.empty()) return;
  struct Flip {
    std::string path;
    hsize_t at;
    uint8_t mask;
    bool checked;  // read by the load and checksummed bit-for-bit
  };
  std::vector<Flip> todo;
  {
    h5::File f = h5::open_read(g->work);
    for (const auto& [where, mask] : flips) {
      const std::string& path =
          datasets[std::min(datasets.size() - 1, static_cast<size_t>(where * datasets.size()))];
      hid_t raw = H5Dopen2(f.get(), path.c_str(), H5P_DEFAULT);
      if (raw < 0) continue;
      h5::Dataset d(raw);
      const haddr_t offset = H5Dget_offset(d.get());
      const hsize_t size = H5Dget_storage_size(d.get());
      if (offset == HADDR_UNDEF || size == 0) continue;
      h5::Datatype t(H5Dget_type(d.get()));
      const bool exact = (H5Tget_class(t.get()) == H5T_FLOAT && H5Tget_size(t.get()) == 4) ||
                         (path == "/train/rng_states" && H5Tget_class(t.get()) == H5T_INTEGER &&
                          H5Tget_size(t.get()) == 1);
      const hsize_t at = offset + in.ConsumeIntegralInRange<hsize_t>(0, size - 1);
      // Two flips of one byte could cancel out: keep the first.
      if (std::any_of(todo.begin(), todo.end(), [&](const Flip& t) { return t.at == at; })) continue;
      todo.push_back({path, at, mask, exact && g->loaded.count(path) > 0 && !fx.modified.count(path)});
    }
  }
  if (todo.empty()) return;
  const int fd = ::open(g->work.c_str(), O_RDWR);
  if (fd < 0) bug("cannot open the copy for flipping");
  for (const Flip& fl : todo) {
    unsigned char byte = 0;
    if (::pread(fd, &byte, 1, static_cast<off_t>(fl.at)) != 1) continue;
    byte ^= fl.mask;
    if (::pwrite(fd, &byte, 1, static_cast<off_t>(fl.at)) != 1) continue;
    fx.any = fx.data_changed = true;
    if (g->loaded.count(fl.path)) fx.harmful_load = true;
    if (fl.checked) fx.must_detect.insert(fl.path);
    note("flipped a byte of " + fl.path + (fl.checked ? "" : " (not checked bit-for-bit)"));
  }
  ::close(fd);
}

template <class Fn>
bool outcome(const char* what, Fn&& fn) {
  try {
    fn();
    note(std::string(what) + ": ok");
    return true;
  } catch (const UsageError& e) {
    note(std::string(what) + ": UsageError: " + e.what());
    return false;
  } catch (const std::exception& e) {
    bug(std::string(what) + " threw a non-UsageError exception: " + e.what());
  } catch (...) {
    bug(std::string(what) + " threw a non-std exception");
  }
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::equal(a, b);
}

}  // namespace

// Leaks inside HDF5 itself (its error paths on damaged files leak a few object-header blocks, e.g.
// H5Fopen -> H5G_mkroot when the root header lies past the end of the file) are HDF5's, not ours.
// Our own leaks of HDF5 handles are not hidden by this: those stay reachable through HDF5's ID
// tables and LeakSanitizer never reported them anyway.
extern "C" const char* __lsan_default_suppressions() { return "leak:libhdf5\n"; }

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setup();
  return 0;
}

namespace {

void run_one(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider in(bytes, size);
  {
    std::ofstream out(g->work, std::ios::binary | std::ios::trunc);
    out << g->original;
    if (!out.flush()) bug("cannot write the copy of the checkpoint");
  }

  Effects fx;
  std::vector<Object> objs = g->tree;
  std::vector<std::pair<double, uint8_t>> flips;
  mutate(in, fx, objs, &flips);
  if (!flips.empty()) apply_flips(in, objs, flips, fx);
  if (fx.truncated) {
    struct stat st {};
    ::stat(g->work.c_str(), &st);
    const off_t len = static_cast<off_t>(static_cast<uint64_t>(st.st_size) *
                                         in.ConsumeIntegral<uint16_t>() / 65536);
    if (::truncate(g->work.c_str(), len) != 0) bug("cannot truncate");
    fx.any = true;
    note("truncated to " + std::to_string(len) + " of " + std::to_string(st.st_size) + " bytes");
  }

  // Load into the same or other dimensions, with or without the optimizer.
  const bool other = in.ConsumeIntegralInRange<int>(0, 7) == 7;
  const bool with_opt = in.ConsumeIntegralInRange<int>(0, 3) != 3;
  GPT& model = other ? *g->other : *g->same;
  AdamW* opt = with_opt ? &(other ? *g->other_opt : *g->same_opt) : nullptr;
  TrainState st;
  const bool loaded = outcome("load_checkpoint", [&] { load_checkpoint(g->work, model, opt, st); });
  GPTDims dims;
  const bool got_dims = outcome("checkpoint_dims", [&] { dims = checkpoint_dims(g->work); });

  if (other && loaded) bug("a checkpoint loaded into a model of other dimensions");
  for (const std::string& name : fx.nonsense) {
    const bool dims_attr = in_list(name, {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"});
    if (loaded && !dims_attr && (opt || name != "steps_taken"))
      bug("load_checkpoint accepted the out-of-range attribute '" + name + "'");
    if (got_dims && dims_attr) bug("checkpoint_dims accepted the out-of-range attribute '" + name + "'");
  }
  if (got_dims && fx.n_head >= 1 && fx.n_embd % fx.n_head != 0)
    bug("checkpoint_dims accepted n_embd " + std::to_string(fx.n_embd) + " not divisible by n_head " +
        std::to_string(fx.n_head));
  if (!other && !fx.truncated && !fx.harmful_load && !loaded)
    bug(fx.any ? "a harmlessly modified checkpoint did not load" : "the unmodified checkpoint did not load");
  if (!fx.truncated && !fx.harmful_dims && !got_dims) bug("checkpoint_dims refused an intact header");
  if (loaded) {
    for (const std::string& p : fx.must_detect)
      if (opt || p.rfind("/optim/", 0) != 0)
        bug("load_checkpoint accepted " + p + ", whose crc32 does not match its data");
  }
  if (loaded && !fx.data_changed && !fx.truncated) {  // everything back, bit for bit
    auto params = model->named_params();
    for (size_t i = 0; i < params.size(); ++i)
      if (!bitwise_equal(params[i].second, g->params[i].second))
        bug("parameter " + params[i].first + " differs after the round trip");
    if (opt) {
      for (size_t i = 0; i < opt->size(); ++i)
        if (!bitwise_equal(opt->exp_avg(i), g->exp_avg[i]) || !bitwise_equal(opt->exp_avg_sq(i), g->exp_avg_sq[i]))
          bug("AdamW moments of " + opt->name(i) + " differ after the round trip");
    }
    if (!fx.any) {
      if (st.step != g->state.step || st.tokens_seen != g->state.tokens_seen ||
          st.data_cursor != g->state.data_cursor || st.world_size != g->state.world_size ||
          st.config_yaml != g->state.config_yaml || st.tokenizer != g->state.tokenizer ||
          st.eot_token != g->state.eot_token || st.rng_states != g->state.rng_states ||
          (opt && opt->steps_taken() != g->steps_taken))
        bug("training state differs after the round trip");
    }
  }
  if (got_dims && !fx.any) {
    if (dims.n_layer != g->dims.n_layer || dims.n_head != g->dims.n_head ||
        dims.n_embd != g->dims.n_embd || dims.seq_len != g->dims.seq_len ||
        dims.vocab_size != g->dims.vocab_size)
      bug("checkpoint_dims differs from the saved model's");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  run_one(bytes, size);
  if (std::string leaked = Hdf5Ids::now().grown_since(g->ids); !leaked.empty())
    bug("HDF5 identifiers left open after the input: " + leaked);
  return 0;
}
