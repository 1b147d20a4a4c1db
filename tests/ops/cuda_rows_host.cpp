// Host driver for csrc/logprob_kl_cuda_rows.cuh: runs one CUDA thread block per row on the CPU
// (each of the block's threads in turn, then the warp-shuffle merges in the kernels' order), so
// tests/ops/test_cuda_rows_on_host.py can check the CUDA kernels' arithmetic without a GPU.
//
//   cuda_rows_host OP DTYPE IN OUT      OP: partials | grad | exact_partials | exact_grad
//                                       DTYPE: f32 | bf16 | f16
// IN: int64 header [N, V, offset, flag_a, flag_b], then the op's arrays (see main); row r of
// the logits starts `offset` elements past a 64-byte boundary plus r * V elements, as a shard's
// rows do in a larger tensor. OUT: the kernel's outputs, raw, in order.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <string>
#include <vector>

#include "logprob_kl_cuda_rows.cuh"

using namespace megatron_rl::cuda_rows;

constexpr int kThreads = 256;  // logprob_kl_cuda.cu: kThreads

struct Reader {
  FILE* f;
  template <typename U>
  std::vector<U> read(size_t n) {
    std::vector<U> v(n);
    if (n && fread(v.data(), sizeof(U), n, f) != n) throw std::runtime_error("short input");
    return v;
  }
};

// A [N, V] tensor whose data starts `offset` elements after a 64-byte boundary.
template <typename T>
struct Rows {
  void* raw;
  T* data;
  Rows(int64_t n, int64_t v, int64_t offset) {
    raw = std::aligned_alloc(64, ((n * v + offset) * sizeof(T) + 63) / 64 * 64 + 64);
    data = reinterpret_cast<T*>(raw) + offset;
  }
  ~Rows() { std::free(raw); }
};

// __shfl_xor_sync butterfly over `lanes` states of one warp: every lane merges its own state
// with its partner's, all lanes at once, for offsets 16, 8, 4, 2, 1.
template <typename S, typename Merge>
void warp_butterfly(std::vector<S>& lanes, Merge merge) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    std::vector<S> next(lanes.size());
    for (size_t l = 0; l < lanes.size(); ++l) next[l] = merge(lanes[l], lanes[l ^ offset]);
    lanes = next;
  }
}

// block_reduce / exact_block_reduce of logprob_kl_cuda.cu, thread 0's result.
template <typename S, typename Merge>
S block_reduce(std::vector<S> states, S empty, Merge merge) {
  std::vector<S> warp_states;
  for (int w = 0; w < kThreads / 32; ++w) {
    std::vector<S> lanes(states.begin() + 32 * w, states.begin() + 32 * (w + 1));
    warp_butterfly(lanes, merge);
    warp_states.push_back(lanes[0]);
  }
  std::vector<S> lanes(32, empty);
  for (size_t w = 0; w < warp_states.size(); ++w) lanes[w] = warp_states[w];
  warp_butterfly(lanes, merge);
  return lanes[0];
}

template <typename T>
void run(const std::string& op, Reader in, FILE* out) {
  const auto hdr = in.read<int64_t>(5);
  const int64_t n = hdr[0], v = hdr[1], offset = hdr[2], flag_a = hdr[3], flag_b = hdr[4];
  Rows<T> x(n, v, offset);
  auto xs = in.read<T>(n * v);
  std::memcpy(x.data, xs.data(), n * v * sizeof(T));
  if (op == "partials") {  // flag_a: entropy; in: inv_t; out: m, s, w per row
    const float inv_t = in.read<float>(1)[0];
    for (int64_t r = 0; r < n; ++r) {
      std::vector<State> states;
      for (int tid = 0; tid < kThreads; ++tid) {
        states.push_back(flag_a ? thread_partials<T, true>(x.data + r * v, v, inv_t, tid, kThreads)
                                : thread_partials<T, false>(x.data + r * v, v, inv_t, tid, kThreads));
      }
      const State st = block_reduce(states, empty_state(), [&](const State& a, const State& b) {
        return flag_a ? merge<true>(a, b) : merge<false>(a, b);
      });
      fwrite(&st, sizeof(float), 3, out);
    }
  } else if (op == "grad") {  // flag_a: entropy, flag_b: vectorized; in: t, m, ls, a, b, h, inv_t
    const auto t = in.read<int64_t>(n);
    const auto m = in.read<float>(n), ls = in.read<float>(n), a = in.read<float>(n);
    const auto b = in.read<float>(n), h = in.read<float>(n);
    const float inv_t = in.read<float>(1)[0];
    Rows<T> g(n, v, flag_b ? offset : offset + 1);  // unequal alignment: the scalar path
    for (int64_t r = 0; r < n; ++r) {
      for (int tid = 0; tid < kThreads; ++tid) {
        auto args = std::make_tuple(x.data + r * v, g.data + r * v, v, t[r], m[r], ls[r], a[r],
                                    b[r], h[r], inv_t, int64_t{tid}, int64_t{kThreads});
        if (flag_a && flag_b) std::apply(thread_grad<T, true, true>, args);
        else if (flag_a) std::apply(thread_grad<T, true, false>, args);
        else if (flag_b) std::apply(thread_grad<T, false, true>, args);
        else std::apply(thread_grad<T, false, false>, args);
      }
    }
    fwrite(g.data, sizeof(T), n * v, out);
  } else if (op == "exact_partials") {  // flag_a: vectorized; in: ref; out: mp, sp, mq, sq, w
    Rows<T> y(n, v, flag_a ? offset : offset + 1);
    auto ys = in.read<T>(n * v);
    std::memcpy(y.data, ys.data(), n * v * sizeof(T));
    for (int64_t r = 0; r < n; ++r) {
      std::vector<ExactState> states;
      for (int tid = 0; tid < kThreads; ++tid) {
        states.push_back(flag_a ? thread_exact_partials<T, true>(x.data + r * v, y.data + r * v, v, tid, kThreads)
                                : thread_exact_partials<T, false>(x.data + r * v, y.data + r * v, v, tid, kThreads));
      }
      const ExactState st = block_reduce(states, empty_exact_state(), exact_merge);
      fwrite(&st, sizeof(float), 5, out);
    }
  } else if (op == "exact_grad") {  // flag_a: vectorized, flag_b: accumulate; in: ref, mp, lp,
                                    // mq, lq, kl, gk, (grad to accumulate into)
    Rows<T> y(n, v, flag_a ? offset : offset + 1);
    auto ys = in.read<T>(n * v);
    std::memcpy(y.data, ys.data(), n * v * sizeof(T));
    const auto mp = in.read<float>(n), lp = in.read<float>(n), mq = in.read<float>(n);
    const auto lq = in.read<float>(n), kl = in.read<float>(n), gk = in.read<float>(n);
    Rows<T> g(n, v, flag_a ? offset : offset + 1);
    if (flag_b) {
      auto gs = in.read<T>(n * v);
      std::memcpy(g.data, gs.data(), n * v * sizeof(T));
    }
    for (int64_t r = 0; r < n; ++r) {
      for (int tid = 0; tid < kThreads; ++tid) {
        auto args = std::make_tuple(x.data + r * v, y.data + r * v, g.data + r * v, v, mp[r],
                                    lp[r], mq[r], lq[r], kl[r], gk[r], int64_t{tid},
                                    int64_t{kThreads});
        if (flag_a && flag_b) std::apply(thread_exact_grad<T, true, true>, args);
        else if (flag_a) std::apply(thread_exact_grad<T, true, false>, args);
        else if (flag_b) std::apply(thread_exact_grad<T, false, true>, args);
        else std::apply(thread_exact_grad<T, false, false>, args);
      }
    }
    fwrite(g.data, sizeof(T), n * v, out);
  } else {
    throw std::runtime_error("unknown op " + op);
  }
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s OP DTYPE IN OUT\n", argv[0]);
    return 2;
  }
  const std::string op = argv[1], dtype = argv[2];
  FILE* fin = fopen(argv[3], "rb");
  FILE* fout = fopen(argv[4], "wb");
  if (!fin || !fout) {
    fprintf(stderr, "cannot open %s or %s\n", argv[3], argv[4]);
    return 2;
  }
  try {
    if (dtype == "f32") run<float>(op, Reader{fin}, fout);
    else if (dtype == "bf16") run<c10::BFloat16>(op, Reader{fin}, fout);
    else if (dtype == "f16") run<c10::Half>(op, Reader{fin}, fout);
    else throw std::runtime_error("unknown dtype " + dtype);
  } catch (const std::exception& e) {
    fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  fclose(fout);
  return 0;
}
