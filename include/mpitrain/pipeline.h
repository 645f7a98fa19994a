// Pipeline parallelism (parallel.pp): the model's blocks in pp stages of consecutive blocks, each
// stage a run of ranks (layout.h), the step's micro-batches flowing through them.
//
// A stage is a GPT made with dims.pp / pp_stage (model.h: its blocks, the embedding on the first
// stage, the final norm and the output layer on the last, with tied embeddings a copy of the
// embedding there too; every name the whole model's). One optimizer step runs the schedule's
// steps in order: a forward of micro-batch m takes its input from the previous stage (the first:
// the token ids), keeps it and its output for m's backward and sends the output to the next stage;
// the last stage's forward computes m's loss. A backward of m takes the gradient of m's output
// from the next stage (the last: of its loss), runs backward through the stage and sends the
// gradient of m's input to the previous stage. Each micro-batch's forward and backward are those
// of the unpipelined step, so the loss and the gradients are the same numbers up to the order in
// which a tied embedding's two gradients (the first stage's and the last's, summed between them
// after backward) are added.
//
// Schedules (pipeline_schedule): gpipe, every forward then every backward; 1f1b (PipeDream-flush,
// Megatron's default): stage s runs pp - 1 - s forwards ahead, then alternates one forward and one
// backward, then the remaining backwards, so a stage holds at most pp - s micro-batches'
// activations instead of all of them; interleaved (Megatron's interleaved 1F1B): each rank holds
// v = pp_virtual chunks of blocks (chunk j is virtual stage j pp + s of pp v, so a micro-batch goes
// round the pipeline v times, the last stage's chunk j sending to the first stage's chunk j + 1);
// the micro-batches in groups of pp, each group through chunk 0, then chunk 1, ..., with
// 2 (pp - 1 - s) + (v - 1) pp forwards ahead (all of them when m = pp), then one forward and one
// backward in turn: each rank idles pp - 1 chunk-sized slots of v m, a v times smaller bubble.
// Every schedule runs each chunk's backwards in micro-batch order, so every parameter's gradient
// accumulates in the same order: the three train bitwise the same.
//
// The step's activations and their gradients travel as fp32 on PipeChannels: each direction and
// kind of transfer a communicator of its own two ranks, of comm.backend's kind. NCCL (a GPU's
// default): ncclSend/ncclRecv on each channel's own stream, after the stage's work so far, the
// stage's stream waiting for a receive on the GPU, the host never. MPI: MPI_Isend (each send's
// buffer kept until the step ends) and MPI_Irecv, waited for under the watchdog, a device tensor
// going through host memory. Each receive is posted one step of the schedule ahead
// (run_pipeline_steps). Neither matches messages by tag: each channel's messages arrive in the
// order sent, which is the order the receiving stage takes them in every schedule
// (pipeline_channel_orders, checked by test_model), so the MPI runs on the CPU walk the same
// channels in the same order as NCCL's on GPUs. Evaluation, sampling and plan's link timing use
// PipeLink's tagged MPI messages instead.
// With the fused block ops a chunk's last MLP output is added to the residual stream before it
// travels (GPT::stage_forward), so every stage's stream is the unpipelined one.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/model_fields.h"
#include "mpitrain/mpi_ops.h"

namespace mpitrain {

struct PipeStep {
  bool forward;       // else backward
  int64_t micro;      // the micro-batch, 0-based
  int64_t chunk = 0;  // the rank's chunk of blocks (interleaved; else 0)
};

// Stage `stage`'s steps (of `stages`) for `micro_batches` micro-batches under `schedule` (1f1b |
// gpipe | interleaved with `chunks` chunks per rank, micro_batches a multiple of stages): every
// micro-batch's forward and backward of each chunk once, each backward after its forward.
std::vector<PipeStep> pipeline_schedule(const std::string& schedule, int64_t stages, int64_t stage, int64_t micro_batches,
                                        int64_t chunks = 1);

// The pipeline bubble with m micro-batches and v chunks per rank: each stage idles pp - 1 slots of
// a chunk's forward and backward besides its v m busy ones, (pp - 1) / (v m) of the ideal step
// (Megatron's bubble time fraction; gpipe and 1f1b: v = 1).
double pipeline_bubble(int64_t stages, int64_t micro_batches, int64_t chunks = 1);

// One step of the schedule simulated from measured times (plan's prediction of the bubble):
// forward[s][c] and backward[s][c] the seconds of stage s's chunk c per micro-batch, latency[s] the
// seconds an activation (or its gradient) takes from stage s to the next (s + 1 mod pp; the same
// both ways). Sends never wait (as PipeLink's); a step starts when its input has arrived and the
// stage is free. Per stage: when its last step ends (`end`) and the seconds it computed (`busy`);
// its idle share of its micro-batches' time is 1 - busy / end, what training measures (pp wait).
struct PipelineTimes {
  std::vector<double> end, busy;
};
PipelineTimes simulate_pipeline(const std::string& schedule, int64_t micro_batches,
                                const std::vector<std::vector<double>>& forward,
                                const std::vector<std::vector<double>>& backward, const std::vector<double>& latency);

// The stage that holds (and, for a tied embedding, writes) the whole model's parameter `name`
// under `d` (its pp and pp_virtual): blocks by their chunk, the embeddings on the first stage, the
// final norm and the output layer on the last.
int64_t stage_of(const std::string& name, const GPTDims& d);

// One rank's links to the neighbouring stages of its pipeline (`pp`: Mesh::pp_mpi(), rank s of it
// in stage s). Sends are nonblocking; their buffers live until finish().
class PipeLink {
 public:
  explicit PipeLink(MpiComm pp) : comm_(pp) {}
  PipeLink(const PipeLink&) = delete;
  PipeLink& operator=(const PipeLink&) = delete;
  ~PipeLink();
  // `t` (any dtype and device: sent as host fp32) to stage `to` with `tag`.
  void send(const torch::Tensor& t, int64_t to, int tag);
  // The tensor of `shape` (host fp32, then on `device`) that stage `from` sent with `tag`.
  torch::Tensor recv(c10::IntArrayRef shape, int64_t from, int tag, const torch::Device& device);
  // Every send of this step delivered (their buffers may go).
  void finish();

 private:
  MpiComm comm_;
  std::vector<std::pair<torch::Tensor, MpiRequest>> sending_;
};

// One rank's channels to its neighbouring stages (`pp`: Mesh::pp_mpi(), rank s of it in stage s):
// activations to the next stage and from the previous, gradients to the previous and from the
// next; with `wrap` (interleaved chunks) also from the last stage round to the first and back.
// Each directed pair of stages and kind is a communicator of its two ranks made by
// make_communicator(`backend`, ..., `device`), all made in one order on every rank (each making
// blocks until its two ranks have both come). Not for pp 1.
class PipeChannels {
 public:
  enum Kind { activations = 0, gradients = 1 };
  PipeChannels(MpiComm pp, bool wrap, const std::string& backend, const torch::Device& device);
  ~PipeChannels();
  PipeChannels(const PipeChannels&) = delete;
  PipeChannels& operator=(const PipeChannels&) = delete;
  // `t` (sent as fp32) to the next stage (activations) or the previous one (gradients); nonblocking.
  void send(const torch::Tensor& t, Kind kind);
  // A receive of `numel` fp32 values from the previous stage (activations) or the next (gradients),
  // started now; take() returns them, waited for (NCCL: by the caller's stream). One never taken
  // is cancelled when it goes.
  struct Incoming {
    torch::Tensor buffer;
    std::unique_ptr<Work> work;
  };
  Incoming post(int64_t numel, Kind kind);
  torch::Tensor take(Incoming& incoming);
  // Every send of this step on its way: MPI: delivered (their buffers may go); NCCL: the caller's
  // stream after them.
  void finish();
  // The host waits for the transfers (MPI), so pipeline_wait_seconds() is the stages' waiting; with
  // NCCL the GPU waits and the host does not.
  bool host_waits() const { return host_waits_; }

 private:
  torch::Device device_;
  bool host_waits_ = true;
  MpiComm pair_[2][2] = {};                             // [kind][0: out, 1: in], owned
  std::unique_ptr<Communicator> out_[2], in_[2];        // by kind
  std::vector<std::unique_ptr<Work>> sending_;
};

// For every channel (kind, sending stage), the messages in the order the sending stage sends them
// and in the order the receiving stage posts its receives, each as (micro-batch, receiving virtual
// stage): the two lists of each channel must be equal, since the channels match no tags.
struct ChannelOrder {
  PipeChannels::Kind kind;
  int64_t from;
  std::vector<std::pair<int64_t, int64_t>> sent, received;
};
std::vector<ChannelOrder> pipeline_channel_orders(const std::string& schedule, int64_t stages, int64_t micro_batches,
                                                  int64_t chunks = 1);

// One optimizer step's micro-batches through this rank's stage (stage `stage` of `stages`, `chunks`
// chunks: pipeline_schedule's steps) with their transfers over `channels`. A forward of virtual stage
// vs = chunk x stages + stage takes its input from virtual stage vs - 1 (vs 0: none, the tokens), a
// backward its output's gradient from vs + 1 (the last: none, the loss), each `numel` fp32 values
// whose receive is posted one step ahead (PipeChannels::post), so that it travels while the step
// before runs. forward(step, received) and backward(step, received) run the step on what arrived
// (undefined at the ends) and return what goes on: the activation to vs + 1, the input's gradient
// to vs - 1 (at the ends: nothing, an undefined tensor), sent at once (nonblocking). Every send is
// delivered when it returns.
using PipeStepFn = std::function<torch::Tensor(const PipeStep&, const torch::Tensor&)>;
void run_pipeline_steps(PipeChannels& channels, const std::vector<PipeStep>& steps, int64_t stages, int64_t stage, int64_t chunks,
                        int64_t numel, const PipeStepFn& forward, const PipeStepFn& backward);

// Seconds this process has spent waiting in the pipeline's receives and for its sends to complete
// (PipeLink, PipeChannels: the schedule's bubble and the transfers), since it started.
double pipeline_wait_seconds();

// The tags of micro-batch m's activation leaving virtual stage `from` (forward) of `virtual_stages`
// and its gradient (backward), below kPipeTagEnd (the tied embedding's exchange uses it).
constexpr int kPipeTagEnd = 32000;
inline int activation_tag(int64_t micro, int64_t from = 0, int64_t virtual_stages = 1) {
  return static_cast<int>(2 * (micro * virtual_stages + from));
}
inline int gradient_tag(int64_t micro, int64_t from = 0, int64_t virtual_stages = 1) {
  return activation_tag(micro, from, virtual_stages) + 1;
}

}  // namespace mpitrain
