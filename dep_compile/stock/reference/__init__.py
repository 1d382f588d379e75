"""Readable PyTorch references for the stock ``kimi_k3`` ops; they run on CPU and CUDA."""
