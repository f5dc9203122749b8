"""lean_transformer: a transformer that does not hog GPU memory."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForPreTraining

from lean_transformer.config import LeanAlbertConfig, LeanGPTConfig, LeanTransformerConfig
from lean_transformer.models import (LeanAlbertForPreTraining, LeanGPTForCausalLM, LeanPreTrainedModel,
                                     LeanTransformerModel)

for _config in (LeanTransformerConfig, LeanGPTConfig, LeanAlbertConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
AutoModel.register(LeanTransformerConfig, LeanTransformerModel, exist_ok=True)
AutoModelForCausalLM.register(LeanGPTConfig, LeanGPTForCausalLM, exist_ok=True)
AutoModelForPreTraining.register(LeanAlbertConfig, LeanAlbertForPreTraining, exist_ok=True)

__all__ = ["LeanAlbertConfig", "LeanAlbertForPreTraining", "LeanGPTConfig", "LeanGPTForCausalLM",
           "LeanPreTrainedModel", "LeanTransformerConfig", "LeanTransformerModel"]
