"""Experiments built on vision_priors: each module is a command-line recipe."""
