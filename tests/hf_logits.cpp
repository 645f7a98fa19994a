// Test helper for tests/hf_export_test.sh: mpitrain's own logits for a checkpoint, to compare with
// a PyTorch GPT-2 written against Hugging Face's names running on the exported weights.
//   hf_logits CHECKPOINT.h5 OUT_DIR  ->  OUT_DIR/tokens.npy (float64 ids [2, T]) and logits.npy (float32 [2, T, V])
// The tokens are a fixed pseudo-random pattern over the whole vocabulary (T = the model's seq_len).
#include <cstdio>
#include <string>

#include "mpitrain/checkpoint.h"
#include "mpitrain/model.h"
#include "npy_writer.h"

int main(int argc, char** argv) {
  using namespace mpitrain;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CHECKPOINT.h5 OUT_DIR\n", argv[0]);
    return 2;
  }
  try {
    GPTDims dims = checkpoint_dims(argv[1]);
    GPT model(dims);
    TrainState st;
    load_checkpoint(argv[1], model, static_cast<FullOptimState*>(nullptr), st);
    model->eval();
    torch::NoGradGuard no_grad;
    torch::Tensor tokens = (torch::arange(2 * dims.seq_len, torch::kInt64) * 7919 + 13) % dims.classes();  // no padding ids
    tokens = tokens.view({2, dims.seq_len});
    torch::Tensor logits = model->forward(tokens).to(torch::kFloat32).contiguous();
    npy_test::write_npy_tensor(std::string(argv[2]) + "/tokens.npy", tokens, "<f8");  // exact below 2^53
    npy_test::write_npy_tensor(std::string(argv[2]) + "/logits.npy", logits);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_logits: %s\n", e.what());
    return 1;
  }
}
