"""Training: the run configuration, the data, the loop, checkpoints, throughput and several processes."""
