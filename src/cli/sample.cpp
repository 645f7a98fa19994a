// `mpitrain sample`: text from a checkpoint (see sample.h).
#include <cstdio>
#include <filesystem>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/sample.h"

namespace mpitrain {

std::string run_sample(const SampleArgs& args) {
  GPTDims dims = checkpoint_dims(args.checkpoint);
  GPT model(dims);
  TrainState st;
  load_checkpoint(args.checkpoint, model, static_cast<FullOptimState*>(nullptr), st);
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
