"""The precision audit: what one training step actually ran in, and whether the requested
precision engaged (matmuls, saved activations, state and communication dtypes)."""
