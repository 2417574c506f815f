"""Building blocks of the models; each parameter carries a `weight_loader` for checkpoint shards."""
