"""Training: the step loop (trainer), the seam to the data-parallel strategies, the stock nanotron path, the flat
gradient buckets, the engines, checkpoints, metrics, the training state, memory and the torch worlds."""
