"""The compiler: the `zeropp` torch.compile backend, the pass manager and its observers, warm restarts from
Inductor's caches, and each layer compiled once."""
