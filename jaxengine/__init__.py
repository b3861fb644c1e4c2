"""jaxengine: a JAX-native LLM serving engine (vLLM-V1 continuous batching on a pure scheduler)."""
