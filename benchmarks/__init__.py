"""Per-op and end-to-end throughput, compared side by side with eager PyTorch, SDPA,
``torch.compile`` and timm, and a regression gate over saved results."""
