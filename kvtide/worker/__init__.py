"""Device work: the model runner and the executors that drive it."""
