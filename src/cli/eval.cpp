// `mpitrain eval`: multiple-choice tasks on a checkpoint or a Hugging Face model (see sample.h).
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_config.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/mc_eval.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/sample.h"

namespace mpitrain {

std::string run_eval_command(const EvalArgs& args, MpiComm world) {
  // The model and its tokenizer; every rank reads them (a failure on any rank ends every rank).
  GPT model{nullptr};
  TextEncoder encode;
  std::vector<std::pair<TaskSpec, std::vector<McExample>>> tasks;
  agree(world, [&] {
    const std::string dir = hf_model_dir(args.model);
    if (!dir.empty()) {  // a Hugging Face directory, read as model.init_from reads it
      const Config cfg = parse_config(concat("model: {init_from: \"", args.model, "\"}\ndata: {train: [unused]}\n"
                                             "eval: {every: 0}\nsample: {tokens: 0}\n"),
                                      "eval", {}, /*read_hf_config=*/true);
      model = GPT(model_dims(cfg.model, cfg.model.init_vocab, 1));
      load_initial_weights(args.model, model, "eval");
      const std::string file = args.tokenizer_file.empty() ? dir + "/tokenizer.json" : args.tokenizer_file;
      if (!args.tokenizer_file.empty() || std::ifstream(file).good())  // (encoder_at: byte, a BPE directory or a file)
        encode = encoder_at(file);
      else
        throw UsageError(concat(args.model, ": no tokenizer.json: give --tokenizer-file FILE (or a GPT-2 BPE directory), "
                                "or --tokenizer-file byte for a byte-level model"));
    } else {
      model = GPT(checkpoint_dims(args.model));
      TrainState st;
      load_checkpoint(args.model, model, static_cast<FullOptimState*>(nullptr), st);
      if (st.routing_bias.defined()) model->set_routing_bias(st.routing_bias);  // as training chose experts
      if (args.tokenizer_file == "byte" || (st.tokenizer == "byte" && args.tokenizer_file.empty()))
        encode = byte_encoder();
      else if (!args.tokenizer_file.empty())
        encode = encoder_at(args.tokenizer_file);
      else if (st.tokenizer == "hf")
        encode = tokenizer_encoder(checkpoint_tokenizer(st, "", args.model).path());
      else
        throw UsageError(concat(args.model, ": trained on '", st.tokenizer, "' ids: give its --tokenizer-file (a GPT-2 BPE "
                                "directory or a tokenizer.json)"));
    }
    for (const std::string& spec : args.tasks) {
      TaskSpec t = parse_task_spec(spec, "--task");
      tasks.emplace_back(t, read_mc_task(t.file, t.limit));
    }
  });
  auto comm = make_mpi_communicator(world);
  const torch::Device cpu(torch::kCPU);
  std::string out;
  nlohmann::json scores = nlohmann::json::object();
  for (const auto& [spec, examples] : tasks) {
    const McResult r = score_mc(model, examples, encode, comm->rank(), comm->size(), *comm, cpu, Precision::fp32, args.rows);
    const double slowest = mpi::all_reduced(r.seconds, ReduceOp::max, world);
    char line[256];
    std::snprintf(line, sizeof line, "%s acc %.6f acc_norm %.6f examples %lld (%.1f examples/s on %d ranks)\n",
                  spec.name.c_str(), r.acc, r.acc_norm, static_cast<long long>(r.examples),
                  slowest > 0 ? static_cast<double>(r.examples) / slowest : 0.0, comm->size());
    out += line;
    scores[spec.name] = {{"acc", r.acc}, {"acc_norm", r.acc_norm}, {"examples", r.examples}, {"scores", r.scores}};
  }
  if (!args.scores.empty() && mpi::rank(world) == 0) {
    std::ofstream f(args.scores);
    f << scores.dump() << "\n";
    if (!f) throw UsageError(concat("--scores: cannot write ", args.scores));
  }
  return out;
}

}  // namespace mpitrain
