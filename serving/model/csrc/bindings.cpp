// The Python module: what load_inline's `functions=` generated, each function wrapped so that a TORCH_CHECK
// failure reaches Python as a RuntimeError.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("gelu_tanh_", torch::wrap_pybind_function(gelu_tanh_), "gelu_tanh_");
  m.def("store_kv_", torch::wrap_pybind_function(store_kv_), "store_kv_");
  m.def("prefill_attention_", torch::wrap_pybind_function(prefill_attention_), "prefill_attention_");
  m.def("has_prefill", torch::wrap_pybind_function(has_prefill), "has_prefill");
}
