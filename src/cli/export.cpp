// `mpitrain export` (see export.h).
#include "mpitrain/export.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "mpitrain/bpe.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/model.h"
#include "mpitrain/sample.h"

namespace mpitrain {

std::string run_export(const ExportArgs& args) {
  namespace fs = std::filesystem;
  if (args.format != "hf") throw UsageError(concat("command line: --format ", args.format, ": only hf is known"));
  if (args.dtype != "fp32" && args.dtype != "bf16" && args.dtype != "fp16")
    throw UsageError(concat("command line: --dtype ", args.dtype, ": one of fp32|bf16|fp16"));
  // Another model's files in the directory are the user's: replaced only when told to.
  const std::vector<std::string> foreign = foreign_model_files(args.dir);
  if (!foreign.empty() && !args.overwrite) {
    std::string names;
    for (size_t i = 0; i < foreign.size() && i < 6; ++i) names += concat(i ? ", " : "", foreign[i]);
    if (foreign.size() > 6) names += concat(" and ", foreign.size() - 6, " more");
    throw UsageError(concat("command line: dir: ", args.dir, " holds another model's files (", names,
                            ") that the export would replace or remove: give --overwrite to replace them, or "
                            "export into a new directory"));
  }
  // Checkpoints hold whole tensors whatever the layout. The model is made without values and the
  // checkpoint streams through, one tensor in memory at a time: every tensor is read and verified
  // once before anything is written (a damaged checkpoint writes nothing), then again into the files.
  GPTDims dims = checkpoint_dims(args.checkpoint);
  GPT model(dims, /*deferred=*/true);
  TrainState st;
  CheckpointParams params(args.checkpoint, model, st);
  for (size_t k = 0; k < params.size(); ++k) params.read(k);
  // The tokenizer files first: a bad --bpe-dir leaves nothing written.
  std::optional<BpeFiles> bpe;
  if (!args.bpe_dir.empty()) {
    if (st.tokenizer != "gpt2")
      throw UsageError(concat("command line: --bpe-dir: ", args.checkpoint, " was trained on '", st.tokenizer,
                              "' tokens, not GPT-2 BPE"));
    bpe = find_bpe_files(args.bpe_dir);
    Gpt2Bpe check(*bpe);  // the same files pack reads: a broken pair fails here, naming the file
    if (check.vocab_size() > dims.vocab_size)
      throw UsageError(concat("command line: --bpe-dir: ", args.bpe_dir, " has ", check.vocab_size(),
                              " tokens, the model only ", dims.vocab_size));
  }
  // hf: the shards' tokenizer.json, checked against its recorded SHA-256 before anything is written.
  std::optional<HfTokenizer> hf_tokenizer;
  if (st.tokenizer == "hf") hf_tokenizer.emplace(checkpoint_tokenizer(st, args.tokenizer_file, args.checkpoint));
  HfWriteOptions opts;
  opts.dtype = args.dtype;
  if (args.max_shard_mb > 0) opts.max_shard_bytes = static_cast<uint64_t>(args.max_shard_mb * 1e6);
  const std::string files =
      write_hf_model(args.dir, model, st.eot_token, opts, [&](size_t k) { return params.read(k); });
  std::string replaced;
  if (!foreign.empty()) {
    for (const std::string& f : foreign) replaced += concat(replaced.empty() ? "" : ", ", f);
    replaced = concat("--overwrite: replaced or removed another model's ", replaced, " in ", args.dir, "\n");
  }
  const size_t shards = static_cast<size_t>(std::count(files.begin(), files.end(), '\n'));
  std::string out = concat(args.dir, "/", shards == 1 ? files.substr(0, files.size() - 1)
                                                       : concat("model-*-of-*.safetensors (", shards, " shards) + model.safetensors.index.json"),
                           " (", model->num_params(), " parameters, ", args.dtype, ", Hugging Face ",
                           dims.llama() ? "Llama" : "GPT-2", " names)\n", args.dir, "/config.json (",
                           hf_architecture(dims), ": ",
                           dims.n_layer, " layers, ", dims.n_head, " heads",
                           dims.llama() ? concat(" / ", dims.n_kv_head, " kv heads") : std::string(), ", width ", dims.n_embd,
                           ", context ", dims.llama() ? dims.max_position : dims.seq_len, ", vocab ", dims.vocab_size, ")\n");
  if (dims.llama()) out += concat(args.dir, "/generation_config.json\n");
  out += replaced;
  if (st.routing_bias.defined() && st.routing_bias.numel() > 0 && st.routing_bias.abs().max().item<double>() > 0)
    out += concat("note: ", args.checkpoint, "'s routing bias (train.moe_bias_update_rate; largest |bias| ",
                  st.routing_bias.abs().max().item<double>(), ") has no place in ", hf_architecture(dims),
                  "'s files: the exported model chooses its experts by the router's probabilities alone\n");
  if (bpe) {
    std::error_code ec;  // BpeFiles holds the two files' paths
    for (const auto& [from, to] : {std::pair{bpe->vocab, "vocab.json"}, std::pair{bpe->merges, "merges.txt"}})
      if (!fs::copy_file(from, fs::path(args.dir) / to, fs::copy_options::overwrite_existing, ec))
        throw UsageError(concat("cannot copy '", from, "' to '", args.dir, "/", to, "': ", ec.message()));
      else
        fsync_path((fs::path(args.dir) / to).string());
    write_file_durably((fs::path(args.dir) / "tokenizer_config.json").string(),
                       concat("{\n  \"tokenizer_class\": \"GPT2Tokenizer\",\n  \"model_max_length\": ", dims.seq_len,
                              ",\n  \"bos_token\": \"<|endoftext|>\",\n  \"eos_token\": \"<|endoftext|>\",\n",
                              "  \"unk_token\": \"<|endoftext|>\"\n}\n"));
    out += concat(args.dir, "/vocab.json, merges.txt, tokenizer_config.json (GPT2Tokenizer, from ", args.bpe_dir, ")\n");
  } else if (hf_tokenizer) {
    const HfTokenizer& tok = *hf_tokenizer;
    std::error_code ec;
    if (!fs::copy_file(tok.path(), fs::path(args.dir) / "tokenizer.json", fs::copy_options::overwrite_existing, ec))
      throw UsageError(concat("cannot copy '", tok.path(), "' to '", args.dir, "/tokenizer.json': ", ec.message()));
    fsync_path((fs::path(args.dir) / "tokenizer.json").string());
    const nlohmann::json special = tok.decode({static_cast<uint32_t>(st.eot_token)});
    write_file_durably((fs::path(args.dir) / "tokenizer_config.json").string(),
                       nlohmann::json{{"tokenizer_class", "PreTrainedTokenizerFast"},
                                      {"model_max_length", dims.llama() ? dims.max_position : dims.seq_len},
                                      {"bos_token", special},
                                      {"eos_token", special}}
                               .dump(2) + "\n");
    out += concat(args.dir, "/tokenizer.json (", tok.path(), ", SHA-256 ", tok.sha256().substr(0, 12),
                  "), tokenizer_config.json (PreTrainedTokenizerFast)\n");
  } else if (st.tokenizer == "gpt2") {
    out += "no tokenizer files: this checkpoint's tokens are GPT-2 BPE; --bpe-dir DIR copies vocab.json + merges.txt\n";
  } else {
    out += concat("no tokenizer files: this checkpoint's tokens are '", st.tokenizer, "' (byte values 0-255, end of text ",
                  st.eot_token, "), which Hugging Face has no tokenizer class for\n");
  }
  return out;
}

}  // namespace mpitrain
