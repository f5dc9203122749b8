from lean_transformer.models.albert import LeanAlbertForPreTraining
from lean_transformer.models.base import LeanPreTrainedModel, LeanTransformerModel
from lean_transformer.models.gpt import LeanGPTForCausalLM

__all__ = ["LeanAlbertForPreTraining", "LeanGPTForCausalLM", "LeanPreTrainedModel", "LeanTransformerModel"]
