// `mpitrain sample`: text from a checkpoint (see sample.h).
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/sample.h"
#include "mpitrain/zero3.h"

namespace mpitrain {

namespace {

// `sample --stream`: a model made without values (GPT deferred) takes them from the checkpoint
// around their use: the layers outside the blocks once, each block before it runs, dropped after
// it ran. At most one block and those layers are in memory; every forward pass reads every
// block from the file again (the page cache permitting), each read verified.
class StreamedBlocks : public UnitHooks {
 public:
  // The blocks' parameters and the others: ZeRO-3's units (zero3.h).
  StreamedBlocks(GPT& model, CheckpointParams& file) : file_(file) {
    std::vector<std::string> names;
    for (const auto& [name, p] : model->named_params()) names.push_back(name), params_.push_back(p);
    units_ = model_units(names, model->dims().n_layer);
  }
  void need_outside_blocks() override {
    if (outside_loaded_) return;
    for (size_t k : units_.groups[units_.outside]) load(k);
    outside_loaded_ = true;
  }
  void need_block(int64_t block, bool /*backward*/) override {
    for (size_t k : block_params(block)) load(k);
  }
  void done_with_block(int64_t block) override {
    for (size_t k : block_params(block)) drop_param_values(params_[k]);
  }

 private:
  void load(size_t k) {
    torch::NoGradGuard no_grad;
    params_[k].set_data(file_.read(k));
  }
  const std::vector<size_t>& block_params(int64_t block) const {
    return units_.groups.at(units_.block_unit.at(static_cast<size_t>(block)));
  }
  CheckpointParams& file_;
  std::vector<torch::Tensor> params_;
  Units units_;
  bool outside_loaded_ = false;
};

}  // namespace

std::string run_sample(const SampleArgs& args) {
  GPTDims dims = checkpoint_dims(args.checkpoint);
  GPT model(dims, /*deferred=*/args.stream);
  TrainState st;
  std::optional<CheckpointParams> file;
  std::optional<StreamedBlocks> streamed;
  if (args.stream) {
    file.emplace(args.checkpoint, model, st);
    streamed.emplace(model, *file);
    model->set_unit_hooks(&*streamed);
  } else {
    load_checkpoint(args.checkpoint, model, static_cast<FullOptimState*>(nullptr), st);
  }
  if (st.routing_bias.defined()) model->set_routing_bias(st.routing_bias);  // as training chose experts
  if (st.tokenizer == "hf") {  // the prompt and the text through the checkpoint's own tokenizer.json
    HfTokenizer tok = checkpoint_tokenizer(st, args.tokenizer_file, args.checkpoint);
    std::vector<int64_t> prompt{st.eot_token};
    for (uint32_t id : tok.encode(args.prompt)) prompt.push_back(id);
    auto out = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed);
    return tok.detokenize(std::vector<uint32_t>(out.begin() + 1, out.end()));
  }
  if (st.tokenizer != "byte")
    throw UsageError(concat(args.checkpoint, ": sampling text needs the byte or a Hugging Face (hf) tokenizer, this "
                            "checkpoint uses '", st.tokenizer, "'"));
  std::vector<int64_t> prompt{st.eot_token};
  for (unsigned char c : args.prompt) prompt.push_back(c);
  auto out = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed);
  return decode_bytes(std::vector<int64_t>(out.begin() + 1, out.end()), st.eot_token);
}

HfTokenizer checkpoint_tokenizer(const TrainState& st, const std::string& override_path, const std::string& checkpoint) {
  const std::string path = override_path.empty() ? st.tokenizer_file : override_path;
  const char* flag = override_path.empty() ? "" : " (--tokenizer-file)";
  if (path.empty())
    throw UsageError(concat(checkpoint, ": names no tokenizer.json (shards packed before mpitrain recorded it): "
                            "give --tokenizer-file"));
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw UsageError(concat(checkpoint, ": its tokenizer.json '", path, "'", flag,
                            " is not there (pack read it from another directory?): give --tokenizer-file"));
  HfTokenizer tok(path);
  if (!st.tokenizer_sha256.empty() && tok.sha256() != st.tokenizer_sha256)
    throw UsageError(concat(path, flag, ": SHA-256 ", tok.sha256().substr(0, 12), ", but ", checkpoint,
                            " was trained on the ids of a tokenizer.json with ", st.tokenizer_sha256.substr(0, 12)));
  return tok;
}

}  // namespace mpitrain
