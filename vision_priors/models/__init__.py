from .vision_transformer_priors import *  # noqa: F401,F403  (registers the models)
from .spatial_vqa import *  # noqa: F401,F403  (spatial VQA transformer, GOAT Tables 9-10)
from .point_completion import *  # noqa: F401,F403  (PoinTr-style PCN completion, LAVO Table 7)
