"""The lean models, registered with transformers' Auto classes on import (so that ``AutoModelForCausalLM`` loads a
saved LeanGPT)."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForPreTraining

from lean_transformer.config import LeanAlbertConfig, LeanGPTConfig, LeanTransformerConfig
from lean_transformer.models.albert import LeanAlbertForPreTraining
from lean_transformer.models.base import LeanPreTrainedModel, LeanTransformerModel
from lean_transformer.models.gpt import LeanGPTForCausalLM

for _config in (LeanTransformerConfig, LeanGPTConfig, LeanAlbertConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
AutoModel.register(LeanTransformerConfig, LeanTransformerModel, exist_ok=True)
AutoModelForCausalLM.register(LeanGPTConfig, LeanGPTForCausalLM, exist_ok=True)
AutoModelForPreTraining.register(LeanAlbertConfig, LeanAlbertForPreTraining, exist_ok=True)

__all__ = ["LeanAlbertForPreTraining", "LeanGPTForCausalLM", "LeanPreTrainedModel", "LeanTransformerModel"]
