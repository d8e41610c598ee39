// The Python module of robust-attn's CPU kernels, built on first use by robust_attn/layers/cpu_kernels.py:
// the footprint window loops (window_ops.cpp, window_rel_ops.cpp) and the fused SAN operators (pairwise_ops.cpp,
// patchwise_ops.cpp).
#include <torch/extension.h>

void register_window_ops(pybind11::module_& m);
void register_window_rel_ops(pybind11::module_& m);
void register_pairwise_ops(pybind11::module_& m);
void register_patchwise_ops(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_window_ops(m);
  register_window_rel_ops(m);
  register_pairwise_ops(m);
  register_patchwise_ops(m);
}
