"""Sharding a model: each parameter kept as this rank's shard, read as the gathered weight where it is used,
and the state zeropp keeps on the model's modules."""
