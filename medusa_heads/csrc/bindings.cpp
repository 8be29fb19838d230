#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace medusa_heads;
  m.def("stream_linear", &stream_linear, "x W^T + b, each row of W read once for all rows of x (float32 sums, CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("draft") = false);
  m.def("columns_linear", &columns_linear, "x W^T + b over W laid out by columns (see columns_linear.cpp)");
  m.def("rms_norm", &rms_norm, "hidden += delta (in place, when given); weight * hidden / rms(hidden) per row");
  m.def("rotary_write", &rotary_write, "rotary queries (returned) and keys; keys and values written into the cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attend", &attend, "softmax(q k^T scale + mask) v for a few queries over the cache (see attention.cpp)");
  m.def("chained_draft", &chained_draft, "chained Medusa heads' tree candidates (see draft_heads.cpp)");
  m.def("greedy_accept", &greedy_accept, "greedy verification of a tree: path, count, bonus (see greedy_accept.cpp)");
  m.def("commit_moves", &commit_moves, "a cache commit's moves of the kept tokens, in place (see cache_commit.cpp)");
  m.def("decoder_layers", &decoder_layers, "a Llama-family decoder's layers for one pass (see decoder_layers.cpp)");
}
