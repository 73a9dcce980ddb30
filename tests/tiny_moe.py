"""Tiny random-weight Mixture-of-Experts models of every family routing replay covers, built in-process (no
download): two layers, four experts, two a token; and a sampler that routes them differently from the trainer."""

from __future__ import annotations

import torch
import transformers
from tiny import tiny_tokenizer

from grpokit.moe import find_routers
from grpokit.rollout.transformers_backend import TransformersRollout

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_5_moe")


def _config(family: str, tok) -> transformers.PretrainedConfig:
    common = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, num_experts_per_tok=2,
                  initializer_range=0.2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                           head_dim=8, norm_topk_prob=True)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                           shared_expert_intermediate_size=16, norm_topk_prob=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=4)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=16, num_experts=4)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, intermediate_size=16, num_local_experts=4, head_dim=8,
                                         layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(
            **common, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, head_dim=8,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8)
    raise ValueError(family)


def tiny_moe_model(family: str = "qwen3_moe", tok=None, seed: int = 0) -> transformers.PreTrainedModel:
    tok = tok or tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = _config(family, tok)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


class ShiftedRouters(TransformersRollout):
    """grpokit's transformers backend generating with every router's weights perturbed (restored after)."""

    def generate(self, model, prompt_ids, prompt_mask, params, **kw):
        routers = find_routers(model).routers
        saved = [r.module.weight.detach().clone() for r in routers]
        noise = torch.Generator().manual_seed(int(prompt_ids.sum()))
        with torch.no_grad():
            for r in routers:
                r.module.weight.add_(0.3 * torch.randn(r.module.weight.shape, generator=noise))
        try:
            return super().generate(model, prompt_ids, prompt_mask, params, **kw)
        finally:
            with torch.no_grad():
                for r, w in zip(routers, saved):
                    r.module.weight.copy_(w)
