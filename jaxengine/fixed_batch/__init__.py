"""Generation and scoring inside your own `jax.jit`: a fixed batch, no scheduler, no host round
trips (`generate`, `score`), the model as they take it (`load_model_fns`, `model_fns_of`) and
the string helpers around them (`encode_batch`, `decode_batch`). README "Generation inside your
own jit" has the retrace rules."""
