"""Model loading and our own forward pass for Llama-family architectures."""
