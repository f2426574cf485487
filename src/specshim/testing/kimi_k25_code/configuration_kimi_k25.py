"""A small ``kimi_k25`` config for ``AutoConfig(..., trust_remote_code=True)``.

transformers (< 5) has no ``kimi_k25`` model type, so a Kimi-K2.5 checkpoint
carries its config class as remote code. vLLM ignores this file (it registers
its own ``KimiK25Config``); speculators' generator reads it to count layers:
``config.text_config.num_hidden_layers``.
"""

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        media_placeholder_token_id=0,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config or DeepseekV3Config()
        self.vision_config = dict(vision_config or {})
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(**kwargs)

    def to_dict(self):
        output = super().to_dict()
        output["text_config"] = self.text_config.to_dict()
        return output
