"""Any nn.Module made wide: torch.func's vmap over stacked parameters, layer-by-layer surgery, and the job behind
benchmark_custom."""
