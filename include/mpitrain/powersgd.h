// comm.compress: powersgd — low-rank gradient compression with error feedback (Vogels, Karimireddy
// and Jaggi, "PowerSGD", NeurIPS 2019; PyTorch DDP's powerSGD_hook behaves the same way).
//
// Each weight matrix's gradient M (rows x cols, after adding this rank's error e) is sent as two
// thin factors instead of rows x cols numbers: P = M Q is all-reduced and orthonormalised
// (Gram-Schmidt), Q = Mᵀ P is all-reduced and divided by the group size, and the gradient becomes
// P Qᵀ, the projection of the ranks' mean gradient onto span(P) — the same on every rank. What the
// approximation left out stays in e = M − P Qᵀ and is added to the next step's gradient, so
// nothing is lost for good, only delayed. Q starts from the same random draw on every rank (a
// seed) and is kept between steps (one step of power iteration per training step). Tensors with
// one dimension (biases, LayerNorm) and matrices too small to gain (rank x (rows + cols) >=
// rows x cols) are all-reduced as they are, in one bucket of a GradSync (grad_sync.h).
//
// Per step a rank sends (rows + cols) x rank numbers per compressed matrix instead of rows x
// cols: for GPT-2 124M at rank 4 about 1/135 of the bytes (0.92M numbers instead of 124M). Costs: two all-reduces instead of
// one, two thin matrix products per matrix, and e (the size of the compressed gradients). The
// error and Q are not in checkpoints: a resumed run starts them afresh (zero error, the seed's Q).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"

namespace mpitrain {

class PowerSgd {
 public:
  // params: the model's parameters (their .grad() are reduced in place); rank: comm.powersgd_rank.
  // Each compressed matrix's first Q is drawn from `seed` and its name in `names` (empty: its index).
  PowerSgd(std::vector<torch::Tensor> params, Communicator& comm, int64_t rank, uint64_t seed,
           const std::vector<std::string>& names = {});

  // Replaces every .grad() by the (approximate, for compressed matrices) mean over the ranks;
  // the same values on every rank. Parameters without a gradient count as zeros.
  void reduce_grads();

  // Bytes one step all-reduces (the factors plus the plain tensors, fp32).
  uint64_t bytes_per_step() const;
  // Bytes the same gradients take uncompressed.
  uint64_t uncompressed_bytes() const;
  size_t compressed_matrices() const { return mats_.size(); }

 private:
  struct Matrix {
    size_t param;
    int64_t rows, cols, rank;
    torch::Tensor q;      // cols x rank, kept between steps
    torch::Tensor error;  // rows x cols: what earlier approximations left out (this rank's)
  };
  std::vector<torch::Tensor> params_;
  std::unique_ptr<GradSync> plain_;  // the parameters all-reduced as they are (null: none)
  std::vector<Matrix> mats_;
  Communicator& comm_;
};

// Gram-Schmidt in place: the columns of p (n x r, r <= n) become orthonormal, in order.
void orthonormalize_columns(torch::Tensor& p);

}  // namespace mpitrain
