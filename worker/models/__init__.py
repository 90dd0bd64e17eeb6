"""Model files on this machine: the model cache, the catalog of real models, GGUF import and `bulkinfer
models`."""
