// Text generation: autoregressive sampling with temperature and top-k, and `mpitrain sample`.
#include <cstdio>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/train.h"

namespace mpitrain {

std::vector<int64_t> generate(GPT& model, std::vector<int64_t> tokens, int64_t n, double temperature,
                              int64_t top_k, uint64_t seed) {
  MPITRAIN_CHECK(!tokens.empty(), "generate needs a non-empty prompt");
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  auto gen = at::detail::createCPUGenerator(seed);
  const torch::Device device = model->wte->weight.device();
  const int64_t ctx = model->dims().seq_len;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t from = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - ctx);
    torch::Tensor idx = torch::tensor(std::vector<int64_t>(tokens.begin() + from, tokens.end()), torch::kInt64)
                            .view({1, -1})
                            .to(device);
    torch::Tensor logits = model->forward(idx).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat32);
    logits = logits / temperature;
    if (top_k > 0 && top_k < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(top_k)).index({top_k - 1});
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    torch::Tensor probs = logits.softmax(-1);
    tokens.push_back(at::multinomial(probs, 1, false, gen).item<int64_t>());
  }
  if (was_training) model->train();
  return tokens;
}

std::string run_sample(const SampleArgs& args) {
  GPTDims dims = checkpoint_dims(args.checkpoint);
  GPT model(dims);
  TrainState st;
  load_checkpoint(args.checkpoint, model, nullptr, st);
  if (st.tokenizer != "byte")
    throw UsageError(concat(args.checkpoint, ": sampling text needs the byte tokenizer, this checkpoint uses '",
                         st.tokenizer, "'"));
  std::vector<int64_t> prompt{st.eot_token};
  for (unsigned char c : args.prompt) prompt.push_back(c);
  auto out = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed);
  std::string text;
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i] == st.eot_token) text += "\n<|endoftext|>\n";
    else if (out[i] < 256) text += static_cast<char>(out[i]);
  }
  return text;
}

}  // namespace mpitrain
