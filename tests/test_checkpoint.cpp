// HDF5 checkpoints: bitwise round trip of model, optimizer and state; `latest` and keep-last-K;
// resume lookup; and the errors for wrong shapes, formats and corrupted data. Initial weights from
// .npy files (model.init_from): bitwise loads and one error per kind of bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>

#include "temp_dir.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/export.h"
#include "mpitrain/h5.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/host_memory.h"
#include "mpitrain/sample.h"
#include "mpitrain/tensor_io.h"
#include "npy_writer.h"

using namespace mpitrain;

namespace {

GPTDims dims() {
  GPTDims d;
  d.n_layer = 2;
  d.n_head = 2;
  d.n_embd = 16;
  d.seq_len = 8;
  d.vocab_size = 32;
  return d;
}

// A model and optimizer with non-trivial state: a few real steps.
struct Trained {
  GPT model{dims()};
  AdamW opt{model->named_params(), OptimConfig{}};
  explicit Trained(int seed, const OptimConfig& oc = OptimConfig{}) {
    torch::manual_seed(seed);
    model = GPT(dims());
    opt = AdamW(model->named_params(), oc);
    auto x = torch::randint(0, 32, {2, 8}, torch::kInt64);
    for (int i = 0; i < 3; ++i) {
      model->loss(x, x).backward();
      opt.step(1e-3);
      opt.zero_grad();
    }
  }
};

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::equal(a, b);
}

}  // namespace

TEST(Checkpoint, RoundTripRestoresEveryTensorBitwise) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 3;
  st.tokens_seen = 48;
  st.data_cursor = 6;
  st.world_size = 2;
  st.dp = 2;
  st.zero = 1;
  st.config_yaml = "model:\n  preset: tiny\n";
  st.eot_token = 31;
  st.rng_states = {{1, 2, 3}, {4, 5, 6}};
  const std::string path = save_checkpoint(dir, a.model, a.opt, st, 3);
  EXPECT_EQ(path, dir + "/ckpt-00000003.h5");

  Trained b(2);  // different weights and moments
  TrainState got;
  load_checkpoint(path, b.model, &b.opt, got);
  auto pa = a.model->named_params(), pb = b.model->named_params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bitwise_equal(pa[i].second, pb[i].second)) << pa[i].first;
  for (size_t i = 0; i < a.opt.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a.opt.exp_avg(i), b.opt.exp_avg(i))) << a.opt.name(i);
    EXPECT_TRUE(bitwise_equal(a.opt.exp_avg_sq(i), b.opt.exp_avg_sq(i))) << a.opt.name(i);
  }
  EXPECT_EQ(b.opt.steps_taken(), 3);
  EXPECT_EQ(got.step, 3);
  EXPECT_EQ(got.tokens_seen, 48);
  EXPECT_EQ(got.data_cursor, 6u);
  EXPECT_EQ(got.world_size, 2);
  EXPECT_EQ(got.config_yaml, st.config_yaml);
  EXPECT_EQ(got.eot_token, 31);
  EXPECT_EQ(got.rng_states, st.rng_states);
  EXPECT_EQ(got.loss_scale, 0.0);  // not an fp16 run: no scale stored
  EXPECT_EQ(checkpoint_dims(path).n_embd, 16);
  EXPECT_EQ(got.dp, st.dp);
  EXPECT_EQ(got.tp, st.tp);
  EXPECT_EQ(got.zero, st.zero);

  // A version 1 file (before the layout attributes) still loads, as plain data parallel.
  {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    h5::set_attr(f, "version", int64_t{1});
    for (const char* name : {"parallel_dp", "parallel_tp", "optim_zero"}) ASSERT_GE(H5Adelete(f, name), 0) << name;
    H5Fclose(f);
    Trained c(3);
    TrainState v1;
    load_checkpoint(path, c.model, &c.opt, v1);
    EXPECT_EQ(v1.dp, 2);  // = world_size
    EXPECT_EQ(v1.tp, 1);
    EXPECT_EQ(v1.zero, 0);
    for (size_t i = 0; i < a.opt.size(); ++i) EXPECT_TRUE(bitwise_equal(a.opt.exp_avg(i), c.opt.exp_avg(i)));
  }

  // An fp16 run's dynamic loss scale comes back with the state.
  st.step = 4;
  st.loss_scale = 8192.0;
  st.loss_scale_good_steps = 17;
  load_checkpoint(save_checkpoint(dir, a.model, a.opt, st, 3), b.model, &b.opt, got);
  EXPECT_EQ(got.loss_scale, 8192.0);
  EXPECT_EQ(got.loss_scale_good_steps, 17);
  std::system(("rm -rf " + dir).c_str());
}

// optim.state_dtype: bf16: the file holds the moments as fp32 (exactly their bf16 values, the format
// unchanged), which load back bitwise into bf16 moments, and into an fp32 run's as those values.
TEST(Checkpoint, Bf16MomentsRoundTripBitwiseAndLoadIntoFp32Moments) {
  const TempDir tmp;
  OptimConfig bf16;
  bf16.state_dtype = "bf16";
  Trained a(1, bf16);
  TrainState st;
  st.step = 3;
  st.world_size = 1;
  st.dp = 1;
  st.config_yaml = "model:\n  preset: tiny\n";
  st.eot_token = 31;
  const std::string path = save_checkpoint(tmp.path, a.model, a.opt, st, 3);
  Trained b(2, bf16), c(3);
  TrainState got;
  load_checkpoint(path, b.model, &b.opt, got);
  load_checkpoint(path, c.model, &c.opt, got);
  for (size_t i = 0; i < a.opt.size(); ++i) {
    ASSERT_EQ(b.opt.exp_avg(i).scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(bitwise_equal(a.opt.exp_avg(i), b.opt.exp_avg(i))) << a.opt.name(i);
    EXPECT_TRUE(bitwise_equal(a.opt.exp_avg_sq(i), b.opt.exp_avg_sq(i))) << a.opt.name(i);
    EXPECT_TRUE(bitwise_equal(a.opt.exp_avg(i).to(torch::kFloat32), c.opt.exp_avg(i))) << a.opt.name(i);
    EXPECT_TRUE(bitwise_equal(a.opt.exp_avg_sq(i).to(torch::kFloat32), c.opt.exp_avg_sq(i))) << a.opt.name(i);
  }
}

// `mpitrain export` streams the checkpoint: the model is made without values (GPT deferred) and
// each tensor is read, verified and written on its own, so the export never holds the whole model
// (counted by host_memory.h's allocation counter; the bound is derived from the shapes, and is
// below the model's size). The files hold the checkpoint's values. A checkpoint with a damaged
// tensor late in the file writes nothing: every tensor is verified before the first file is.
// `sample --stream` holds one block at a time and generates the text the loaded model does.
TEST(Checkpoint, ExportAndSampleStreamOneTensorAtATimeAndADamagedCheckpointWritesNothing) {
  count_cpu_allocations();
  const TempDir tmp;
  const std::string dir = tmp.path;
  GPTDims d = dims();
  d.n_layer = 8;
  d.n_embd = 32;
  torch::manual_seed(5);
  GPT model(d);
  {  // large weights: logits far apart, so that the sampled tokens depend on every weight
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : model->named_params()) p.mul_(20).add_(torch::randn_like(p).mul_(0.1));
  }
  AdamW opt(model->named_params(), OptimConfig{});
  TrainState st;
  st.step = 2;
  st.eot_token = 31;  // (the byte tokenizer's text: the prompt is this token alone)
  const std::string path = save_checkpoint(dir, model, opt, st, 3);
  int64_t whole = 0, outside = 0, largest_block = 0, largest = 0;
  std::map<std::string, int64_t> blocks;
  for (const auto& [name, p] : model->named_params()) {
    whole += p.nbytes();
    largest = std::max<int64_t>(largest, p.nbytes());
    if (name.rfind("h.", 0) == 0) blocks[name.substr(0, name.find('.', 2))] += p.nbytes();
    else outside += p.nbytes();
  }
  for (const auto& [b, bytes] : blocks) largest_block = std::max(largest_block, bytes);

  ExportArgs args;
  args.checkpoint = path;
  args.dir = dir + "/hf";
  reset_cpu_peak();
  const int64_t before = cpu_allocated_bytes();
  run_export(args);
  const int64_t peak = cpu_peak_allocated_bytes() - before;
  // Making the deferred model (the layers outside the blocks twice, one block), then per tensor:
  // the read, its converted copy and its transposed contiguous copy.
  const int64_t bound = 2 * outside + largest_block + 3 * largest;
  EXPECT_LE(peak, bound);
  EXPECT_LT(bound, whole) << "the bound says something";
  GPT back(d);
  load_hf_safetensors(args.dir, back);
  const auto want = model->named_params(), got = back->named_params();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(got[i].second, want[i].second)) << want[i].first;

  // `sample --stream`: the same text as sampling the loaded model, one block in memory at a time.
  SampleArgs sample;
  sample.checkpoint = path;
  sample.tokens = 12;
  sample.top_k = 1;
  const std::string loaded_text = run_sample(sample);
  EXPECT_GT(std::set<char>(loaded_text.begin(), loaded_text.end()).size(), 5u) << loaded_text;
  sample.stream = true;
  reset_cpu_peak();
  const int64_t before_sample = cpu_allocated_bytes();
  EXPECT_EQ(run_sample(sample), loaded_text);
  EXPECT_LE(cpu_peak_allocated_bytes() - before_sample, 2 * outside + largest_block + 3 * largest) << "sample --stream";

  // The last tensor's bytes changed behind its checksum: refused, and the earlier export stays.
  std::ifstream in(args.dir + "/model.safetensors", std::ios::binary);
  const std::string exported((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  {
    h5::silence_errors();
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    hid_t ds = H5Dopen2(f, "model/ln_f.bias", H5P_DEFAULT);
    std::vector<float> v(static_cast<size_t>(d.n_embd), 0.5f);
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    H5Fclose(f);
  }
  std::string error;
  try {
    run_export(args);
  } catch (const UsageError& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("model/ln_f.bias"), std::string::npos) << error;
  std::ifstream again(args.dir + "/model.safetensors", std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>()), exported);
  EXPECT_FALSE(std::ifstream(args.dir + "/model.safetensors.tmp").good());
  std::system(concat("rm -rf ", dir).c_str());
}

TEST(Checkpoint, LatestNamesNewestAndKeepLastK) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  for (int step : {10, 20, 30, 40}) {
    st.step = step;
    save_checkpoint(dir, a.model, a.opt, st, 2);
  }
  std::ifstream latest(dir + "/latest");
  std::string name;
  std::getline(latest, name);
  EXPECT_EQ(name, "ckpt-00000040.h5");
  EXPECT_NE(access((dir + "/ckpt-00000040.h5").c_str(), F_OK), -1);
  EXPECT_NE(access((dir + "/ckpt-00000030.h5").c_str(), F_OK), -1);
  EXPECT_EQ(access((dir + "/ckpt-00000020.h5").c_str(), F_OK), -1);
  EXPECT_EQ(access((dir + "/ckpt-00000010.h5").c_str(), F_OK), -1);
  EXPECT_EQ(access((dir + "/ckpt-00000040.h5.tmp").c_str(), F_OK), -1);

  CheckpointConfig cc;
  cc.dir = dir;
  EXPECT_EQ(find_resume_checkpoint(cc).value(), dir + "/ckpt-00000040.h5");
  cc.resume = "none";
  EXPECT_FALSE(find_resume_checkpoint(cc).has_value());
  cc.resume = dir + "/ckpt-00000030.h5";
  EXPECT_EQ(find_resume_checkpoint(cc).value(), cc.resume);
  cc.resume = dir + "/missing.h5";
  EXPECT_THROW(find_resume_checkpoint(cc), UsageError);
  cc.resume = "auto";
  cc.dir = dir + "/empty";
  EXPECT_FALSE(find_resume_checkpoint(cc).has_value());
  std::system(("rm -rf " + dir).c_str());
}

namespace {
std::string load_error(const std::string& path, GPTDims d) {
  GPT m(d);
  AdamW o(m->named_params(), OptimConfig{});
  TrainState st;
  try {
    load_checkpoint(path, m, &o, st);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// A model of `saved`'s dims, initialised differently, loads `path` and then equals `saved` bitwise.
void expect_loads_bitwise(const std::string& path, GPT& saved) {
  torch::manual_seed(6);
  GPT b(saved->dims());
  AdamW opt_b(b->named_params(), OptimConfig{});
  TrainState got;
  load_checkpoint(path, b, &opt_b, got);
  const auto pa = saved->named_params(), pb = b->named_params();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bitwise_equal(pa[i].second, pb[i].second)) << pa[i].first;
}
}  // namespace

namespace {
std::string dims_error(const std::string& path);
void set_int_attr(const std::string& path, const std::string& obj, const std::string& name, int64_t v);
}  // namespace

// A Qwen3-shaped Llama (heads of 16 at width 16, q/k norms) comes back bitwise with its shape;
// a model without the norms or with other heads is refused by name before a tensor is read.
TEST(Checkpoint, Qwen3ShapeRoundTripsAndIsRefusedByAnotherHeadSizeOrWithoutQkNorms) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  GPTDims d = dims();
  d.arch = "llama", d.n_kv_head = 1, d.intermediate_size = 24, d.max_position = 8;
  d.head_size = 16, d.qk_norm = true;
  torch::manual_seed(5);
  GPT a(d);
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : a->named_params())
      if (name.find("_norm.") != std::string::npos) p.uniform_(0.5, 1.5);
  }
  AdamW opt(a->named_params(), OptimConfig{});
  TrainState st;
  st.step = 1;
  const std::string path = save_checkpoint(dir, a, opt, st, 3);
  const GPTDims stored = checkpoint_dims(path);
  EXPECT_EQ(stored.head_dim(), 16);
  EXPECT_TRUE(stored.qk_norm);
  expect_loads_bitwise(path, a);
  GPTDims no_norms = d;
  no_norms.qk_norm = false;
  EXPECT_NE(load_error(path, no_norms).find("has qk_norm 1, the configured one 0 (model.qk_norm)"), std::string::npos);
  GPTDims narrow = d;
  narrow.head_size = 0;  // n_embd / n_head = 8
  EXPECT_NE(load_error(path, narrow).find("has head_dim 16, the configured one 8 (model.head_dim)"), std::string::npos);
  // The family is recorded (model_fields.h); a file without it (before model.family) has the family
  // its flags make, and one whose family contradicts its flags is refused naming the attribute.
  EXPECT_EQ(stored.family, "qwen3");
  auto with_family = [&](const char* family) {
    h5::silence_errors();
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    EXPECT_GE(f, 0);
    if (family) h5::set_attr(f, "family", std::string(family));
    else EXPECT_GE(H5Adelete(f, "family"), 0);
    H5Fclose(f);
  };
  with_family(nullptr);
  EXPECT_EQ(checkpoint_dims(path).family, "qwen3");
  expect_loads_bitwise(path, a);
  with_family("qwen2");
  EXPECT_NE(dims_error(path).find("attribute 'qkv_bias' does not fit attribute 'family' (qwen2)"), std::string::npos)
      << dims_error(path);
  with_family("gemma");
  EXPECT_NE(dims_error(path).find("attribute 'family' must be one of gpt2|llama|qwen2|qwen3|mistral|gemma2|gemma3|qwen3_moe|mixtral|olmoe, got 'gemma'"),
            std::string::npos)
      << dims_error(path);
  // A family's own field in another family's file is refused by name.
  with_family("qwen3");
  {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    h5::set_attr(f, "attn_softcap", 50.0);
    H5Fclose(f);
  }
  EXPECT_NE(dims_error(path).find("attribute 'attn_softcap' (50) is gemma2's only, not family qwen3's"), std::string::npos)
      << dims_error(path);
  std::system(("rm -rf " + dir).c_str());
}

// Gemma 2 (a window shorter than seq_len, soft caps, its query scale, four norms) comes back
// bitwise with its fields; a config with another cap is refused naming it; a gemma2 file with
// q/k norms is refused naming the attribute.
TEST(Checkpoint, Gemma2RoundTripsWithItsFields) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  GPTDims d = dims();
  d.family = "gemma2", d.arch = "llama", d.n_kv_head = 1, d.intermediate_size = 24, d.max_position = 8;
  d.sliding_window = 3, d.attn_softcap = 50, d.final_softcap = 30, d.query_pre_attn_scalar = 12;
  torch::manual_seed(6);
  GPT a(d);
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : a->named_params())
      if (name.find("norm") != std::string::npos || name.find("ln_") != std::string::npos) p.uniform_(-0.5, 0.5);
  }
  AdamW opt(a->named_params(), OptimConfig{});
  TrainState st;
  st.step = 1;
  const std::string path = save_checkpoint(dir, a, opt, st, 3);
  const GPTDims stored = checkpoint_dims(path);
  EXPECT_EQ(stored.family, "gemma2");
  EXPECT_EQ(stored.sliding_window, 3);
  EXPECT_EQ(stored.attn_softcap, 50.0);
  EXPECT_EQ(stored.final_softcap, 30.0);
  EXPECT_EQ(stored.query_pre_attn_scalar, 12.0);
  expect_loads_bitwise(path, a);
  GPTDims other_cap = d;
  other_cap.final_softcap = 20;
  EXPECT_NE(load_error(path, other_cap).find("has final_softcap 30, the configured one 20 (model.final_softcap)"),
            std::string::npos)
      << load_error(path, other_cap);
  set_int_attr(path, "/", "qk_norm", 1);
  EXPECT_NE(dims_error(path).find("attribute 'qk_norm' does not fit attribute 'family' (gemma2)"), std::string::npos)
      << dims_error(path);
  std::system(("rm -rf " + dir).c_str());
}

TEST(Checkpoint, BadCheckpointsAreUsageErrorsNamingFileAndDataset) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 1;
  const std::string path = save_checkpoint(dir, a.model, a.opt, st, 3);

  // Another architecture is refused by name, also where every tensor shape agrees (n_head) and
  // where the configured model is a prefix of the stored one (fewer layers).
  GPTDims wider = dims();
  wider.n_embd = 32;
  std::string e = load_error(path, wider);
  EXPECT_EQ(e, concat(path, ": the checkpoint's model has n_embd 16, the configured one 32 (model.n_embd); "
                            "a checkpoint resumes only the architecture it was saved from"));
  GPTDims heads = dims();
  heads.n_head = dims().n_head * 2;
  e = load_error(path, heads);
  EXPECT_NE(e.find(concat("has n_head ", dims().n_head, ", the configured one ", heads.n_head, " (model.n_head)")),
            std::string::npos) << e;
  if (dims().n_layer > 1) {
    GPTDims shallower = dims();
    shallower.n_layer = 1;
    e = load_error(path, shallower);
    EXPECT_NE(e.find("(model.n_layer)"), std::string::npos) << e;
  }
  GPTDims longer = dims();
  longer.seq_len *= 2;
  EXPECT_NE(load_error(path, longer).find("(model.seq_len)"), std::string::npos);

  // A NaN saved with a valid checksum (a diverged run) is refused, naming the dataset.
  const std::string nan_path = dir + "/nan.h5";
  std::system(concat("cp ", path, " ", nan_path).c_str());
  {
    h5::silence_errors();
    hid_t f = H5Fopen(nan_path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    hid_t ds = H5Dopen2(f, "model/ln_f.weight", H5P_DEFAULT);
    std::vector<float> v(static_cast<size_t>(dims().n_embd), 1.0f);
    v[3] = std::nanf("");
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    h5::set_attr(ds, "crc32", static_cast<int64_t>(h5::crc32(v.data(), v.size() * sizeof(float))));
    H5Dclose(ds);
    H5Fclose(f);
  }
  e = load_error(nan_path, dims());
  EXPECT_NE(e.find(concat(nan_path, ": dataset 'model/ln_f.weight' holds 1 non-finite value(s), the first nan at flat index 3")),
            std::string::npos) << e;

  // Corrupt one dataset's bytes behind the checksum's back.
  {
    h5::silence_errors();
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    hid_t ds = H5Dopen2(f, "model/ln_f.weight", H5P_DEFAULT);
    std::vector<float> v(16, 0.5f);
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    H5Fclose(f);
  }
  e = load_error(path, dims());
  EXPECT_NE(e.find("checksum mismatch in dataset 'model/ln_f.weight'"), std::string::npos) << e;

  // Not a checkpoint / wrong version / truncated / not HDF5.
  const std::string other = dir + "/other.h5";
  {
    h5::File f = h5::create(other);
    h5::set_attr(f.get(), "format", std::string("mpitrain-tokens"));
  }
  EXPECT_NE(load_error(other, dims()).find("attribute 'format'"), std::string::npos);
  {
    h5::File f = h5::create(other);
    h5::set_attr(f.get(), "format", std::string(kCheckpointFormat));
    h5::set_attr(f.get(), "version", int64_t{3});
  }
  EXPECT_NE(load_error(other, dims()).find("unsupported checkpoint version 3"), std::string::npos);
  std::ofstream(dir + "/text.h5") << "hello";
  EXPECT_NE(load_error(dir + "/text.h5", dims()).find("not an HDF5 file"), std::string::npos);
  st.step = 2;
  const std::string good = save_checkpoint(dir, a.model, a.opt, st, 3);
  ASSERT_EQ(truncate(good.c_str(), 4000), 0);
  e = load_error(good, dims());
  EXPECT_NE(e.find(good), std::string::npos) << e;
  std::system(("rm -rf " + dir).c_str());
}

// ---- nonsense in the training state's attributes ------------------------------------------------

namespace {
// Rewrites one integer attribute of `obj` ("/", "/train", "/optim") in the file.
void set_int_attr(const std::string& path, const std::string& obj, const std::string& name, int64_t v) {
  h5::silence_errors();
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t o = H5Oopen(f, obj.c_str(), H5P_DEFAULT);
  ASSERT_GE(o, 0);
  h5::set_attr(o, name, v);
  H5Oclose(o);
  H5Fclose(f);
}

std::string dims_error(const std::string& path) {
  try {
    checkpoint_dims(path);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Checkpoint, DeclaredDimsMustMatchTheStoredTensorsBeforeAnythingIsAllocated) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 1;
  const std::string path = save_checkpoint(dir, a.model, a.opt, st, 3);
  const GPTDims d = checkpoint_dims(path);
  EXPECT_EQ(d.n_layer, dims().n_layer);
  // A damaged attribute asking for a huge model is refused by the stored shapes, not by an OOM.
  set_int_attr(path, "/", "n_embd", int64_t{1} << 20);
  std::string e = dims_error(path);
  EXPECT_NE(e.find("dataset 'model/wte.weight' has shape"), std::string::npos) << e;
  EXPECT_NE(e.find("'vocab_size' and 'n_embd'"), std::string::npos) << e;
  set_int_attr(path, "/", "n_embd", d.n_embd);
  set_int_attr(path, "/", "seq_len", 1 << 30);
  EXPECT_NE(dims_error(path).find("'seq_len' and 'n_embd'"), std::string::npos) << dims_error(path);
  set_int_attr(path, "/", "seq_len", d.seq_len);
  set_int_attr(path, "/", "n_layer", 100000);
  e = dims_error(path);
  EXPECT_NE(e.find("missing dataset 'model/h.99999.attn.c_attn.weight'"), std::string::npos) << e;
  set_int_attr(path, "/", "n_layer", d.n_layer - 1);
  EXPECT_NE(dims_error(path).find("declares 1 layers, but the file holds more"), std::string::npos)
      << dims_error(path);
  set_int_attr(path, "/", "n_layer", d.n_layer);
  EXPECT_EQ(dims_error(path), "");
  std::system(("rm -rf " + dir).c_str());
}

// Mistral's window is part of the architecture: it comes back with the checkpoint, a model
// without it is refused by name; a window shorter than seq_len (it cuts the context) also comes
// back bitwise.
TEST(Checkpoint, MistralWindowRoundTripsAndIsPartOfTheArchitecture) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  GPTDims d = dims();
  d.arch = "llama", d.n_kv_head = 1, d.intermediate_size = 24, d.max_position = 64;
  d.sliding_window = d.seq_len;  // the whole context
  torch::manual_seed(5);
  GPT a(d);
  AdamW opt(a->named_params(), OptimConfig{});
  TrainState st;
  st.step = 1;
  const std::string path = save_checkpoint(dir, a, opt, st, 3);
  EXPECT_EQ(checkpoint_dims(path).sliding_window, d.seq_len);
  expect_loads_bitwise(path, a);
  GPTDims no_window = d;
  no_window.sliding_window = 0;
  EXPECT_NE(load_error(path, no_window).find(concat("has sliding_window ", d.seq_len,
                                                    ", the configured one 0 (model.sliding_window)")),
            std::string::npos)
      << load_error(path, no_window);
  GPTDims cutting = d;
  cutting.sliding_window = d.seq_len - 1;
  GPT b(cutting);
  AdamW opt_b(b->named_params(), OptimConfig{});
  const std::string path_b = save_checkpoint(dir + "/cut", b, opt_b, st, 3);
  EXPECT_EQ(checkpoint_dims(path_b).sliding_window, d.seq_len - 1);
  expect_loads_bitwise(path_b, b);
  std::system(("rm -rf " + dir).c_str());
}

TEST(Checkpoint, OutOfRangeStateAttributesAreUsageErrorsNamingFileAndAttribute) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 5;
  st.tokens_seen = 80;
  st.data_cursor = 10;
  st.world_size = 2;
  st.eot_token = 31;
  st.rng_states = {{1, 2}, {3, 4}};
  const std::string good = save_checkpoint(dir, a.model, a.opt, st, 100);
  const std::string bad = dir + "/bad.h5";
  struct Case {
    const char* obj;
    const char* attr;
    int64_t value;
    const char* message;  // what the one-line error says after "<file>: "
  };
  const Case cases[] = {
      {"/", "step", -1, "attribute 'step' must be >= 0, got -1"},
      {"/", "tokens_seen", -48, "attribute 'tokens_seen' must be >= 0, got -48"},
      {"/", "world_size", 0, "attribute 'world_size' must be between 1 and 2147483647, got 0"},
      {"/", "world_size", -2, "attribute 'world_size' must be between 1 and 2147483647, got -2"},
      {"/", "world_size", int64_t{1} << 40, "attribute 'world_size' must be between 1 and 2147483647"},
      {"/", "eot_token", -2, "attribute 'eot_token' must be between -1 and 31, got -2"},
      {"/", "eot_token", 32, "attribute 'eot_token' must be between -1 and 31, got 32"},
      {"/train", "data_cursor", -6, "attribute 'train/data_cursor' must be >= 0, got -6"},
      {"/optim", "steps_taken", -3, "attribute 'optim/steps_taken' must be >= 0, got -3"},
  };
  for (const Case& c : cases) {
    std::system(("cp " + good + " " + bad).c_str());
    set_int_attr(bad, c.obj, c.attr, c.value);
    const std::string e = load_error(bad, dims());
    EXPECT_EQ(e.rfind(bad + ": ", 0), 0u) << c.attr << ": " << e;
    EXPECT_NE(e.find(c.message), std::string::npos) << c.attr << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;  // one line
  }
  // Limits themselves are fine: step 0, eot_token -1 (none), world_size = rows of rng_states.
  std::system(("cp " + good + " " + bad).c_str());
  set_int_attr(bad, "/", "step", 0);
  set_int_attr(bad, "/", "eot_token", -1);
  EXPECT_EQ(load_error(bad, dims()), "");
  // A wrongly typed optional attribute is not silently replaced by its default.
  std::system(("cp " + good + " " + bad).c_str());
  {
    hid_t f = H5Fopen(bad.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    h5::set_attr(f, "eot_token", std::string("31"));
    h5::set_attr(f, "tokenizer", int64_t{3});
    H5Fclose(f);
  }
  EXPECT_NE(load_error(bad, dims()).find("attribute 'tokenizer' must be a string"), std::string::npos);
  // The dimensions `mpitrain sample` builds a model from.
  std::system(("cp " + good + " " + bad).c_str());
  set_int_attr(bad, "/", "n_layer", 0);
  EXPECT_NE(dims_error(bad).find("attribute 'n_layer' must be >= 1, got 0"), std::string::npos) << dims_error(bad);
  std::system(("cp " + good + " " + bad).c_str());
  set_int_attr(bad, "/", "n_head", 3);
  EXPECT_NE(dims_error(bad).find("attribute 'n_embd' must be divisible by 'n_head' (3), got 16"), std::string::npos)
      << dims_error(bad);
  std::system(("rm -rf " + dir).c_str());
}

// ---- asynchronous save ----------------------------------------------------------------------------

namespace {
// Every dataset of a checkpoint with its values and crc32, and every integer/string root, optim
// and train attribute: what two checkpoint files must share to be "the same checkpoint".
struct Contents {
  std::map<std::string, std::vector<uint8_t>> data;  // raw bytes, native type
  std::map<std::string, int64_t> ints;               // "<object>@<attr>"
  std::map<std::string, std::string> strings;
  bool operator==(const Contents& o) const { return data == o.data && ints == o.ints && strings == o.strings; }
};

struct Visit {
  Contents* c;
  std::string where;
};

herr_t collect_attr(hid_t obj, const char* name, const H5A_info_t*, void* op) {
  auto* v = static_cast<Visit*>(op);
  if (auto i = h5::get_attr_int(obj, name)) v->c->ints[v->where + "@" + name] = *i;
  else if (auto s = h5::get_attr_string(obj, name)) v->c->strings[v->where + "@" + name] = *s;
  return 0;
}

herr_t collect_link(hid_t root, const char* name, const H5L_info_t*, void* op) {
  Visit v{static_cast<Contents*>(op), name};
  hid_t o = H5Oopen(root, name, H5P_DEFAULT);
  if (o < 0) return -1;
  H5Aiterate2(o, H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_attr, &v);
  if (H5Iget_type(o) == H5I_DATASET) {
    hid_t type = H5Dget_type(o);
    hid_t native = H5Tget_native_type(type, H5T_DIR_ASCEND);
    std::vector<uint8_t> bytes(static_cast<size_t>(H5Dget_storage_size(o)));
    if (!bytes.empty()) H5Dread(o, native, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
    H5Tclose(native);
    H5Tclose(type);
    v.c->data[name] = std::move(bytes);
  }
  H5Oclose(o);
  return 0;
}

Contents read_contents(const std::string& path) {
  Contents c;
  h5::File f = h5::open_read(path);
  Visit root{&c, ""};
  H5Aiterate2(f.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_attr, &root);
  H5Lvisit(f.get(), H5_INDEX_NAME, H5_ITER_INC, collect_link, &c);
  return c;
}
}  // namespace

TEST(Checkpoint, AsyncSaveWritesTheSameCheckpointAsSyncAndSnapshotsBeforeReturning) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 4;
  st.tokens_seen = 64;
  st.data_cursor = 8;
  st.world_size = 2;
  st.config_yaml = "model:\n  preset: tiny\n";
  st.eot_token = 31;
  st.rng_states = {{1, 2, 3}, {4, 5, 6}};
  const std::string sync_path = save_checkpoint(dir + "/sync", a.model, a.opt, st, 3);

  // The values at save() time, then the live state changes at once while the write runs.
  std::vector<torch::Tensor> params_then, avg_then;
  for (auto& [name, p] : a.model->named_params()) params_then.push_back(p.detach().clone());
  for (size_t i = 0; i < a.opt.size(); ++i) avg_then.push_back(a.opt.exp_avg(i).clone());
  std::string async_path;
  {
    AsyncCheckpointWriter w(dir + "/async", 3);
    async_path = w.save(a.model, a.opt, st);
    EXPECT_EQ(async_path, dir + "/async/ckpt-00000004.h5");
    {
      torch::NoGradGuard no_grad;
      for (auto& [name, p] : a.model->named_params()) p.fill_(42.0f);
      for (size_t i = 0; i < a.opt.size(); ++i) a.opt.exp_avg(i).fill_(-7.0f);
      a.opt.set_steps_taken(99);
      st.step = 99;
      st.rng_states[0][0] = 77;
    }
    w.wait();
    EXPECT_EQ(w.saves(), 1);
  }
  ASSERT_EQ(access(async_path.c_str(), F_OK), 0);
  EXPECT_EQ(access((async_path + ".tmp").c_str(), F_OK), -1);
  std::ifstream latest(dir + "/async/latest");
  std::string name;
  std::getline(latest, name);
  EXPECT_EQ(name, "ckpt-00000004.h5");

  // Same datasets, values, CRCs and attributes (mpitrain_version included) as the sync save.
  const Contents s = read_contents(sync_path), as = read_contents(async_path);
  EXPECT_GT(s.data.size(), 10u);
  EXPECT_TRUE(s.data == as.data);
  EXPECT_TRUE(s.ints == as.ints);
  EXPECT_TRUE(s.strings == as.strings);
  EXPECT_EQ(as.ints.count("model/ln_f.weight@crc32"), 1u);

  // And it loads to the values of save() time, not the ones set after it returned.
  Trained b(2);
  TrainState got;
  load_checkpoint(async_path, b.model, &b.opt, got);
  auto pb = b.model->named_params();
  for (size_t i = 0; i < pb.size(); ++i) EXPECT_TRUE(bitwise_equal(pb[i].second, params_then[i])) << pb[i].first;
  for (size_t i = 0; i < b.opt.size(); ++i) EXPECT_TRUE(bitwise_equal(b.opt.exp_avg(i), avg_then[i]));
  EXPECT_EQ(b.opt.steps_taken(), 3);
  EXPECT_EQ(got.step, 4);
  EXPECT_EQ(got.rng_states[0][0], 1);
  std::system(("rm -rf " + dir).c_str());
}

TEST(Checkpoint, AsyncWriteFailureIsRethrownAtTheNextSaveOrWait) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 1;
  // A directory where the .tmp file should go: the HDF5 create fails on the writer thread.
  ASSERT_EQ(::mkdir((dir + "/ckpt-00000001.h5.tmp").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/ckpt-00000001.h5.tmp/x").c_str(), 0755), 0);  // not removable
  AsyncCheckpointWriter w(dir, 3);
  w.save(a.model, a.opt, st);  // returns at once; the failure comes later
  try {
    w.wait();
    ADD_FAILURE() << "wait() did not rethrow the write's failure";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt-00000001.h5.tmp: cannot write checkpoint"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(access((dir + "/ckpt-00000001.h5").c_str(), F_OK), -1);
  EXPECT_EQ(access((dir + "/latest").c_str(), F_OK), -1);
  w.wait();  // reported once

  // A failure surfaces at the next save() too, before anything else is written.
  w.save(a.model, a.opt, st);
  st.step = 2;
  EXPECT_THROW(w.save(a.model, a.opt, st), UsageError);
  EXPECT_EQ(access((dir + "/ckpt-00000002.h5").c_str(), F_OK), -1);
  // And then it works again.
  w.save(a.model, a.opt, st);
  w.wait();
  EXPECT_EQ(access((dir + "/ckpt-00000002.h5").c_str(), F_OK), 0);
  std::system(("rm -rf " + dir).c_str());
}

TEST(Checkpoint, SyncWriterWritesOnTheCallingThread) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  Trained a(1);
  TrainState st;
  st.step = 3;
  AsyncCheckpointWriter w(dir, 3, /*async=*/false);
  const std::string path = w.save(a.model, a.opt, st);
  EXPECT_EQ(access(path.c_str(), F_OK), 0);  // complete when save() returns
  w.wait();
  EXPECT_EQ(w.saves(), 1);
  std::system(("rm -rf " + dir).c_str());
}

// ---- model.init_from: initial weights from .npy files ----------------------------------------

namespace {
// One <name>.npy per parameter of `m`, in `descr` ('<f4' or '<f8').
// A new directory of `m`'s parameters as .npy files; the caller removes it.
std::string write_npy_dir(GPT& m, const std::string& descr = "<f4") {
  char tmpl[] = "/tmp/mpitrain-npy-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  for (const auto& [name, p] : m->named_params())
    npy_test::write_npy_tensor(dir + "/" + name + ".npy", p, descr);
  return dir;
}

bool same_params(GPT& a, GPT& b) {
  auto pa = a->named_params(), pb = b->named_params();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i)
    if (!bitwise_equal(pa[i].second, pb[i].second)) return false;
  return true;
}
}  // namespace

// Ranks writing their shares of a checkpoint hand write_tensors runs that start and end anywhere:
// each run lands at its offset byte for byte, whatever its alignment and size (under one block,
// a few blocks, several 16 MiB bounce buffers), and its CRC32 is that of its bytes. The CRC32s of
// consecutive runs combine into the CRC32 of the whole.
TEST(TensorIo, RunsAtAnyOffsetLandExactlyWithTheirCrc) {
  const TempDir tmp;
  const std::string path = tmp / "runs.bin";
  // Consecutive runs (offset, bytes): unaligned and aligned starts, under a block to 40 MB.
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (uint64_t n : {100, 4000, 8192, 3, 4089, 4096, 12345, 40000005, 4093, 65536})
    runs.emplace_back(runs.empty() ? 0 : runs.back().first + runs.back().second, n);
  const uint64_t size = runs.back().first + runs.back().second + 777;
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  { std::ofstream(path, std::ios::binary).write(std::string(size, '\0').data(), static_cast<std::streamsize>(size)); }
  std::vector<RawWrite> writes;
  for (auto [off, n] : runs) writes.push_back({bytes.data() + off, n, off});
  std::vector<size_t> seen;
  const auto crcs = write_tensors(path, writes, [&](size_t i) { seen.push_back(i); });
  ASSERT_EQ(crcs.size(), runs.size());
  EXPECT_EQ(seen.size(), runs.size());
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> back(size);
  in.read(reinterpret_cast<char*>(back.data()), static_cast<std::streamsize>(size));
  uint32_t whole = h5::crc32(nullptr, 0);
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto [off, n] = runs[i];
    EXPECT_EQ(crcs[i], h5::crc32(bytes.data() + off, n)) << "run " << i;
    EXPECT_EQ(0, std::memcmp(back.data() + off, bytes.data() + off, n)) << "run " << i << " at " << off;
    if (i + 1 < runs.size()) {
      ASSERT_EQ(off + n, runs[i + 1].first);
    }
    whole = h5::crc32_combine(whole, crcs[i], n);
  }
  EXPECT_EQ(whole, h5::crc32(bytes.data(), runs.back().first + runs.back().second));
  for (uint64_t i = runs.back().first + runs.back().second; i < size; ++i) ASSERT_EQ(back[i], 0) << "byte " << i;
  std::remove(path.c_str());
}

TEST(InitFrom, NpyWeightsLoadBitwiseFromFloat32AndFloat64AndRoundedFromFloat16) {
  torch::manual_seed(1);
  GPT a(dims());
  torch::manual_seed(2);
  GPT b(dims());
  ASSERT_FALSE(same_params(a, b));
  for (const char* descr : {"<f4", "<f8"}) {
    SCOPED_TRACE(descr);
    const std::string dir = write_npy_dir(a, descr);
    // numpy writes version 2.0 for headers over 64 KiB; any version is read the same.
    npy_test::write_npy_tensor(dir + "/ln_f.bias.npy", a->ln_f->bias, descr, 2);
    std::ofstream(dir + "/README.txt") << "other files are ignored";
    torch::manual_seed(2);
    GPT c(dims());
    EXPECT_EQ(load_npy_weights(dir, c), static_cast<int64_t>(a->named_params().size()));
    EXPECT_TRUE(same_params(a, c));
    std::system(("rm -rf " + dir).c_str());
  }
  const std::string dir = write_npy_dir(a);
  npy_test::write_npy_tensor(dir + "/wte.weight.npy", a->wte->weight, "<f2");
  GPT c(dims());
  load_npy_weights(dir, c);
  EXPECT_TRUE(bitwise_equal(c->wte->weight, a->wte->weight.to(torch::kHalf).to(torch::kFloat32)));
  EXPECT_FALSE(bitwise_equal(c->wte->weight, a->wte->weight));
  std::system(("rm -rf " + dir).c_str());
}

TEST(InitFrom, BadInputIsAUsageErrorNamingKeyAndFile) {
  torch::manual_seed(1);
  GPT a(dims());
  // Runs `spoil` on a good directory; the load must fail with one line "model.init_from: ..."
  // holding `want`, and leave the model as it was (all but NaN are found before any weight changes).
  auto expect_bad = [&](const std::string& what, const std::function<void(const std::string&)>& spoil,
                        const std::string& want, bool unchanged = true) {
    SCOPED_TRACE(what);
    const std::string dir = write_npy_dir(a);
    spoil(dir);
    torch::manual_seed(2);
    GPT b(dims());
    torch::manual_seed(2);
    GPT before(dims());
    std::string msg = "<no error>";
    try {
      load_npy_weights(dir, b);
    } catch (const UsageError& e) {
      msg = e.what();
    }
    EXPECT_EQ(msg.rfind("model.init_from: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg << "\nwanted: " << want;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    if (unchanged) {
      EXPECT_TRUE(same_params(b, before)) << "the model changed although the load failed";
    }
    std::system(("rm -rf " + dir).c_str());
  };
  using npy_test::write_npy_bytes;
  const std::string c_attn = "h.0.attn.c_attn.weight.npy";  // [48, 16]
  auto spoil_c_attn = [&](const std::string& dict, size_t bytes) {  // replaces c_attn's file
    return [=](const std::string& d) { write_npy_bytes(d + "/" + c_attn, dict, std::string(bytes, '\0')); };
  };
  auto c_attn_as = [&](const std::string& descr, const std::string& shape, size_t bytes) {
    return spoil_c_attn("{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }", bytes);
  };
  expect_bad("no directory", [](const std::string& d) { std::system(("rm -rf " + d).c_str()); },
             "no such directory '");
  expect_bad("a file, not a directory",
             [](const std::string& d) { std::system(("rm -rf " + d + " && touch " + d).c_str()); },
             "' is not a directory");
  expect_bad("missing file", [](const std::string& d) { std::remove((d + "/ln_f.bias.npy").c_str()); },
             "/ln_f.bias.npy (one <parameter name>.npy per model parameter)");
  expect_bad("files matching no parameter",
             [&](const std::string& d) {
               npy_test::write_npy_tensor(d + "/lm_head.weight.npy", a->wte->weight);
               std::rename((d + "/wpe.weight.npy").c_str(), (d + "/transformer.wpe.weight.npy").c_str());
             },
             "/transformer.wpe.weight.npy match no model parameter (a naming mistake?");
  expect_bad("bad magic", [&](const std::string& d) { std::ofstream(d + "/" + c_attn) << "PK\3\4 a zip"; },
             c_attn + ": not a .npy file (no \\x93NUMPY magic)");
  expect_bad("malformed header", spoil_c_attn("{'descr': '<f4', 'shape': 48}", 0),
             c_attn + ": malformed .npy header (shape is not a tuple): {'descr': '<f4', 'shape': 48}");
  expect_bad("integer dtype", c_attn_as("<i4", "(48, 16)", 48 * 16 * 4),
             c_attn + ": dtype '<i4', expected little-endian float32 '<f4' or float64 '<f8'");
  expect_bad("big-endian", c_attn_as(">f4", "(48, 16)", 48 * 16 * 4), c_attn + ": dtype '>f4'");
  expect_bad("fortran order",
             spoil_c_attn("{'descr': '<f4', 'fortran_order': True, 'shape': (48, 16), }", 48 * 16 * 4),
             c_attn + ": fortran_order is True, expected False");
  expect_bad("shape", c_attn_as("<f4", "(48, 8)", 48 * 8 * 4),
             c_attn + ": shape (48, 8), but parameter 'h.0.attn.c_attn.weight' has shape (48, 16)");
  expect_bad("transposed", c_attn_as("<f4", "(16, 48)", 48 * 16 * 4),
             "has shape (48, 16) (transposed? Hugging Face GPT-2's Conv1D weights need .T)");
  expect_bad("truncated data", c_attn_as("<f4", "(48, 16)", 48 * 16 * 4 - 4),
             c_attn + ": size 3196 bytes, but shape (48, 16) of '<f4' needs 3200 (truncated)");
  expect_bad("trailing data", c_attn_as("<f4", "(48, 16)", 48 * 16 * 4 + 8),
             c_attn + ": size 3208 bytes, but shape (48, 16) of '<f4' needs 3200 (trailing data)");
  expect_bad("NaN",
             [&](const std::string& d) {
               std::string data(48 * 16 * 4, '\0');
               const float nan = std::nanf("");
               std::memcpy(&data[4 * 17], &nan, 4);
               write_npy_bytes(d + "/" + c_attn, "{'descr': '<f4', 'fortran_order': False, 'shape': (48, 16), }",
                               data);
             },
             c_attn + ": holds NaN or infinite values", /*unchanged=*/false);
}
