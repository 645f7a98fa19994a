// HDF5 checkpoints: bitwise round trip of model, optimizer and state; `latest` and keep-last-K;
// resume lookup; and the errors for wrong shapes, formats and corrupted data.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"

using namespace mpitrain;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/mpitrain-ckpt-XXXXXX";
  return mkdtemp(tmpl);
}

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
  explicit Trained(int seed) {
    torch::manual_seed(seed);
    model = GPT(dims());
    opt = AdamW(model->named_params(), OptimConfig{});
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
  const std::string dir = temp_dir();
  Trained a(1);
  TrainState st;
  st.step = 3;
  st.tokens_seen = 48;
  st.data_cursor = 6;
  st.world_size = 2;
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
  EXPECT_EQ(checkpoint_dims(path).n_embd, 16);
  std::system(("rm -rf " + dir).c_str());
}

TEST(Checkpoint, LatestNamesNewestAndKeepLastK) {
  const std::string dir = temp_dir();
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
}  // namespace

TEST(Checkpoint, BadCheckpointsAreUsageErrorsNamingFileAndDataset) {
  const std::string dir = temp_dir();
  Trained a(1);
  TrainState st;
  st.step = 1;
  const std::string path = save_checkpoint(dir, a.model, a.opt, st, 3);

  GPTDims wider = dims();
  wider.n_embd = 32;
  std::string e = load_error(path, wider);
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("model/"), std::string::npos) << e;
  EXPECT_NE(e.find("shape"), std::string::npos) << e;

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
    h5::set_attr(f.get(), "version", int64_t{2});
  }
  EXPECT_NE(load_error(other, dims()).find("unsupported checkpoint version 2"), std::string::npos);
  std::ofstream(dir + "/text.h5") << "hello";
  EXPECT_NE(load_error(dir + "/text.h5", dims()).find("not an HDF5 file"), std::string::npos);
  st.step = 2;
  const std::string good = save_checkpoint(dir, a.model, a.opt, st, 3);
  ASSERT_EQ(truncate(good.c_str(), 4000), 0);
  e = load_error(good, dims());
  EXPECT_NE(e.find(good), std::string::npos) << e;
  std::system(("rm -rf " + dir).c_str());
}
