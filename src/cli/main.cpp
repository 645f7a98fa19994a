// mpitrain's command line: parses arguments and calls into the library. Every process is started
// by MPI (or alone, as a singleton); everything a rank needs comes from MPI.
//
//   mpitrain [train] CONFIG.yaml [--set key=value ...]   train (the default command)
//   mpitrain pack INPUT... -o PREFIX                     text / .jsonl / .bin / .npy -> HDF5 token shards
//   mpitrain inspect FILE.h5...                          a shard's or checkpoint's metadata
//   mpitrain sample CHECKPOINT.h5 [--prompt TEXT]        generate text from a checkpoint
//   mpitrain export CHECKPOINT.h5 --format hf DIR       a Hugging Face GPT-2 / Llama model directory
//   mpitrain netcheck                                    what the launch sees: hosts, links, bandwidth
//   mpitrain plan CONFIG.yaml [--set ...]                does another host pay? predicted step times
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <string>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/export.h"
#include "mpitrain/h5.h"
#include "mpitrain/log.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/netcheck.h"
#include "mpitrain/pack.h"
#include "mpitrain/plan.h"
#include "mpitrain/preflight.h"
#include "mpitrain/sample.h"
#include "mpitrain/train.h"

namespace mpitrain {
namespace {

const char* const kCommands[] = {"train", "pack", "inspect", "sample", "eval", "export", "netcheck", "plan"};

// Commands other than training, keyed by their first argument; anything else means `train`.
bool is_command(const std::string& a) {
  return std::any_of(std::begin(kCommands), std::end(kCommands), [&](const char* c) { return a == c; });
}

// The first argument of `mpitrain X ...` when X is neither a command nor a config file: a word
// with no '.' or '/' that names no file is a mistyped command ("trian"), said as such (with the
// nearest command within two edits) rather than read as a config path.
void check_command_word(const std::vector<std::string>& args) {
  if (args.empty() || is_command(args[0]) || args[0][0] == '-') return;
  const std::string& w = args[0];
  std::error_code ec;
  if (w.find_first_of("./") != std::string::npos || std::filesystem::exists(w, ec)) return;
  const char* nearest = nullptr;
  size_t best = 3;
  for (const char* c : kCommands)
    if (const size_t d = edit_distance(w, c); d < best) best = d, nearest = c;
  throw UsageError(concat("command line: unknown command '", w, "'",
                          nearest ? concat(" (did you mean '", nearest, "'?)") : std::string(),
                          "; the commands are train, pack, inspect, sample, eval, export, netcheck, plan, and "
                          "'mpitrain CONFIG.yaml' trains"));
}

int run_cli(int argc, char** argv, MpiSession& mpi) {
  std::vector<std::string> args(argv + 1, argv + argc);
  agree(mpi::world(), [&] { check_not_a_singleton(mpi.size()); });
  agree(mpi::world(), [&] { check_command_word(args); });
  if (!args.empty() && !is_command(args[0]) && args[0][0] != '-') args.insert(args.begin(), "train");
  if (args.size() == 1 && (args[0] == "--version" || args[0] == "-V")) {
    if (mpi.rank() == 0)
      std::printf("mpitrain %s\nmpi: %s; loaded: %s\ntorch: %s (CPU kernels: %s)\n", MPITRAIN_VERSION,
                  mpi_build().c_str(), mpi_library().c_str(), libtorch_release().c_str(), cpu_kernels().c_str());
    return 0;
  }

  CLI::App app{"mpitrain: GPT training launched by MPI, no rendezvous server"};
  app.require_subcommand(1);

  std::string config_path;
  std::vector<std::string> overrides;
  int64_t stop_after = -1;
  auto* train_cmd = app.add_subcommand("train", "train a model (the default command)");
  train_cmd->add_option("config", config_path, "YAML config file")->required();
  train_cmd->add_option("--set", overrides, "override a config key: section.key=value (repeatable)");
  train_cmd->add_option("--stop-after", stop_after,
                        "stop after step N (absolute, counted from the start of training), with a checkpoint");
  bool force_unlock = false;
  train_cmd->add_flag("--force-unlock", force_unlock,
                      "take checkpoint.dir's lock from a job that is gone (a dead node's lock kept by a shared "
                      "filesystem); says whose lock it overrides");

  PackOptions pack;
  auto* pack_cmd = app.add_subcommand(
      "pack", "pack text or token arrays (nanoGPT/llm.c .bin, .npy) into HDF5 token shards");
  pack_cmd->add_option("inputs", pack.inputs, "files or directories")->required();
  pack_cmd->add_option("-o,--output", pack.output_prefix, "output prefix: <prefix>-<split>-NNNNN.h5")
      ->required();
  pack_cmd->add_option("--format", pack.format,
                       "auto (by extension: .idx, or .bin beside one, Megatron; .bin llm.c or nanoGPT, .npy, "
                       ".jsonl, else text) | text | jsonl | nanogpt | llmc | npy | megatron (PREFIX.bin + PREFIX.idx)")
      ->capture_default_str();
  pack_cmd->add_option("--tokenizer", pack.tokenizer, "text: byte (default) | gpt2 | hf");
  pack_cmd->add_option("--tokenizer-file", pack.tokenizer_file,
                       "hf: a Hugging Face tokenizer.json (BPE, byte-level: GPT-2, Llama 3, Qwen2/3; "
                       "SentencePiece-style: Llama 2, Mistral, Gemma, Gemma 3)");
  pack_cmd->add_option("--special-tokens", pack.special_tokens,
                       "hf: special added tokens written in the text: text (default: plain text) | match (their "
                       "ids, as Hugging Face's encode)");
  pack_cmd->add_option("--text-key", pack.text_key, "jsonl: the key holding each line's text")
      ->capture_default_str();
  pack_cmd->add_option("--bpe-dir", pack.bpe_dir,
                       "gpt2: directory with vocab.json + merges.txt or encoder.json + vocab.bpe");
  pack_cmd->add_option("--vocab", pack.bpe_vocab, "gpt2: vocab.json / encoder.json");
  pack_cmd->add_option("--merges", pack.bpe_merges, "gpt2: merges.txt / vocab.bpe");
  pack_cmd->add_option("--vocab-size", pack.vocab_size,
                       "token arrays: tokens must be below this (default 50257)");
  pack_cmd->add_option("--eot", pack.eot_token,
                       "end-of-text id: documents start at it (token arrays, default 50256; hf: "
                       "overrides the file's separator)");
  pack_cmd->add_option("--doc-separator", pack.doc_separator,
                       "text: a line holding exactly this separates documents (default: one per file)");
  pack_cmd->add_option("--val-fraction", pack.val_fraction, "share of documents for val")
      ->capture_default_str();
  int64_t shard_tokens = static_cast<int64_t>(pack.shard_tokens);  // signed: "-1" must be refused, not wrapped
  pack_cmd->add_option("--shard-tokens", shard_tokens, "tokens per shard")->capture_default_str();
  pack_cmd->add_option("--seed", pack.seed, "seed of the train/val assignment")->capture_default_str();

  std::vector<std::string> inspect_files;
  auto* inspect_cmd = app.add_subcommand("inspect", "print an HDF5 shard's or checkpoint's metadata");
  inspect_cmd->add_option("files", inspect_files, "HDF5 files")->required();

  SampleArgs sample;
  auto* sample_cmd = app.add_subcommand("sample", "generate text from a checkpoint");
  sample_cmd->add_option("checkpoint", sample.checkpoint, "checkpoint .h5")->required();
  sample_cmd->add_option("--prompt", sample.prompt, "text to continue");
  sample_cmd->add_option("--tokens", sample.tokens, "tokens to generate")->capture_default_str();
  sample_cmd->add_option("--temperature", sample.temperature)->capture_default_str();
  sample_cmd->add_option("--top-k", sample.top_k, "0 = no top-k")->capture_default_str();
  sample_cmd->add_option("--seed", sample.seed)->capture_default_str();
  sample_cmd->add_flag("--stream", sample.stream,
                       "hold one block at a time, read from the checkpoint for every token (a model larger than memory; slow)");
  sample_cmd->add_option("--tokenizer-file", sample.tokenizer_file,
                         "hf checkpoints: the tokenizer.json (default: the one the shards were packed with)");

  EvalArgs eval_args;
  auto* eval_cmd = app.add_subcommand(
      "eval", "under mpirun: score multiple-choice tasks (HellaSwag or {context, choices, answer} JSON Lines) as "
              "lm-evaluation-harness does, the examples split over the ranks");
  eval_cmd->add_option("model", eval_args.model, "checkpoint .h5, or hf:DIR (a Hugging Face model directory)")->required();
  eval_cmd->add_option("--task", eval_args.tasks, "NAME=FILE@LIMIT (NAME= and @LIMIT optional; repeatable)")->required();
  eval_cmd->add_option("--tokenizer-file", eval_args.tokenizer_file,
                       "the tokenizer.json or GPT-2 BPE directory (vocab.json + merges.txt or encoder.json + vocab.bpe; "
                       "default: the checkpoint's shards', or DIR/tokenizer.json); byte: the byte tokenizer");
  eval_cmd->add_option("--rows", eval_args.rows, "choices per forward")->capture_default_str();
  eval_cmd->add_option("--scores", eval_args.scores, "rank 0 writes every example's choices' scores here (JSON)");

  ExportArgs export_args;
  auto* export_cmd = app.add_subcommand("export", "write a checkpoint as a Hugging Face GPT-2 or Llama model directory");
  export_cmd->add_option("checkpoint", export_args.checkpoint, "checkpoint .h5")->required();
  export_cmd->add_option("dir", export_args.dir, "output directory (safetensors, config.json)")->required();
  export_cmd->add_option("--format", export_args.format, "hf (Hugging Face transformers' GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM)")
      ->capture_default_str();
  export_cmd->add_option("--dtype", export_args.dtype, "fp32 | bf16 | fp16")->capture_default_str();
  export_cmd->add_option("--tokenizer-file", export_args.tokenizer_file,
                         "hf checkpoints: the tokenizer.json to copy along (default: the one the shards were packed with)");
  export_cmd->add_option("--max-shard-size", export_args.max_shard_mb,
                         "MB per safetensors file; larger models are sharded with model.safetensors.index.json "
                         "(default 5000, as Hugging Face's 5GB)");
  export_cmd->add_flag("--overwrite", export_args.overwrite,
                       "replace another model's config.json, safetensors and index in dir (refused without it)");
  export_cmd->add_option("--bpe-dir", export_args.bpe_dir,
                         "GPT-2 BPE checkpoints: the vocab.json + merges.txt the shards were packed with (copied along)");

  std::string plan_config;
  std::vector<std::string> plan_overrides;
  PlanOptions plan;
  auto* plan_cmd = app.add_subcommand(
      "plan", "under the training's mpirun: measure compute and all-reduce, predict step time and communication "
              "share per grad_accum and grad_dtype, recommend a setting");
  plan_cmd->add_option("config", plan_config, "YAML config file")->required();
  plan_cmd->add_option("--set", plan_overrides, "override a config key: section.key=value (repeatable)");
  plan_cmd->add_option("--iters", plan.iters, "timed repetitions of each measurement")->capture_default_str();
  plan_cmd->add_option("--memory", plan.memory_gib,
                       "GiB per rank the layout must fit (default on a GPU: its memory; on the CPU none: no recommendation)");
  plan_cmd->add_flag("--memory-only", plan.memory_only,
                     "print the memory per rank alone: no timing of compute or all-reduce (seconds, not minutes, for a "
                     "large model whose ranks share a GPU)");

  NetcheckOptions netcheck;
  auto* netcheck_cmd = app.add_subcommand("netcheck", "check the launch: host map, links, all-reduce bandwidth");
  netcheck_cmd->add_option("--max-bytes", netcheck.max_bytes, "largest all-reduce message")->capture_default_str();
  netcheck_cmd->add_option("--p2p-bytes", netcheck.p2p_bytes, "point-to-point message")->capture_default_str();
  netcheck_cmd->add_option("--iters", netcheck.iters, "timed repetitions")->capture_default_str();

  std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
  // Every rank parses the same arguments and finds the same error: agree() prints it once.
  bool help = false;
  agree(mpi::world(), [&] {
    try {
      app.parse(args);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() != 0) throw UsageError(concat("command line: ", e.what()));
      help = true;  // --help
    }
  });
  if (help) {
    if (mpi.rank() == 0) std::printf("%s", app.help().c_str());
    return 0;
  }
  // Numeric options: a value out of range is an error naming the option, never ignored or wrapped.
  agree(mpi::world(), [&] {
    auto need = [](bool ok, const char* option, const std::string& range, const std::string& got) {
      if (!ok) throw UsageError(concat("command line: ", option, " must be ", range, ", got ", got));
    };
    if (*train_cmd && train_cmd->count("--stop-after"))
      need(stop_after >= 1, "--stop-after", ">= 1 (the step to stop after)", std::to_string(stop_after));
    if (*pack_cmd) {
      need(shard_tokens >= 1, "--shard-tokens", ">= 1", std::to_string(shard_tokens));
      need(pack.val_fraction >= 0 && pack.val_fraction < 1, "--val-fraction", "in [0, 1)", concat(pack.val_fraction));
      need(pack.vocab_size >= 0, "--vocab-size", ">= 1 (0 = the tokenizer's)", std::to_string(pack.vocab_size));
      need(pack.eot_token >= -1, "--eot", ">= 0 (-1 = the tokenizer's)", std::to_string(pack.eot_token));
      pack.shard_tokens = static_cast<uint64_t>(shard_tokens);
    }
    if (*sample_cmd) {
      need(sample.tokens >= 1, "--tokens", ">= 1", std::to_string(sample.tokens));
      need(std::isfinite(sample.temperature) && sample.temperature > 0, "--temperature", "a number > 0",
           concat(sample.temperature));
      need(sample.top_k >= 0, "--top-k", ">= 0 (0 = no top-k)", std::to_string(sample.top_k));
    }
    if (*plan_cmd) need(plan.iters >= 1, "--iters", ">= 1", std::to_string(plan.iters));
    if (*eval_cmd) need(eval_args.rows >= 1, "--rows", ">= 1", std::to_string(eval_args.rows));
    if (*plan_cmd)
      need(plan.memory_gib >= 0 && plan.memory_gib < 1e9, "--memory", "GiB per rank, > 0 (0: the GPU's memory)",
           std::to_string(plan.memory_gib));
    if (*export_cmd)
      need(std::isfinite(export_args.max_shard_mb) && export_args.max_shard_mb >= 0, "--max-shard-size",
           "a number of MB > 0", concat(export_args.max_shard_mb));
    if (*netcheck_cmd) {
      need(netcheck.max_bytes >= 4, "--max-bytes", ">= 4", std::to_string(netcheck.max_bytes));
      need(netcheck.p2p_bytes >= 4, "--p2p-bytes", ">= 4", std::to_string(netcheck.p2p_bytes));
      need(netcheck.iters >= 1, "--iters", ">= 1", std::to_string(netcheck.iters));
    }
  });

  if (*train_cmd) {
    Config cfg;
    agree(mpi::world(), [&] { cfg = load_config(config_path, overrides); });
    TrainHooks hooks;
    hooks.stop_after = stop_after;
    hooks.force_unlock = force_unlock;
    return train(cfg, mpi::world(), hooks).exit_code;
  }
  if (*plan_cmd) {
    Config cfg;
    agree(mpi::world(), [&] { cfg = load_config(plan_config, plan_overrides); });
    run_plan(cfg, mpi::world(), plan);
    return 0;
  }
  if (*pack_cmd) {
    // Collective: the ranks share the input; the shards are the same on any number of ranks.
    PackResult r;
    agree(mpi::world(), [&] { r = mpitrain::pack(pack, mpi::world()); });
    if (mpi.rank() == 0) {
      std::printf("packed %llu documents (%s tokenizer, vocab %lld): %llu train tokens in %zu shards, "
                  "%llu val tokens in %zu shards\n",
                  static_cast<unsigned long long>(r.documents), r.tokenizer.c_str(),
                  static_cast<long long>(r.vocab_size),
                  static_cast<unsigned long long>(r.train_tokens), r.train_shards.size(),
                  static_cast<unsigned long long>(r.val_tokens), r.val_shards.size());
      if (!std::isnan(r.train_unigram_entropy))
        std::printf("train unigram entropy: %.4f nats/token (the loss of a model that ignores context)\n",
                    r.train_unigram_entropy);
    }
    return 0;
  }
  if (*inspect_cmd) {
    agree(mpi::world(), [&] {
      if (mpi.rank() != 0) return;
      for (const auto& f : inspect_files) std::printf("%s", h5::describe(f).c_str());
    });
    return 0;
  }
  if (*netcheck_cmd) return run_netcheck(netcheck, mpi::world(), local_gpu_count(), libtorch_release(), gpu_facts);
  if (*sample_cmd) {
    agree(mpi::world(), [&] {
      if (mpi.rank() != 0) return;
      std::printf("%s\n", run_sample(sample).c_str());  // the prompt and its continuation
    });
    return 0;
  }
  if (*eval_cmd) {
    const std::string out = run_eval_command(eval_args, mpi::world());
    if (mpi.rank() == 0) std::printf("%s", out.c_str());
    return 0;
  }
  if (*export_cmd) {
    agree(mpi::world(), [&] {
      if (mpi.rank() != 0) return;
      std::printf("%s", run_export(export_args).c_str());
    });
    return 0;
  }
  return 0;
}

}  // namespace
}  // namespace mpitrain

namespace mpitrain {
namespace {
// MPITRAIN_EXIT_FILE: rank 0 writes the job's exit code there before it exits, for wrappers
// (scripts/mpitrain-run, slurm/mpitrain.sbatch) whose launcher may lose it: MPICH 4.0's hydra
// mpiexec returned 0 after every rank exited 75 (its exit-status capture is racy,
// pmodels/mpich#7057). Every rank of a run that returns here returns the same code.
int report_exit(const MpiSession& mpi, int code) {
  const char* path = std::getenv("MPITRAIN_EXIT_FILE");
  if (path && *path && mpi.rank() == 0) {
    if (std::FILE* f = std::fopen(path, "w")) {
      std::fprintf(f, "%d\n", code);
      std::fclose(f);
    }
  }
  return code;
}
}  // namespace
}  // namespace mpitrain

int main(int argc, char** argv) {
  mpitrain::MpiSession mpi(argc, argv);
  try {
    return mpitrain::report_exit(mpi, mpitrain::run_cli(argc, argv, mpi));
  } catch (const mpitrain::ReportedUsageError& e) {  // printed once already; every rank agreed
    return mpitrain::report_exit(mpi, e.exit_code);
  } catch (const mpitrain::UsageError& e) {  // seen by this rank alone: print, end the job
    std::fprintf(stderr, "mpitrain: %s\n", e.what());
    mpi.abort(2);
  } catch (const std::exception& e) {  // anything else: take every rank down, never hang
    mpitrain::log::error(e.what());
    mpi.abort(1);
  }
}
