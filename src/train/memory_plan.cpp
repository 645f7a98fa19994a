// Memory per rank for each layout (see memory_plan.h).
#include "mpitrain/memory_plan.h"

#include <algorithm>
#include <cstdio>

#include "mpitrain/error.h"

namespace mpitrain {

std::string MemoryRow::largest_term() const {
  const std::pair<const char*, double> terms[] = {
      {"weights", weights}, {"gradients", gradients}, {"gradient buffers", buffers},
      {"optimizer state", optimizer}, {"activations", activations}};
  const auto* top = std::max_element(std::begin(terms), std::end(terms),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  return top->first;
}

std::vector<MemoryRow> memory_rows(const MemoryInputs& in) {
  // n: every element; s: those ZeRO shards, w: those it does not (each rank's experts).
  const double n = static_cast<double>(in.params), d = static_cast<double>(std::max<int64_t>(1, in.dp));
  const double w = static_cast<double>(in.whole_params), s = n - w;
  const double block = 4.0 * static_cast<double>(in.largest_block), outside = 4.0 * static_cast<double>(in.outside_params);
  const bool shards = in.dp > 1;
  const int64_t every = std::max<int64_t>(1, in.ac_every);
  const int64_t checkpointed = in.n_layer / every;  // blocks every-1, 2 every-1, ... (GPTImpl::checkpointed)
  std::vector<MemoryRow> rows;
  for (int zero = 0; zero <= 3; ++zero)
    for (const char* ac : {"none", "selective", "full"}) {
      MemoryRow r;
      r.zero = zero;
      r.ac = ac;
      r.weights = zero == 3 && shards ? 4 * s / d + outside + 2 * block + 4 * w : 4 * n;
      r.gradients = zero >= 2 && shards ? 4 * s / d + 4 * w : 4 * n;
      if (shards) {  // (the whole elements' flat buckets beside the others')
        if (zero <= 1) r.buffers = 4 * n + (zero == 1 ? 4 * s / d : 0);  // flat buckets (+ ZeRO-1's shard)
        else if (zero == 2) r.buffers = std::min(4 * s, 2 * in.bucket_mb * 1024 * 1024) + 4 * w;  // buckets in flight
        else r.buffers = outside + 3 * block + 4 * w;  // the outside unit's gradient, three blocks'
      }
      const double moments = 2.0 * static_cast<double>(in.moment_bytes);
      r.optimizer = zero >= 1 && shards ? moments * (s / d + w) : moments * n;
      const int64_t kept = r.ac == "none" ? 0 : checkpointed;
      const double per_kept = r.ac == "full" ? in.block_full : in.block_selective;
      r.activations = static_cast<double>(in.n_layer - kept) * in.block_none + static_cast<double>(kept) * per_kept +
                      (kept > 0 ? in.block_none : 0) + in.outside;
      rows.push_back(r);
    }
  return rows;
}

MemoryRow memory_row(const MemoryInputs& in, int zero, const std::string& ac) {
  for (const MemoryRow& r : memory_rows(in))
    if (r.zero == zero && r.ac == ac) return r;
  throw Error(concat("memory_row: no layout zero ", zero, ", checkpointing ", ac));
}

namespace {
double mib(double bytes) { return bytes / (1024.0 * 1024.0); }
// MiB for the table: whole MiB from 100 up, one decimal from 1, three significant digits below.
std::string cell(double bytes) {
  const double v = mib(bytes);
  char b[32];
  std::snprintf(b, sizeof b, v >= 100 ? "%.0f" : v >= 1 ? "%.1f" : "%.3g", v);
  return b;
}
}  // namespace

std::string memory_report(const MemoryInputs& in, double memory_gib, const std::string& memory_source) {
  const auto rows = memory_rows(in);
  std::string out = concat("memory per rank (MiB; ", in.params, " parameters, dp ", in.dp,
                           "; activations of one micro-batch as measured: ", mib(in.block_none), " MiB per block, ",
                           mib(in.block_selective), " MiB per selectively checkpointed block, ", mib(in.block_full),
                           " MiB per fully checkpointed block, ", mib(in.outside),
                           " MiB outside the blocks; peak = the sum of the terms, not a bound: on an H100 0.89x-1.41x of it was measured, bench/RESULTS.md):\n");
  out += "| optim.zero | activation_checkpointing | weights | gradients | gradient buffers | optimizer state | "
         "activations | peak |\n|---:|---|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : rows) {
    out += concat("| ", r.zero, " | ", r.ac,
                  r.ac != "none" && in.ac_every > 1 ? concat(", every ", in.ac_every) : std::string(), " | ",
                  cell(r.weights), " | ", cell(r.gradients), " | ", cell(r.buffers), " | ", cell(r.optimizer), " | ",
                  cell(r.activations), " | ", cell(r.peak()), " |\n");
  }
  if (memory_gib <= 0) {
    out += "memory: no limit given (--memory GiB; on a GPU the device's memory is the default): no recommendation";
    return out;
  }
  const double limit = memory_gib * 1024 * 1024 * 1024;
  // Expected speed: no recomputation first; then the stages that communicate least (with one
  // data-parallel rank the zero stages shard nothing: zero 0 only).
  std::string why;
  for (const char* ac : {"none", "selective", "full"})
    for (int zero = 0; zero <= (in.dp > 1 ? 3 : 0); ++zero) {
      const MemoryRow r = memory_row(in, zero, ac);
      if (r.peak() <= limit) {
        out += concat("memory recommendation (", memory_source, ": ", memory_gib, " GiB): optim.zero: ", r.zero,
                      ", train.activation_checkpointing: ", r.ac, " -> ", mib(r.peak()), " MiB per rank",
                      why.empty() ? std::string(" (the fastest layout fits)") : concat("; faster ones do not fit: ", why));
        return out;
      }
      if (!why.empty()) why += "; ";
      why += concat("zero ", r.zero, " + ", r.ac, " needs ", mib(r.peak()), " MiB (largest: ", r.largest_term(), ")");
    }
  out += concat("memory recommendation (", memory_source, ": ", memory_gib, " GiB): no layout fits: ", why,
                ": more data-parallel ranks, parallel.tp, a smaller micro-batch or a device with more memory");
  return out;
}

double expert_exchange_bytes(int64_t sparse_layers, int64_t copies, int64_t n_embd, int64_t in_bytes, int64_t out_bytes,
                             int64_t ep, int64_t accum) {
  if (ep <= 1) return 0;
  const double leaving = static_cast<double>(ep - 1) / static_cast<double>(ep);
  return 2.0 * static_cast<double>(sparse_layers) * static_cast<double>(accum) * static_cast<double>(copies) *
         static_cast<double>(n_embd) * static_cast<double>(in_bytes + out_bytes) * leaving;
}

}  // namespace mpitrain
