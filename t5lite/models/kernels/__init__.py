"""t5lite's own attention kernels, below the attention layer that chooses them
(t5lite.models.attention_kernels): a Pallas TPU kernel (shared_bias) and the XLA path's core
with a custom gradient (softmax_values)."""
