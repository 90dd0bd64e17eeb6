"""Quantized checkpoints (compressed-tensors W8A8 int8, W8A16, W4A16): their tensors read and unpacked
(checkpoint.py), and the projection that keeps its weights quantized (linear.py), with the kernels of
engine/cpu_kernels/quant_gemm.c on CPU."""
