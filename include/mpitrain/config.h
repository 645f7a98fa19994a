// The run configuration: YAML into one typed struct per concern, validated strictly.
//
// Every key in the YAML must be read by some field, otherwise:
//   config.yaml: unknown key 'train.micro_bach' (did you mean 'train.micro_batch'?)
//   config.yaml: train.micro_batch must be > 0, got -4
// Errors are UsageError (exit 2) and always name the file and the full key.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "mpitrain/error.h"

namespace mpitrain {

// Presets (docs/models.md has the table): GPT-2's tiny (6/6/192, seq 256, vocab from the data),
// gpt2, gpt2-medium, gpt2-large, gpt2-xl; Llama's llama-debug (6 layers, 16 heads, 4 kv heads,
// width 256, vocab 2048), llama3.2-1b, llama3.2-3b, llama3.1-8b, qwen2.5-0.5b, qwen3-0.6b,
// qwen3-1.7b, qwen3-4b, qwen3-8b and mistral-7b-v0.1 with their published config.json values.
// custom requires n_layer, n_head, n_embd and seq_len (and for llama intermediate_size).
// parse_config fills the unset fields from the preset (then from the architecture's defaults),
// so after it only vocab_size may be 0. With model.init_from: hf:DIR,
// load_config first takes the unset fields from DIR/config.json (hf_config.h).
struct ModelConfig {
  std::string preset = "tiny";  // tiny | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | llama-debug |
                                // llama3.2-1b | llama3.2-3b | llama3.1-8b | qwen2.5-0.5b | qwen3-0.6b |
                                // qwen3-1.7b | qwen3-4b | qwen3-8b | mistral-7b-v0.1 | gemma2-2b | gemma3-1b | custom
  int64_t n_layer = 0;          // transformer blocks (0 = from preset)
  int64_t n_head = 0;           // attention heads (0 = from preset)
  int64_t n_embd = 0;           // model width (0 = from preset)
  int64_t seq_len = 0;          // context length in tokens (0 = from preset)
  int64_t vocab_size = 0;       // 0 = automatic: the shards' vocab_size padded up to a multiple of
                                // vocab_multiple x parallel.tp; otherwise >= the shards' (every row a class)
  int64_t vocab_multiple = 0;   // automatic padding's multiple (times parallel.tp): 0 = 64 on CUDA, 1 on the CPU
  // Not YAML keys: model.init_from: hf:DIR's config.json vocab_size, the classes its weights have
  // (automatic padding pads them as it pads the data's), and where it came from, for messages.
  int64_t init_vocab = 0;
  std::string init_vocab_source;
  // The family (model_fields.h: one row each): gpt2 | llama | qwen2 | qwen3 | mistral | gemma2 | gemma3 ("" = the
  // preset's; custom: from model.arch and the flags, as before the key existed). It gives the
  // block (arch), the block flags it fixes (qkv_bias, qk_norm; a window mistral's and Gemma's only) and
  // the Hugging Face class it is read from and exported as.
  std::string family = "";
  std::string arch = "";        // the family's block, gpt2 | llama ("" = the family's; custom without family: gpt2)
  // Llama only (refused on gpt2, whose values are fixed: n_kv_head = n_head, 4 n_embd GELU
  // units, learned positions, biases everywhere, tied output):
  int64_t n_kv_head = 0;          // key/value heads, grouped-query attention; divides n_head (0 = n_head)
  int64_t intermediate_size = 0;  // SwiGLU hidden units (0 = from preset; custom llama: required)
  double rope_theta = 0;          // rotary base (0 = from preset, else 10000)
  std::string rope_scaling = "";  // none | llama3 (Llama 3.1's frequency scaling) | linear (the frequencies / rope_factor:
                                  // Gemma 3's global layers) ("" = from preset, else none)
  double rope_factor = 0;             // llama3, linear: factor (>= 1)
  double rope_low_freq_factor = 0;    // llama3: low_freq_factor (> 0)
  double rope_high_freq_factor = 0;   // llama3: high_freq_factor (> low_freq_factor)
  int64_t rope_original_max_position = 0;  // llama3: original_max_position_embeddings (> 0)
  int64_t max_position = 0;       // max_position_embeddings written to config.json (0 = from preset, else seq_len)
  std::string qkv_bias = "auto";        // true | false: biases on q/k/v (Qwen2) (auto = the preset's, else false)
  std::string tie_embeddings = "auto";  // true | false: output layer = token embedding (auto = the preset's, else true)
  int64_t head_dim = 0;           // size of one attention head (0 = from preset, else n_embd / n_head; Qwen3: 128)
  std::string qk_norm = "auto";   // true | false: RMSNorm over each head's q and k before rotary (Qwen3)
                                  // (auto = the preset's, else false)
  // Gemma 2 and 3 only (0 = the preset's, else none): soft-capping of the attention scores and of
  // the output logits, cap tanh(x / cap); the query scale 1 / sqrt(query_pre_attn_scalar) (0 = the
  // preset's, else the head size).
  double attn_softcap = 0;
  double final_softcap = 0;
  double query_pre_attn_scalar = 0;
  double rope_local_theta = 0;  // Gemma 3 only: the windowed layers' rotary base (0 = the preset's, else 10000)
  double norm_eps = 0;            // LayerNorm / RMSNorm epsilon, > 0 (0 = from preset, else 1e-5); both archs
  double dropout = 0.0;         // dropout probability, [0, 1)
  std::string fused_loss = "auto";  // chunked classifier + cross-entropy (no [tokens x vocab]
                                    // logits): auto (on CUDA) | on | off
  std::string fused_kernels = "auto";  // residual add + LayerNorm and bias + GELU as fused ops
                                       // (fused_ops.h): auto (on CUDA) | on | off
  std::string attention = "auto";  // scaled_dot_product_attention's kernel: auto (libtorch's
                                   // choice) | flash | cudnn | efficient | math
  // The architecture fields kept by key (model_fields.h's generic rows: the experts' fields, the
  // attention window, ...): the YAML value as text, absent = the row's fallback.
  std::map<std::string, std::string> args;
  std::string init_from;  // initial weights, fresh start only: hf:DIR (a Hugging Face model directory,
                          // its config.json giving the shape), a .safetensors file or a directory holding
                          // model.safetensors, or a directory of <parameter name>.npy (docs/formats.md);
                          // "" = random initialisation
};

struct DataConfig {
  std::vector<std::string> train;  // shard files, directories or glob patterns (non-empty)
  // A weighted mixture: one weight (> 0) per data.train entry, each entry a source (shards.h's
  // mixture TokenDataset); empty: every shard one source. YAML may give data.train entries as
  // {path, weight} maps instead.
  std::vector<std::string> weights;
  // The mixture's later stages (annealing): "STEP:W0/W1/..." (YAML may give {step, weights}): from
  // optimizer step STEP on (its first window: STEP x train.global_batch), these weights (>= 0, one
  // > 0), each source going on from the windows it had given. Steps increasing, > 0.
  std::vector<std::string> stages;
  std::vector<std::string> val;    // the same for validation; may be empty if eval.every == 0
  uint64_t seed = 1337;            // seed of the global sample order
  bool shuffle = true;             // shuffle the training windows (val is never shuffled)
};

struct TrainConfig {
  int64_t micro_batch = 8;    // sequences per rank per micro-step
  int64_t grad_accum = 0;     // micro-steps per optimizer step (0 = from global_batch, else 1)
  int64_t global_batch = 0;   // sequences per optimizer step (0 = micro_batch*world*grad_accum)
  int64_t steps = 1000;       // optimizer steps in the whole run
  uint64_t seed = 42;         // seed of parameter initialisation and dropout
  int64_t threads = 0;        // torch intra-op threads per rank (0 = cores / ranks on host)
  std::string out_dir = "runs/default";  // metrics.jsonl and the run's resolved config go here
  std::string device = "auto";     // auto (CUDA when this build and host have it) | cpu | cuda
  std::string precision = "fp32";  // fp32 | bf16 (autocast) | fp16 (autocast + loss scaling, CUDA)
  // Activation checkpointing (model.h, GPTDims::ac): none | full (a block keeps only its input and
  // is run again in backward) | selective (a block also keeps its linear layers' outputs and a
  // fused attention kernel's state; norms, rotary, activation functions and dropout are run again,
  // and attention too where it is the math path: checkpointing.h); on every ac_every-th block.
  std::string activation_checkpointing = "none";
  int64_t ac_every = 1;  // >= 1: blocks ac_every - 1, 2 ac_every - 1, ... are checkpointed
  // A mixture of experts' capacity (Megatron's moe_expert_capacity_factor): none (dropless) or f >
  // 0: each expert takes at most ceil(f x tokens x k / experts) of a forward's token copies, the
  // first by position; the rest are dropped (they add nothing, the kept weights unchanged).
  std::string moe_capacity_factor = "none";
  // A mixture of experts' router z-loss (ST-MoE): this coefficient x the mean over every sparse
  // layer's tokens of logsumexp(router logits)^2 is added to the loss. 0: none.
  double moe_z_loss_coef = 0;
  // Aux-loss-free balancing (DeepSeek-V3; torchtitan's load_balance_coeff): each sparse layer's
  // per-expert bias, added to the router's probabilities for the top-k choice only (the weights
  // stay the probabilities), moves by this rate after every optimizer step: bias += rate x
  // sign(mean load - the expert's load over the dp group's tokens of the step), centred. 0: none.
  double moe_bias_update_rate = 0;
};

struct OptimConfig {
  double lr = 6e-4;            // peak learning rate, > 0
  double min_lr = 6e-5;        // floor of the cosine decay, [0, lr]
  int64_t warmup_steps = 100;  // linear warm-up steps, [0, train.steps]
  double weight_decay = 0.1;   // AdamW decay for matrices (never biases, norms or embeddings' 1-D)
  double beta1 = 0.9;          // [0, 1)
  double beta2 = 0.95;         // [0, 1)
  double eps = 1e-8;           // > 0
  double grad_clip = 1.0;      // global-norm clip (0 = off)
  // adamw | sgd (plain SGD with the same decoupled weight decay: the optimizer under which DiLoCo
  // with one inner step equals data parallelism, docs/diloco.md)
  std::string name = "adamw";
  std::string fused = "auto";  // PyTorch's fused AdamW kernel: auto | on | off (optim.h)
  // AdamW's moments: fp32 | bf16 (stochastically rounded, 4 bytes per parameter less; optim.h)
  std::string state_dtype = "fp32";
  int64_t zero = 0;            // 1 = ZeRO-1: AdamW state sharded over the data-parallel ranks
  bool reshard_after_forward = true;  // zero 3: drop a block's gathered parameters after its forward
};

struct EvalConfig {
  int64_t every = 100;   // optimizer steps between validation passes (0 = never)
  int64_t batches = 20;  // micro-batches per rank per validation pass, > 0
  // Multiple-choice tasks (mc_eval.h), each "NAME=FILE@LIMIT" (NAME= and @LIMIT optional: the
  // file's stem, every example) or in YAML {name, file, limit}; scored every tasks_every steps
  // (0: with each validation pass, eval.every) and at the last step.
  std::vector<std::string> tasks;
  int64_t tasks_every = 0;
  // What the task files are read with ("": the shards' tokenizer, byte or the tokenizer.json they
  // were packed with): a tokenizer.json, or a GPT-2 BPE directory (shards packed with --tokenizer
  // gpt2 record no files: this names them).
  std::string tokenizer;
};

struct LogConfig {
  int64_t every = 10;          // steps between progress lines, > 0
  std::string level = "info";  // debug | info | warn | error
  std::string metrics = "";    // JSONL metrics file ("" = <train.out_dir>/metrics.jsonl)
  std::string tensorboard = "";  // event files' directory ("" = <train.out_dir>/tensorboard, off = none)
  double peak_tflops = 0;      // one device's peak for MFU (0 = the known GPU's; none on CPU), >= 0
  bool rank_files = true;      // every rank's lines also in <train.out_dir>/logs/rank-<r>.log
  int64_t profile_start = 0;   // profile steps profile_start.. (0 = off): <out_dir>/profile/rank-0.json
  int64_t profile_steps = 3;   // how many steps the profile holds, > 0
};

struct CheckpointConfig {
  std::string dir = "checkpoints";  // ckpt-<step:08>.h5 and `latest` live here
  int64_t every = 0;                // steps between checkpoints (0 = only at the end)
  bool at_end = true;               // write one after the last step (false: benchmarks, runs kept elsewhere)
  int64_t keep = 3;                 // keep the newest K complete checkpoints, >= 1
  std::string resume = "auto";      // auto (newest in dir, if any) | none | path to a .h5
  bool async = false;               // snapshot to host memory, write on a background thread
  std::string writers = "auto";     // auto (ZeRO-1/TP: the ranks holding the state write their shares when all see dir) | rank0
};

struct CommConfig {
  std::string backend = "auto";  // auto | mpi | nccl
  double bucket_mb = 25.0;       // gradient all-reduce bucket size in MiB, > 0
  bool overlap = true;           // launch each bucket's all-reduce during backward, when it is ready
  std::string grad_dtype = "fp32";  // the gradients' dtype on the wire: fp32 | bf16 | fp16 (half the bytes)
  // ZeRO-3's parameter all-gathers on the wire: fp32 | bf16 | fp16 (half the bytes). The gathered
  // weights the step computes with are the shards rounded to it; the fp32 shards stay the master
  // weights that AdamW updates and checkpoints hold. Needs optim.zero 3.
  std::string param_dtype = "fp32";
  std::string compress = "none";    // none | powersgd (low-rank gradients with error feedback, powersgd.h)
  int64_t powersgd_rank = 4;        // PowerSGD: the rank of each weight matrix's approximation, >= 1
  int64_t powersgd_start = 10;      // PowerSGD: steps before this one all-reduce plainly, >= 0
};

// The layout of the ranks (mesh.h): world = islands x pp x dp x tp, tp groups consecutive ranks of one
// host, islands consecutive ranks.
struct ParallelConfig {
  int64_t tp = 1;  // tensor-parallel degree, >= 1
  // Expert parallelism: each ep group of ep consecutive data-parallel ranks holds a mixture of
  // experts' experts once between them (1/ep of them each), >= 1, dividing the experts' count and dp.
  int64_t ep = 1;
  // DiLoCo's islands (diloco.h): 1 (none: plain training) | host (one per host) | N (N islands of
  // consecutive ranks, each a whole number of tp groups) | auto (the hosts' measured links decide:
  // layout.h's group_hosts). Between islands only the outer steps talk.
  std::string islands = "1";
  double slow_link_gbit = 10;  // islands: auto: a link below this (or a quarter of the fastest) parts islands, > 0
  // Pipeline parallelism (pipeline.h): the blocks in pp stages of consecutive blocks (the embedding
  // on the first, the final norm and head on the last), each stage pp-th of the ranks (consecutive
  // runs: stage s is ranks [s world / pp, (s + 1) world / pp)); the step's micro-batches
  // (train.grad_accum) flow through them in pp_schedule's order: 1f1b | gpipe | interleaved
  // (each rank pp_virtual chunks of blocks, virtual stages s, s + pp, ...: Megatron's interleaved
  // 1F1B, its bubble pp_virtual times smaller).
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";
  int64_t pp_virtual = 1;
  // The first and the last stage's blocks (0: as even as the blocks allow), to even out their extra
  // work (the embedding; the final norm, output layer and loss), as torchtitan's
  // first/last_stage_less_layers; the other stages share the rest as evenly. Not with interleaved.
  int64_t pp_first_stage_blocks = 0, pp_last_stage_blocks = 0;
  // The pipeline's micro-batches per step (0: train.grad_accum's): the step's rows per replica,
  // train.micro_batch x train.grad_accum, split into this many micro-batches (resolve_for_world
  // sets train.micro_batch and train.grad_accum to the split; the global batch stays), as
  // torchtitan's microbatch size: the bubble tuned without changing the optimisation.
  int64_t pp_microbatches = 0;
};

// parallel.islands as a number: N, -1 for host (one per host), -2 for auto, 0 when it is none of
// them (refused).
int64_t islands_count(const std::string& spec);
// One eval.tasks entry ("NAME=FILE@LIMIT"; `key` names it in messages): its name (the file's stem
// without NAME=), file and limit (0: every example). A bad entry is a UsageError.
struct TaskSpec {
  std::string name, file;
  int64_t limit = 0;
};
TaskSpec parse_task_spec(const std::string& spec, const std::string& key);

// One data.stages entry ("STEP:W0/W1/..."; `key` names it in messages) for `sources` sources.
std::pair<int64_t, std::vector<double>> parse_stage_spec(const std::string& spec, size_t sources, const std::string& key);

// train.moe_capacity_factor as a number: 0 for none, f for a number f > 0, -1 for anything else (refused).
double capacity_factor_of(const std::string& spec);

// DiLoCo between islands (diloco.h, docs/diloco.md); read only with parallel.islands > 1.
struct DilocoConfig {
  int64_t inner_steps = 100;      // H: optimizer steps between outer steps, >= 1
  double outer_lr = 0.7;          // the outer Nesterov SGD's learning rate, > 0
  double outer_momentum = 0.9;    // its momentum, [0, 1)
  std::string dtype = "fp32";     // the pseudo-gradient on the wire: fp32 | bf16 | int8 (blocks + error feedback)
  // Streaming DiLoCo (arXiv 2501.18512): each rank's part in F fragments, each synced every
  // inner_steps steps, fragment p after steps p * inner_steps / F (mod inner_steps); 1 <= F <= inner_steps.
  int64_t fragments = 1;
  int64_t overlap = 0;            // tau: an exchange started after step t is applied after step t + tau, [0, inner_steps)
  double mix = 0.5;               // with overlap > 0: the island goes on from mix * its own + (1 - mix) * theta_outer, [0, 1)
};

struct FaultConfig {
  double collective_timeout_s = 300;         // a collective that takes longer aborts the job, > 0
  double first_collective_timeout_s = 900;   // the first one (may include NCCL set-up), > 0
};

struct SampleConfig {
  int64_t tokens = 0;         // tokens to generate after training (0 = none)
  std::string prompt = "";    // text prompt (byte tokenizer)
  double temperature = 0.8;   // > 0
  int64_t top_k = 40;         // 0 = no top-k filtering
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;
  EvalConfig eval;
  LogConfig log;
  CheckpointConfig checkpoint;
  CommConfig comm;
  ParallelConfig parallel;
  DilocoConfig diloco;
  FaultConfig fault;
  SampleConfig sample;

  std::string source = "<defaults>";  // the file it came from, for error messages
};

// Parses YAML text (`source` names it in errors), then applies `overrides` ("section.key=value",
// the value parsed as YAML), then validates everything that does not depend on the world size.
// Throws UsageError naming `source` and the key.
// read_hf_config: with model.init_from hf:DIR, take the model's shape from DIR/config.json
// (load_config does; a checkpoint's stored, already resolved config needs no file).
Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {}, bool read_hf_config = false);

// Reads the file, then parse_config, taking the model's shape from the Hugging Face config.json
// when model.init_from is hf:DIR (hf_config.h). A missing or unreadable file is a UsageError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The Levenshtein distance of two words: "did you mean" suggestions (config keys, commands).
size_t edit_distance(const std::string& a, const std::string& b);

// Checks that depend on the world size and resolves train.grad_accum / train.global_batch:
// global_batch must equal micro_batch * world * grad_accum when both are given.
void resolve_for_world(Config& cfg, int world_size);

// The resolved configuration as YAML (every key, in a stable order); parse_config of the result
// gives back an equal Config.
std::string to_yaml(const Config& cfg);

// Start-up checks that find a config value wrong only at run time ("data.train: no shard
// matches ...", "train.device: ...") say which file the key came from, like parse_config's.
template <class Fn>
void naming_config_file(const Config& cfg, Fn&& fn) {
  try {
    fn();
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    for (const char* section : {"model.", "data.", "train.", "optim.", "eval.", "log.", "checkpoint.", "comm.", "parallel.",
                                "diloco.", "fault.", "sample."})
      if (msg.rfind(section, 0) == 0) throw UsageError(concat(cfg.source, ": ", msg));
    throw;
  }
}

}  // namespace mpitrain
