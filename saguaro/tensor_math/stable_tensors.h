// Tensors made for and read by the saguaro_kernels ops without a trip through the dispatcher.
//
// A draft step calls these kernels about twenty times; each torch::stable::contiguous or new_empty is a
// dispatcher call (the op looked up by name, its arguments boxed and unboxed): 0.3 and 0.8 us here, beside a
// whole small linear's 1.7 us call. contiguous_of returns a contiguous tensor itself, and new_float allocates
// through the C shim Inductor's own wrapper allocates with.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>

namespace saguaro {

inline torch::stable::Tensor contiguous_of(const torch::stable::Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// A new contiguous float32 tensor of `sizes` (at most 8 dimensions) on `like`'s device.
inline torch::stable::Tensor new_float(const torch::stable::Tensor& like, std::initializer_list<int64_t> sizes) {
  constexpr int64_t MAX_DIMS = 8;
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  if (ndim > MAX_DIMS) throw std::runtime_error("new_float: at most 8 dimensions");
  int64_t shape[MAX_DIMS], strides[MAX_DIMS];
  int64_t d = 0;
  for (int64_t size : sizes) shape[d++] = size;
  int64_t stride = 1;
  for (d = ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= shape[d];
  }
  int32_t device_type = 0, device_index = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, shape, strides, aoti_torch_dtype_float32(), device_type,
                                                         device_index, &handle));
  return torch::stable::Tensor(handle);
}

}  // namespace saguaro
