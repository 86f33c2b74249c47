// AllReduce: the sum of a tensor over the ranks of an MPI communicator, in a fixed order.
//
// The library links no MPI and includes no MPI header, so a normgrad built without MPI
// installs and runs everywhere. normgrad.mpi (Python, through mpi4py) hands it, through
// normgrad_mpi_configure, the addresses of MPI_Alltoallv, MPI_Allgatherv and
// MPI_Error_string in the MPI library mpi4py loaded, the communicator's and MPI_BYTE's
// handles, and the width of a handle: 8 for pointer handles (Open MPI), 4 for int handles
// (MPICH and its derivatives). Unconfigured, or on a communicator of one rank, the kernel
// is the identity, except that it fails, unconfigured, in a process an MPI launcher started
// as one of several ranks (a data-parallel graph there without normgrad.mpi.init() would
// silently train each rank on its own gradients).
//
// Deterministic by construction, whatever algorithm the MPI library would choose for
// MPI_Allreduce: the buffer is cut into one chunk per rank; an Alltoallv brings chunk k of
// every rank to rank k, which adds the copies in rank order in double and rounds once to
// T; an Allgatherv gives every rank every reduced chunk. So every rank gets the same bits,
// run after run, and each rank sends 2·(size−1)/size of the buffer, as a ring all-reduce
// does. Long buffers go in segments of kSegment elements: bounded temporaries, and byte
// counts that fit MPI's int.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "AllReduce";
constexpr size_t kSegment = size_t(1) << 22;

struct MpiConfig {
  bool configured = false;  // normgrad_mpi_configure was called (handle_size 0 then: deliberately the identity)
  int handle_size = 0;  // 0: not configured
  void* alltoallv = nullptr;
  void* allgatherv = nullptr;
  void* error_string = nullptr;
  int64_t comm = 0;
  int64_t byte = 0;
  int rank = 0;
  int size = 1;
};

// One collective at a time in this process (sessions running on several threads must not
// interleave their messages); also guards g_mpi.
std::mutex g_mutex;
MpiConfig g_mpi;

template <class H>
H as_handle(int64_t value) {
  if constexpr (std::is_pointer_v<H>) {
    return reinterpret_cast<H>(static_cast<intptr_t>(value));
  } else {
    return static_cast<H>(static_cast<int32_t>(static_cast<uint32_t>(value)));
  }
}

// The two collectives, with handles of type H (void* or int32_t).
template <class H>
struct Collectives {
  using Alltoallv = int (*)(const void*, const int*, const int*, H, void*, const int*, const int*, H, H);
  using Allgatherv = int (*)(const void*, int, H, void*, const int*, const int*, H, H);

  static int alltoallv(const MpiConfig& m, const void* send, const int* send_counts, const int* send_offsets,
                       void* recv, const int* recv_counts, const int* recv_offsets) {
    const H byte = as_handle<H>(m.byte);
    return reinterpret_cast<Alltoallv>(m.alltoallv)(send, send_counts, send_offsets, byte, recv, recv_counts,
                                                    recv_offsets, byte, as_handle<H>(m.comm));
  }
  static int allgatherv(const MpiConfig& m, const void* send, int count, void* recv, const int* recv_counts,
                        const int* recv_offsets) {
    const H byte = as_handle<H>(m.byte);
    return reinterpret_cast<Allgatherv>(m.allgatherv)(send, count, byte, recv, recv_counts, recv_offsets, byte,
                                                      as_handle<H>(m.comm));
  }
};

void check_mpi(const MpiConfig& m, int code, const char* call) {
  if (code == 0) return;
  std::string text = "error code " + std::to_string(code);
  if (m.error_string != nullptr) {
    char buffer[1024] = {};
    int length = 0;
    using ErrorString = int (*)(int, char*, int*);
    if (reinterpret_cast<ErrorString>(m.error_string)(code, buffer, &length) == 0) {
      text = std::string(buffer, static_cast<size_t>(std::clamp(length, 0, 1023)));
    }
  }
  fail(std::string(kOp) + ": " + call + " failed on rank " + std::to_string(m.rank) + ": " + text, ORT_FAIL);
}

int alltoallv(const MpiConfig& m, const void* s, const int* sc, const int* sd, void* r, const int* rc, const int* rd) {
  return m.handle_size == 8 ? Collectives<void*>::alltoallv(m, s, sc, sd, r, rc, rd)
                            : Collectives<int32_t>::alltoallv(m, s, sc, sd, r, rc, rd);
}

int allgatherv(const MpiConfig& m, const void* s, int count, void* r, const int* rc, const int* rd) {
  return m.handle_size == 8 ? Collectives<void*>::allgatherv(m, s, count, r, rc, rd)
                            : Collectives<int32_t>::allgatherv(m, s, count, r, rc, rd);
}

size_t element_size(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return 8;
    default: return 0;
  }
}

// out[i] = Σ_r parts[r][i] (r in rank order, in double, rounded once), parts `stride` bytes apart.
template <class Load, class Store>
void sum_in_rank_order(const char* parts, size_t stride, int ranks, size_t count, char* out, Load load, Store store) {
  for (size_t i = 0; i < count; ++i) {
    double total = 0.0;
    for (int r = 0; r < ranks; ++r) total += load(parts + static_cast<size_t>(r) * stride, i);
    store(out, i, total);
  }
}

void sum_parts(ONNXTensorElementDataType t, const char* parts, size_t stride, int ranks, size_t count, char* out) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      sum_in_rank_order(
          parts, stride, ranks, count, out, [](const char* p, size_t i) { return reinterpret_cast<const double*>(p)[i]; },
          [](char* p, size_t i, double v) { reinterpret_cast<double*>(p)[i] = v; });
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      sum_in_rank_order(
          parts, stride, ranks, count, out,
          [](const char* p, size_t i) { return static_cast<double>(reinterpret_cast<const float*>(p)[i]); },
          [](char* p, size_t i, double v) { reinterpret_cast<float*>(p)[i] = static_cast<float>(v); });
      break;
    default: {
      const DType d = t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? kF16 : kBF16;
      sum_in_rank_order(
          parts, stride, ranks, count, out, [d](const char* p, size_t i) { return static_cast<double>(load_float(d, p, i)); },
          [d](char* p, size_t i, double v) { store_float(d, p, i, static_cast<float>(v)); });
    }
  }
}

// The number of ranks an MPI launcher started the job with, from the environment (Open MPI's
// mpirun, MPICH's Hydra / Intel MPI / Slurm PMI, MVAPICH2; normgrad.mpi.LAUNCHER_SIZE_VARIABLES
// in Python lists the same), 1 outside a multi-rank launch.
int launched_ranks() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    const long ranks = std::strtol(value, &end, 10);
    if (*end == '\0' && ranks > 0) return ranks > 1 << 30 ? 1 << 30 : static_cast<int>(ranks);
  }
  return 1;
}

// Fails on every rank unless all ranks pass the same element type and count (a mismatch
// would otherwise hang or mix up the exchange).
void check_ranks_agree(const MpiConfig& m, const Input& in) {
  const int64_t mine[2] = {static_cast<int64_t>(in.onnx_type), static_cast<int64_t>(in.size)};
  std::vector<int64_t> all(2 * static_cast<size_t>(m.size));
  std::vector<int> counts(m.size, sizeof mine), offsets(m.size);
  for (int r = 0; r < m.size; ++r) offsets[r] = r * static_cast<int>(sizeof mine);
  check_mpi(m, allgatherv(m, mine, sizeof mine, all.data(), counts.data(), offsets.data()), "MPI_Allgatherv");
  for (int r = 0; r < m.size; ++r) {
    if (all[2 * r] != mine[0] || all[2 * r + 1] != mine[1]) {
      fail(std::string(kOp) + ": ranks disagree on the input: rank " + std::to_string(m.rank) + " has " +
           std::to_string(mine[1]) + " elements of " + dtype_name(in.onnx_type) + ", rank " + std::to_string(r) +
           " has " + std::to_string(all[2 * r + 1]) + " elements of " +
           dtype_name(static_cast<ONNXTensorElementDataType>(all[2 * r])) +
           "; every rank must run the same graph on inputs of the same shapes");
    }
  }
}

void all_reduce_in_place(const MpiConfig& m, ONNXTensorElementDataType type, char* data, size_t count) {
  const size_t esize = element_size(type);
  const int ranks = m.size;
  std::vector<int> send_counts(ranks), send_offsets(ranks), recv_counts(ranks), recv_offsets(ranks);
  std::vector<char> received, reduced;
  for (size_t start = 0; start < count; start += kSegment) {
    const size_t length = std::min(kSegment, count - start);
    char* segment = data + start * esize;
    auto bound = [&](int k) { return length * static_cast<size_t>(k) / static_cast<size_t>(ranks); };
    for (int k = 0; k < ranks; ++k) {
      send_counts[k] = static_cast<int>((bound(k + 1) - bound(k)) * esize);
      send_offsets[k] = static_cast<int>(bound(k) * esize);
    }
    const size_t chunk = bound(m.rank + 1) - bound(m.rank);
    const size_t chunk_bytes = chunk * esize;
    for (int r = 0; r < ranks; ++r) {
      recv_counts[r] = static_cast<int>(chunk_bytes);
      recv_offsets[r] = static_cast<int>(static_cast<size_t>(r) * chunk_bytes);
    }
    received.resize(std::max<size_t>(1, ranks * chunk_bytes));
    reduced.resize(std::max<size_t>(1, chunk_bytes));
    check_mpi(m,
              alltoallv(m, segment, send_counts.data(), send_offsets.data(), received.data(), recv_counts.data(),
                        recv_offsets.data()),
              "MPI_Alltoallv");
    sum_parts(type, received.data(), chunk_bytes, ranks, chunk, reduced.data());
    check_mpi(m,
              allgatherv(m, reduced.data(), static_cast<int>(chunk_bytes), segment, send_counts.data(),
                         send_offsets.data()),
              "MPI_Allgatherv");
  }
}

struct AllReduce final : KernelBase {
  explicit AllReduce(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input in = get_input_any_type(ctx, 0, kOp, "input");
    if (!in.present) fail(std::string(kOp) + ": input 'input' is required");
    const size_t esize = element_size(in.onnx_type);
    if (esize == 0) {
      fail(std::string(kOp) + ": input 'input' must be float32, float16, bfloat16 or float64; got " +
           dtype_name(in.onnx_type));
    }
    char* out = static_cast<char*>(get_output(ctx, 0, in.shape));
    if (in.size != 0) std::memcpy(out, in.data, in.size * esize);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_mpi.configured) {
      const int ranks = launched_ranks();
      if (ranks > 1) {
        fail(std::string(kOp) + ": this process is one of " + std::to_string(ranks) +
             " MPI ranks but normgrad's AllReduce is not configured: call normgrad.mpi.init() before running a "
             "--data-parallel or --sync-batch-norm graph (unconfigured, each rank would train on its own gradients)");
      }
    }
    if (g_mpi.handle_size == 0 || g_mpi.size <= 1) return;
    check_ranks_agree(g_mpi, in);
    all_reduce_in_place(g_mpi, in.onnx_type, out, in.size);
  }
};

}  // namespace

extern const OpDescriptor kAllReduce = {
    kOp, 1, 1, "T", "0", "T", "0", 'd', 0, &create_kernel<AllReduce>,
};

}  // namespace normgrad

// Called by normgrad.mpi (through ctypes) with what the kernel needs from the MPI library
// mpi4py loaded; handle_size 0 (or size 1) makes AllReduce the identity again. Returns 0, or
// -1 for an argument it refuses (a handle width other than 0, 4 or 8, missing functions, a
// rank outside [0, size)).
extern "C" __attribute__((visibility("default"))) int normgrad_mpi_configure(int handle_size, void* alltoallv,
                                                                            void* allgatherv, void* error_string,
                                                                            int64_t comm, int64_t byte_type,
                                                                            int rank, int size) {
  using namespace normgrad;
  if (handle_size != 0 && handle_size != 4 && handle_size != 8) return -1;
  if (handle_size != 0 && (alltoallv == nullptr || allgatherv == nullptr || size < 1 || rank < 0 || rank >= size)) {
    return -1;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_mpi = MpiConfig{true, handle_size, alltoallv, allgatherv, error_string, comm, byte_type, rank,
                    handle_size ? size : 1};
  return 0;
}

// The number of ranks AllReduce sums over (1 when unconfigured).
extern "C" __attribute__((visibility("default"))) int normgrad_mpi_size() {
  std::lock_guard<std::mutex> lock(normgrad::g_mutex);
  return normgrad::g_mpi.size;
}
