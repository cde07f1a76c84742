"""vision_priors: GOAT, PoPE and LAVO attention with positional priors, as timm models.

Importing the package registers its models with timm (``timm.create_model('vit_small_patch16_goat_224')``).
"""
from . import layers
from . import models

__version__ = '0.1.0'
