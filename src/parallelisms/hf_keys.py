"""A Hugging Face ``config.json``'s keys beyond what this model reads, checked before launch.

The keys :mod:`parallelisms.config` and :mod:`parallelisms.hf_arch` read, and the standard ``PretrainedConfig``
keys that do not change the training computation (token ids, generation defaults, the dtype the file was saved
in), pass silently. A key that changes the computation is refused in one line unless it holds the value under
which the model here computes the same thing (dropout 0, no soft-capping, no multiplier, no quantization). Any
other key is named in one warning line and ignored, as ``transformers`` ignores keys its config class does not
know.
"""

from __future__ import annotations

import sys

from parallelisms.errors import require

READ = {  # read by parallelisms.config (the shape) and parallelisms.hf_arch (the architecture)
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "num_local_experts",
    "num_experts_per_tok", "tie_word_embeddings", "hidden_act", "activation_function", "rope_parameters",
    "rope_scaling", "model_type", "mlp_bias", "attention_bias", "head_dim", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "router_jitter_noise", "output_router_logits",
}
NEUTRAL = {  # standard keys that do not change the training computation
    "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "chunk_size_feed_forward", "is_decoder", "finetuning_task", "pruned_heads", "tie_encoder_decoder",
    "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p", "num_beams", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "early_stopping",
    "pretraining_tp",  # Llama's sliced matmuls: the same products, split
    "router_aux_loss_coef",  # Mixtral: used only with output_router_logits, which is refused
    "attn_implementation", "_attn_implementation_autoset", "use_return_dict",
}
# keys that change the computation: the values under which this model computes the same thing
SAME_WHEN = {
    "attention_dropout": (0, 0.0), "hidden_dropout": (0, 0.0), "hidden_dropout_prob": (0, 0.0),
    "attention_probs_dropout_prob": (0, 0.0), "resid_pdrop": (0, 0.0), "embd_pdrop": (0, 0.0),
    "attn_pdrop": (0, 0.0), "dropout": (0, 0.0), "mlp_dropout": (0, 0.0), "classifier_dropout": (None,),
    "quantization_config": (None,), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "logits_scaling": (1, 1.0), "embedding_multiplier": (1, 1.0), "residual_multiplier": (1, 1.0),
    "attention_multiplier": (None,), "clip_qkv": (None,), "partial_rotary_factor": (1, 1.0),
    "qk_layernorm": (False,), "use_qk_norm": (False,), "parallel_attn": (False,), "alibi": (False,),
    "scale_embeddings": (False,), "is_encoder_decoder": (False,), "add_cross_attention": (False,),
    "num_experts": (None, 0), "moe_intermediate_size": (None,), "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0), "norm_topk_prob": (True,), "cross_attention_hidden_size": (None,),
}


def check_config_keys(path, raw: dict) -> list[str]:
    """One line (:class:`ConfigError`) for a key of ``raw`` that changes the computation from what this model
    computes; a warning line on stderr naming the keys neither read nor known, which are ignored. Returns them."""
    where = f"--config {str(path)!r}"
    for key, same in SAME_WHEN.items():
        value = raw.get(key, same[0])
        require(value in same, f"{where} has {key} {_short(value)}, which changes the computation from what this "
                               f"model computes (it computes {key} {_short(same[0])}); remove the key or set it so")
    unknown = sorted(k for k in raw if k not in READ | NEUTRAL | set(SAME_WHEN))
    if unknown:
        print(f"warning: {where} has keys this model does not read, ignored: {', '.join(unknown[:8])}"
              f"{f' and {len(unknown) - 8} more' if len(unknown) > 8 else ''}", file=sys.stderr)
    return unknown


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
