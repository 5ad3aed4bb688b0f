"""The tiny random-weight checkpoints of every family the tests build (``tests.conftest.make_tiny_model``)."""

# Each family's tiny shape: (its transformers config and model class names, the config's settings).
# Head dims and GQA ratios differ from SmolLM2's (64, 3:1) and from each other.
TINY_FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    "qwen3-tied": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(hidden_size=48, intermediate_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
    ),
    "mistral": (
        "MistralConfig", "MistralForCausalLM",
        dict(hidden_size=96, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, sliding_window=None),
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, sliding_window=None),
    ),
    "llama3-rope": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )),
    ),
    # Phi-3's long-context RoPE: past 20 tokens the long factors (all of a longer prompt's tokens).
    "phi3-longrope": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, sliding_window=None,
            original_max_position_embeddings=20, rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=20,
                short_factor=[1.0, 1.25, 1.5, 2.0], long_factor=[1.0, 3.0, 9.0, 27.0],
            ),
        ),
    ),
    # Phi-4-mini's parts: longrope over three quarters of each head (12 of 16 features).
    "phi3-partial": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, sliding_window=None,
            original_max_position_embeddings=20, partial_rotary_factor=0.75, rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=20, partial_rotary_factor=0.75,
                short_factor=[1.0, 1.1, 1.25, 1.5, 1.75, 2.0], long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            ),
        ),
    ),
    # SmolLM3: RoPE on layers 0 and 2, none on 1 and 3 (NoPE every second layer here).
    "smollm3": (
        "SmolLM3Config", "SmolLM3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            no_rope_layer_interval=2, pad_token_id=0,
        ),
    ),
    # With its windows: on the NoPE layers (transformers' SmolLM3 puts them there).
    "smollm3-windowed": (
        "SmolLM3Config", "SmolLM3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            no_rope_layer_interval=2, pad_token_id=0, use_sliding_window=True, sliding_window=20,
        ),
    ),
    # Llama's biases: on q, k, v and o (attention_bias), on gate, up and down (mlp_bias).
    "llama-biases": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    ),
    # Granite's multipliers (its 3.x models' values but the attention's, which is 1 / head_dim there).
    "granite": (
        "GraniteConfig", "GraniteForCausalLM",
        dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0,
        ),
    ),
    # Granite's multipliers around experts stacked one tensor a projection; and with a shared MLP.
    "granite-moe": (
        "GraniteMoeConfig", "GraniteMoeForCausalLM",
        dict(
            hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0,
        ),
    ),
    "granite-moe-shared": (
        "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
        dict(
            hidden_size=64, intermediate_size=48, shared_intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.0625, logits_scaling=8.0,
        ),
    ),
    # Dynamic NTK: past 20 tokens, frequencies recomputed from the sequence's length every token.
    "llama-dynamic": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=20,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=16.0),
        ),
    ),
    "yarn": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
        )),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
        ),
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
            sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=0.02, final_logit_softcapping=3.0,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
            sliding_window=24, query_pre_attn_scalar=32, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
            tie_word_embeddings=False,
        ),
    ),
    "mistral-windowed": (
        "MistralConfig", "MistralForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=20),
    ),
    "qwen3-moe-normed": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, decoder_sparse_step=2,
        ),
    ),
    # Qwen 2 MoE: q/k/v biases, and a shared expert (gated by a sigmoid) beside the routed ones in every layer.
    "qwen2-moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=80,
            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        ),
    ),
    # OLMo 2: norms after attention and MLP only, q/k norms over all heads at once (weights drawn: see RANDOM_NORMS).
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)),
}

# Families whose norm weights are drawn around 1 at creation (transformers starts them at 1, where a
# weight applied to the wrong features would go unseen).
RANDOM_NORMS = {"olmo2"}


# Families whose queries and keys are scaled up (by this) at creation, so that greedy tokens
# depend on RoPE: a random model's scores are near zero, and what a token attends to with them
# hardly depends on how the keys were rotated.
SHARP_ATTENTION = {"phi3-longrope": 4.0, "phi3-partial": 4.0, "llama-dynamic": 4.0, "smollm3": 4.0, "smollm3-windowed": 4.0, "olmo2": 4.0}
