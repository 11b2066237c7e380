"""Tensor parallelism (docs/tensor_parallel.md): a model split over N processes on torch.distributed.

`group.py` is the process group of one engine's ranks; `sharding.py` what each rank holds of the model
(Megatron-style column / row splits, the vocabulary split) and how it is loaded; `worker.py` the entry
point of ranks 1..N-1; `executor.py` the driver's side (rank 0), which the engine calls as it calls a
ModelRunner. Nothing here is imported when tensor_parallel_size is 1."""
