"""Triton kernels shared by the attention layers (issue 6); each with a naive reference beside it."""
