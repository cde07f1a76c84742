from .vision_transformer_priors import *  # noqa: F401,F403  (registers the models)
from .reference_grid import *  # noqa: F401,F403  (position interpolation onto a reference grid)
from .spatial_vqa import *  # noqa: F401,F403  (spatial VQA transformer, GOAT Tables 9-10)
from .point_completion import *  # noqa: F401,F403  (PoinTr-style PCN completion, LAVO Table 7)
# model families with their own registries (CROSS_ATTENTIONS, ATTENTIONS differ between them): as modules,
# e.g. vision_priors.models.informer.create_forecast_model, vision_priors.models.language_model
from . import informer, language_model, multimodal, spatial_vqa_fusion  # noqa: F401,E402
