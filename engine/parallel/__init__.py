"""Tensor parallelism: one engine whose model is split over N ranks (processes), rank 0 scheduling
and sampling, every rank running every step's forward on its share of the heads and channels."""
