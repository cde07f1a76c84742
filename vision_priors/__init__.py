"""vision_priors: GOAT, PoPE and LAVO attention with positional priors, as timm models.

Importing the package registers its models with timm (``timm.create_model('vit_small_patch16_goat_224')``).
"""
from . import layers  # noqa: F401  (exposes vision_priors.layers)
from . import models  # noqa: F401  (registers the timm models)

__version__ = '0.1.0'
