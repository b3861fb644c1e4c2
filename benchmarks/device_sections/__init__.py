"""The sections of `benchmarks/device_check.py`, one module per kind of check: `kernel`
(the attention kernel's correctness, its place in the engine's compiled step, its timing), `model`
(decode steps of whole models: tensor parallel, quantized weights, the families), `first_token`
(a fresh process to its first token). Each section takes a `context.Context`, prints its lines
and returns its failures."""
