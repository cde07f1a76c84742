"""Development tools of the repository (not installed with the package): ``tools.aot`` compiles the Triton
kernels ahead of time and reports their resources."""
