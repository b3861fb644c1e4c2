"""Ragged paged attention: a jnp reference and Pallas kernels for TPU and GPU."""
