from .vision_transformer_priors import *  # noqa: F401,F403  (registers the models)
