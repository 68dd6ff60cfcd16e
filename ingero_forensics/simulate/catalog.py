"""Names a real training node shows: symbolized stacks, kernels, threads, kernel tasks.

Stacks are lists of frame objects, innermost first, in the two shapes the capture
writes: native ``{"module", "symbol", "offset"}`` and python
``{"file", "line", "function", "kind": "python"}``.
"""

from __future__ import annotations

import hashlib

LIB = "/usr/lib/x86_64-linux-gnu"
VENV = "/opt/train/venv/lib/python3.10/site-packages"
TORCH_LIB = f"{VENV}/torch/lib"
LIBNCCL = f"{VENV}/nvidia/nccl/lib/libnccl.so.2"
LIBCUDART = f"{VENV}/nvidia/cuda_runtime/lib/libcudart.so.12"
LIBCUDA = f"{LIB}/libcuda.so.550.90.07"
APP = "/opt/train/app"


def _off(module: str, symbol: str) -> int:
    h = hashlib.blake2b(f"{module}:{symbol}".encode(), digest_size=4).digest()
    return 0x40 + (int.from_bytes(h, "little") & 0x7FF0)


def native(module: str, symbol: str) -> dict:
    return {"module": module, "symbol": symbol, "offset": _off(module, symbol)}


def py(file: str, line: int, function: str) -> dict:
    return {"file": file, "line": line, "function": function, "kind": "python"}


_TRAIN_LOOP = [
    py(f"{APP}/train.py", 214, "train_step"),
    py(f"{APP}/train.py", 301, "train_epoch"),
    py(f"{APP}/train.py", 362, "main"),
    py(f"{APP}/train.py", 371, "<module>"),
]
_BACKWARD_PY = [
    py(f"{VENV}/torch/autograd/graph.py", 825, "_engine_run_backward"),
    py(f"{VENV}/torch/autograd/__init__.py", 347, "backward"),
    py(f"{VENV}/torch/_tensor.py", 581, "backward"),
    py(f"{APP}/train.py", 209, "train_step"),
] + _TRAIN_LOOP[1:]


def _stack(natives, python):
    return [native(m, s) for m, s in natives] + list(python)


STACKS = {
    "bucket_allreduce": _stack([
        (LIBNCCL, "ncclAllReduce"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "c10d::ProcessGroupNCCL::allreduce_impl(at::Tensor&, c10d::AllreduceOptions const&)"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "c10d::ProcessGroupNCCL::allreduce(std::vector<at::Tensor, std::allocator<at::Tensor> >&, c10d::AllreduceOptions const&)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "c10d::Reducer::run_comm_hook(c10d::GradBucket&)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "c10d::Reducer::mark_bucket_ready(unsigned long)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "c10d::Reducer::autograd_hook(unsigned long)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, torch::autograd::Node*, torch::autograd::InputBuffer&, std::shared_ptr<torch::autograd::ReadyQueue> const&)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "torch::autograd::Engine::execute(std::vector<torch::autograd::Edge, std::allocator<torch::autograd::Edge> > const&, std::vector<at::Tensor, std::allocator<at::Tensor> > const&, bool, bool, bool, std::vector<torch::autograd::Edge, std::allocator<torch::autograd::Edge> > const&)"),
        (f"{TORCH_LIB}/libtorch_python.so", "torch::autograd::python::PythonEngine::execute(std::vector<torch::autograd::Edge, std::allocator<torch::autograd::Edge> > const&, std::vector<at::Tensor, std::allocator<at::Tensor> > const&, bool, bool, bool, std::vector<torch::autograd::Edge, std::allocator<torch::autograd::Edge> > const&)"),
    ], _BACKWARD_PY),
    "loss_allreduce": _stack([
        (LIBNCCL, "ncclAllReduce"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "c10d::ProcessGroupNCCL::allreduce_impl(at::Tensor&, c10d::AllreduceOptions const&)"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "c10d::ProcessGroupNCCL::allreduce(std::vector<at::Tensor, std::allocator<at::Tensor> >&, c10d::AllreduceOptions const&)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "c10d::ops::(anonymous namespace)::allreduce_CUDA(c10::ArrayRef<at::Tensor>, c10::intrusive_ptr<c10d::ProcessGroup> const&, c10::intrusive_ptr<c10d::ReduceOp> const&, std::optional<at::Tensor> const&, long)"),
        (f"{TORCH_LIB}/libtorch_python.so", "pybind11::cpp_function::dispatcher(_object*, _object*, _object*)"),
    ], [py(f"{VENV}/torch/distributed/distributed_c10d.py", 2501, "all_reduce"),
        py(f"{VENV}/torch/distributed/c10d_logger.py", 83, "wrapper"),
        py(f"{APP}/metrics.py", 41, "reduce_mean"),
        py(f"{APP}/train.py", 226, "train_step")] + _TRAIN_LOOP[1:]),
    "h2d": _stack([
        (LIBCUDART, "cudaMemcpyAsync"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "at::native::copy_kernel_cuda(at::TensorIterator&, bool)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "at::native::copy_(at::Tensor&, at::Tensor const&, bool)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "at::native::_to_copy(at::Tensor const&, std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, bool, std::optional<c10::MemoryFormat>)"),
    ], [py(f"{APP}/train.py", 198, "train_step")] + _TRAIN_LOOP[1:]),
    "fwd_sync": _stack([
        (LIBCUDART, "cudaEventSynchronize"),
        (f"{TORCH_LIB}/libtorch_python.so", "THCPEvent_synchronize(_object*, _object*)"),
    ], [py(f"{VENV}/torch/cuda/streams.py", 226, "synchronize"),
        py(f"{APP}/timing.py", 33, "stop"),
        py(f"{APP}/train.py", 204, "train_step")] + _TRAIN_LOOP[1:]),
    "bwd_sync": _stack([
        (LIBCUDART, "cudaStreamSynchronize"),
        (f"{TORCH_LIB}/libc10_cuda.so", "c10::cuda::stream_synchronize(CUstream_st*)"),
        (f"{TORCH_LIB}/libtorch_python.so", "THCPStream_synchronize(_object*, _object*)"),
    ], [py(f"{VENV}/torch/cuda/streams.py", 107, "synchronize"),
        py(f"{APP}/train.py", 212, "train_step")] + _TRAIN_LOOP[1:]),
    "d2h": _stack([
        (LIBCUDART, "cudaMemcpyAsync"),
        (f"{TORCH_LIB}/libc10_cuda.so", "c10::cuda::memcpy_and_sync(void*, void const*, long, cudaMemcpyKind, CUstream_st*)"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "at::native::_local_scalar_dense_cuda(at::Tensor const&)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "at::native::item(at::Tensor const&)"),
    ], [py(f"{APP}/train.py", 227, "train_step")] + _TRAIN_LOOP[1:]),
    "loss_sync": _stack([
        (LIBCUDART, "cudaStreamSynchronize"),
        (f"{TORCH_LIB}/libc10_cuda.so", "c10::cuda::memcpy_and_sync(void*, void const*, long, cudaMemcpyKind, CUstream_st*)"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "at::native::_local_scalar_dense_cuda(at::Tensor const&)"),
        (f"{TORCH_LIB}/libtorch_cpu.so", "at::native::item(at::Tensor const&)"),
    ], [py(f"{APP}/train.py", 227, "train_step")] + _TRAIN_LOOP[1:]),
    "launch_gemm": _stack([
        (LIBCUDART, "cudaLaunchKernel"),
        (f"{LIB}/libcublasLt.so.12", "cublasLtMatmul"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "at::cuda::blas::gemm_internal<c10::BFloat16>(char, char, long, long, long, at::OpMathType<c10::BFloat16>::type, c10::BFloat16 const*, long, c10::BFloat16 const*, long, at::OpMathType<c10::BFloat16>::type, c10::BFloat16*, long)"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "at::native::addmm_out_cuda_impl(at::Tensor&, at::Tensor const&, at::Tensor const&, at::Tensor const&, c10::Scalar const&, c10::Scalar const&, at::native::Activation)"),
    ], [py(f"{VENV}/torch/nn/modules/linear.py", 125, "forward"),
        py(f"{VENV}/torch/nn/modules/module.py", 1747, "_call_impl"),
        py(f"{APP}/model.py", 88, "forward"),
        py(f"{APP}/train.py", 202, "train_step")] + _TRAIN_LOOP[1:]),
    "launch_attn": _stack([
        (LIBCUDART, "cudaLaunchKernel"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "pytorch_flash::run_mha_fwd_(Flash_fwd_params&, CUstream_st*, bool)"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "at::native::_scaled_dot_product_flash_attention_cuda(at::Tensor const&, at::Tensor const&, at::Tensor const&, double, bool, bool, std::optional<double>)"),
    ], [py(f"{VENV}/torch/nn/functional.py", 5719, "scaled_dot_product_attention"),
        py(f"{APP}/model.py", 61, "forward"),
        py(f"{APP}/train.py", 202, "train_step")] + _TRAIN_LOOP[1:]),
    "comm_init": _stack([
        (LIBNCCL, "ncclCommInitRankConfig"),
        (f"{TORCH_LIB}/libtorch_cuda.so", "c10d::ProcessGroupNCCL::getNCCLComm(std::string const&, c10::Device&, c10d::OpType, int, bool)"),
    ], [py(f"{VENV}/torch/distributed/distributed_c10d.py", 1605, "init_process_group"),
        py(f"{APP}/train.py", 331, "main"), py(f"{APP}/train.py", 371, "<module>")]),
    "malloc": _stack([
        (LIBCUDART, "cudaMalloc"),
        (f"{TORCH_LIB}/libc10_cuda.so", "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)"),
    ], [py(f"{APP}/model.py", 140, "build_model"), py(f"{APP}/train.py", 340, "main"),
        py(f"{APP}/train.py", 371, "<module>")]),
    "module_load": _stack([
        (LIBCUDA, "cuModuleLoadData"),
        (LIBCUDART, "cudaGetDeviceCount"),
    ], [py(f"{VENV}/torch/cuda/__init__.py", 319, "_lazy_init"),
        py(f"{APP}/train.py", 328, "main"), py(f"{APP}/train.py", 371, "<module>")]),
}

KERNELS = {
    "launch_gemm": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
    "launch_attn": "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
}

#: kernel tasks that briefly take a CPU from a training thread on any node (benign)
KERNEL_TASKS = ("kworker/u386:2", "ksoftirqd/{cpu}", "migration/{cpu}", "kworker/{cpu}:1H",
                "rcu_preempt", "irq/214-mlx5_com")
#: other processes that show up on a healthy node
SYSTEM_TASKS = ("node_exporter", "dcgm-exporter", "systemd-journal", "containerd", "sshd")

#: the last one is NCCL's proxy thread, which moves the bytes (it keeps the name it
#: inherits: NCCL names its threads only with NCCL_SET_THREAD_NAME=1)
RANK_THREADS = ("python3", "pt_data_pin", "pt_data_worker", "pt_data_worker",
                "cuda-EvtHandlr", "pt_nccl_watchdg", "python3")
