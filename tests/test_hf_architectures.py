"""The Hugging Face architectures beyond plain Llama, against ``transformers`` itself: Llama 3.1 (llama3 rope
scaling), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm, explicit head_dim), Mistral (explicit head_dim, no
window within the sequence) and Mixtral (experts). For each, a random tiny model built by transformers (its biases
and norms drawn too, so they matter) gives the same logits after ``load_hf``; ten steps of ``--init-from``
training in dp 2, tp 2 with SP, pp 2 and dp 2 ZeRO-3 (Mixtral: also ep 2) follow transformers + torch AdamW
trained here in one process on the same batches, schedule, clipping and optimizer settings; the exported model
loads in transformers and computes our logits. The features run in float64 on tp x pp x dp and under context
parallelism (ring, Ulysses) within verify's 1e-10; bad configs and weights are one line each."""

import dataclasses
import functools
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, load_hf_config  # noqa: E402
from parallelisms.data.sources import training_loader  # noqa: E402
from parallelisms.errors import ConfigError  # noqa: E402
from parallelisms.hf import export_hf, load_hf  # noqa: E402
from parallelisms.lr_schedule import make_scheduler  # noqa: E402
from parallelisms.mesh import ParallelDims  # noqa: E402
from parallelisms.model import build_model  # noqa: E402
from parallelisms.optim import decays  # noqa: E402
from parallelisms.support import validate_layout  # noqa: E402
from parallelisms.training import RunSpec  # noqa: E402
from parallelisms.equivalence import TOLERANCE_FLOAT64, compare, reference_train  # noqa: E402

from _launching import launch_once_per_world, one_thread, train_each  # noqa: E402

TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # scales the tiny heads' pairs
ARCHITECTURES = {  # name: (config class, model class, what differs from Llama)
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=12, sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
LOGITS_ONLY = {  # a feature checked on the logits alone
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "qwen3_attention_bias": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, attention_bias=True)),
}
# lr 1e-3: at 3e-3 Adam amplifies fp32 rounding so far on these tiny models that our fp32 training and our float64
# training of Mistral's already differ by 1.8e-5 in the tenth gradient norm (transformers' and ours by 2.7e-6: the
# same rounding); at 1e-3 both gaps are below 5e-7, and the comparison tests the computation, not the rounding.
# weight decay 0.1 under the default groups (the weight matrices decay; norms, biases and the embedding do not)
TRAIN = TrainConfig(steps=10, global_batch=4, seq_len=16, lr=1e-3, weight_decay=0.1, warmup=2,
                    lr_schedule="cosine", grad_clip=0.5)
LAYOUTS = {
    "dp2": ParallelConfig(ParallelDims(dp_replicate=2)),
    "tp2_sp": ParallelConfig(ParallelDims(tp=2), sequence_parallel=True),
    "pp2": ParallelConfig(ParallelDims(pp=2)),
    "dp2_zero3": ParallelConfig(ParallelDims(dp_shard=2), zero=3),
}
MOE_LAYOUTS = {"dp2_ep2": ParallelConfig(ParallelDims(dp_replicate=2, ep=2))}


def _model_class(name: str):
    return getattr(transformers, {**ARCHITECTURES, **LOGITS_ONLY}[name][1])


@functools.cache
def hf_dir(name: str, root: str) -> str:
    """A random tiny ``name`` model saved by transformers under ``root``: its biases and norm weights drawn
    away from transformers' zeros and ones, so a bias or norm computed wrongly shows."""
    config_class, _, extra = {**ARCHITECTURES, **LOGITS_ONLY}[name]
    torch.manual_seed(0)
    model = _model_class(name)(getattr(transformers, config_class)(**SHAPE, **extra))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.normal_(0.0, 0.3).add_(1.0 if "norm" in param_name else 0.0)
    path = f"{root}/{name}"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_architectures"))


def _hf_logits(path, name) -> torch.Tensor:
    model = _model_class(name).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _our_logits(cfg, state) -> torch.Tensor:
    model = build_model(cfg, 0)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(TOKENS)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_transformers_model_computes_the_same_logits_here(name, root):
    cfg, state = load_hf(hf_dir(name, root))
    assert cfg.hf_model_type == ("llama" if name == "llama3" else name)
    assert _rel(_our_logits(cfg, state), _hf_logits(hf_dir(name, root), name)) < 1e-5


@pytest.mark.parametrize("name", LOGITS_ONLY)
def test_linear_rope_and_output_bias_compute_the_same_logits_here(name, root):
    cfg, state = load_hf(hf_dir(name, root))
    assert cfg.rope_scaling == "linear" if name == "llama_linear_rope" else (cfg.qkv_bias, cfg.out_bias) == (True, True)
    assert _rel(_our_logits(cfg, state), _hf_logits(hf_dir(name, root), name)) < 1e-5


def test_each_feature_is_read_from_its_config(root):
    features = {name: load_hf(hf_dir(name, root))[0] for name in ARCHITECTURES}
    assert (features["llama3"].rope_scaling, features["llama3"].rope_factor) == ("llama3", 8.0)
    assert (features["qwen2"].qkv_bias, features["qwen2"].out_bias, features["qwen2"].qk_norm) == (True, False, False)
    assert (features["qwen3"].qk_norm, features["qwen3"].head_dim, features["qwen3"].q_dim) == (True, 16, 64)
    assert (features["mistral"].head_dim, features["mistral"].sliding_window) == (12, 0)
    assert (features["mixtral"].n_experts, features["mixtral"].top_k, features["mixtral"].aux_loss_coef) == (4, 2, 0.0)


def transformers_training(path: str, name: str, train: TrainConfig) -> tuple[list[float], list[float], dict]:
    """transformers' model trained in this process with torch AdamW: the run's batches (inputs and shifted
    targets), mean next-token cross-entropy, global-norm clipping, the learning-rate schedule, betas, eps, and
    two groups as the run's defaults make them (decay on the weight matrices, experts' and router's included; none
    on norms, biases and the embedding). Returns the losses, the gradient norms before clipping, and the final
    state dict."""
    model = _model_class(name).from_pretrained(path, dtype=torch.float32).train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    ours = {"model.embed_tokens.weight": "tok_embeddings.weight"}  # the one name the decay groups look at
    chosen = [decays(ours.get(n, n), p.dim(), train) for n, p in named]
    assert any(chosen) and not all(chosen)
    optimizer = torch.optim.AdamW([{"params": [p for p, d in zip(params, chosen) if d]},
                                   {"params": [p for p, d in zip(params, chosen) if not d], "weight_decay": 0.0}],
                                  lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, eps=train.eps)
    scheduler = make_scheduler(optimizer, train)
    loader = training_loader(train)
    losses, norms = [], []
    for step in range(train.steps):
        inputs, targets = loader.batch(step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, train.grad_clip).item())
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def _specs(root: str) -> dict:
    specs = {}
    for name in ARCHITECTURES:
        path = hf_dir(name, root)
        cfg = load_hf(path)[0]
        layouts = {**LAYOUTS, **(MOE_LAYOUTS if cfg.n_experts else {})}
        for layout, parallel in layouts.items():
            specs[f"{name}/{layout}"] = RunSpec(cfg, TRAIN, validate_layout(cfg, TRAIN, parallel),
                                                collect_state=layout == "dp2_zero3", init_from=path)
    return specs


@pytest.fixture(scope="module")
def runs(root):
    """Every architecture in every layout, trained in one launch of two ranks (start-up dominates here)."""
    specs = _specs(root)
    reports = launch_once_per_world(functools.partial(train_each, specs=specs))(2)
    return specs, reports


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_init_from_trains_as_transformers_does_in_every_layout_and_exports(name, root, runs, tmp_path):
    specs, reports = runs
    with one_thread():
        losses, norms, hf_state = transformers_training(hf_dir(name, root), name, TRAIN)
    assert max(norms) > TRAIN.grad_clip  # clipping is exercised
    layouts = [key for key in specs if key.startswith(f"{name}/")]
    assert len(layouts) == len(LAYOUTS) + (len(MOE_LAYOUTS) if name == "mixtral" else 0)
    for key in layouts:
        report = reports[key]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(report["losses"], losses))
        norm_rel = max(abs(a - b) / b for a, b in zip(report["grad_norms"], norms))
        print(f"{key}: losses within {loss_rel:.1e}, gradient norms within {norm_rel:.1e} of transformers")
        assert loss_rel < 2e-6 and norm_rel < 1e-5, (key, loss_rel, norm_rel)
    # the export of the ZeRO-3 run loads in transformers, computes our logits, and is transformers' training
    cfg, state = specs[f"{name}/dp2_zero3"].model, reports[f"{name}/dp2_zero3"]["state"]
    out = export_hf(state, cfg, tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (cfg.hf_model_type, [ARCHITECTURES[name][1]])
    exported = _model_class(name).from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = exported(TOKENS).logits
    assert _rel(theirs, _our_logits(cfg, state)) < 1e-5
    trained = _model_class(name).from_pretrained(hf_dir(name, root), dtype=torch.float32).eval()
    trained.load_state_dict(hf_state)
    with torch.no_grad():
        assert _rel(theirs, trained(TOKENS).logits) < 1e-4
    again_cfg, again = load_hf(out)  # and back: the round trip is exact
    assert again_cfg == cfg and all(torch.equal(again[n], state[n].float()) for n in state)


# -- float64: every feature on tp x pp x dp, and the per-head norms under context parallelism -------------------

EVERY_FEATURE = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32,
                            head_dim_override=12, qkv_bias=True, out_bias=True, qk_norm=True, rope_scaling="llama3",
                            rope_factor=8.0, rope_original_max_len=16, hf_model_type="qwen3")
EXPERTS = dataclasses.replace(EVERY_FEATURE, n_experts=4, top_k=2, aux_loss_coef=0.0, qk_norm=False,
                              out_bias=False, rope_scaling="linear", rope_factor=2.0, hf_model_type="mixtral")
QWEN2 = dataclasses.replace(EVERY_FEATURE, n_layers=4, out_bias=False, qk_norm=False, hf_model_type="qwen2")
FLOAT64 = TrainConfig(steps=3, global_batch=8, seq_len=16, lr=3e-3, dtype="float64")
FLOAT64_LAYOUTS = {
    "every_feature/tp2_sp_pp2_dp2": (EVERY_FEATURE, ParallelConfig(ParallelDims(pp=2, dp_replicate=2, tp=2),
                                                                   sequence_parallel=True)),
    "experts/tp2_pp2_dp2_ep2": (EXPERTS, ParallelConfig(ParallelDims(pp=2, dp_replicate=2, tp=2, ep=2))),
    "every_feature/ring_cp2_tp2": (EVERY_FEATURE, ParallelConfig(ParallelDims(cp=2, tp=2), cp_attention="ring")),
    "every_feature/ulysses_cp2_dp2": (EVERY_FEATURE, ParallelConfig(ParallelDims(dp_replicate=2, cp=2),
                                                                    cp_attention="ulysses")),
    # Zero Bubble's split linear layers (weight gradients deferred) carry the q/k/v and output biases
    "qwen2/zb-v_pp2_tp2_sp": (QWEN2, ParallelConfig(ParallelDims(pp=2, tp=2), sequence_parallel=True,
                                                    schedule="zb-v")),
    "every_feature/zb-h1_pp2_dp2": (EVERY_FEATURE, ParallelConfig(ParallelDims(pp=2, dp_replicate=2),
                                                                  schedule="zb-h1")),
}
FLOAT64_SPECS = {name: RunSpec(model, FLOAT64, validate_layout(model, FLOAT64, parallel), collect_state=True)
                 for name, (model, parallel) in FLOAT64_LAYOUTS.items()}
_float64_reports = launch_once_per_world(functools.partial(train_each, specs=FLOAT64_SPECS))


@pytest.mark.parametrize("name", FLOAT64_LAYOUTS)
def test_every_feature_reproduces_single_process_training_in_float64(name):
    report = _float64_reports(FLOAT64_SPECS[name].parallel.dims.world_size)[name]
    with one_thread():
        reference = reference_train(FLOAT64_LAYOUTS[name][0], FLOAT64)
    result = compare(report, reference, TOLERANCE_FLOAT64)
    print(f"{name}: {result}")
    assert result["ok"], result


def test_rotary_tables_are_built_in_the_model_dtype():
    plain = dataclasses.replace(EVERY_FEATURE, rope_scaling="none")
    angles = torch.arange(32, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, 12, 2, dtype=torch.float64) / 12)
    float64, float32 = build_model(plain, dtype=torch.float64), build_model(plain)
    assert float64.rope_cos.dtype == torch.float64
    assert (float64.rope_cos - angles.cos()).abs().max() < 1e-14
    assert (float32.rope_cos.double() - angles.cos()).abs().max() > 1e-9  # what a float32 table would cost


# -- bad input: one line naming the field or tensor ---------------------------------------------------------------

def _config_with(root, tmp_path, **changes):
    path = hf_dir("llama3", root)
    config = json.loads(open(f"{path}/config.json").read())
    config.update(changes)
    out = tmp_path / "config.json"
    out.write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes, fragment", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'dynamic'"),
    (dict(model_type="gemma"), "model_type 'gemma'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(model_type="mixtral", num_local_experts=4, output_router_logits=True), "output_router_logits"),
])
def test_bad_architecture_fields_are_one_line(root, tmp_path, changes, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        load_hf_config(_config_with(root, tmp_path, **changes))
    assert "\n" not in str(info.value)


def test_a_sliding_window_shorter_than_the_sequence_is_refused_before_launch(root, tmp_path, capsys):
    from parallelisms.cli import main

    path = _config_with(root, tmp_path, model_type="mistral", sliding_window=8, rope_parameters=None)
    assert main(["train", "--config", str(path), "--seq-len", "16", "--dp", "1", "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "exceeds the model's sliding_window 8 (config.json)" in error
    assert load_hf_config(path).sliding_window == 8


def _weights_disagreeing(root, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    source = hf_dir("qwen3", root)
    weights = load_file(f"{source}/model.safetensors")
    edit(weights)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(weights, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(open(f"{source}/config.json").read())
    return bad


def test_weights_that_disagree_with_the_config_are_one_line(root, tmp_path):
    missing = _weights_disagreeing(root, tmp_path, lambda w: w.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ConfigError, match=r"lacks model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_hf(missing)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    bad = _weights_disagreeing(root, wrong, lambda w: w.update({"model.layers.0.self_attn.q_proj.weight":
                                                                   torch.zeros(32, 32)}))
    with pytest.raises(ConfigError, match=r"q_proj\.weight has shape \(32, 32\), its config.json implies \(64, 32\)") as info:
        load_hf(bad)
    assert "\n" not in str(info.value)


def test_disagreeing_weights_are_refused_before_launch(root, tmp_path, capsys):
    """``--init-from`` a directory whose weights lack a tensor: one line naming it, no process started."""
    from parallelisms.cli import main

    missing = _weights_disagreeing(root, tmp_path, lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
    assert main(["train", "--init-from", str(missing), "--dp", "2", "--steps", "1", "--seq-len", "16"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "model.layers.0.mlp.up_proj.weight" in error, error


def test_seq_len_beyond_the_max_positions_extends_rotary(capsys):
    from parallelisms.cli import main

    assert main(["train", "--preset", "tiny", "--dp", "1", "--steps", "1", "--global-batch", "1",
                 "--seq-len", "160"]) == 0
    assert "rotary positions extend to 160" in capsys.readouterr().out


def test_head_dim_flag_sets_the_query_width_in_the_model_and_the_estimate(capsys):
    from parallelisms.cli import main

    def estimate(*flags):
        assert main(["estimate", "--preset", "llama3-8b", "--tp", "8", "--seq-len", "8192", "--global-batch", "8",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    plain, wide = estimate(), estimate("--head-dim", "256")  # queries of 32 x 256 = 8192 where hidden is 4096
    # per layer q and o grow by 4096 x 4096 each, k and v (8 heads) by 4096 x 1024; the step time with them
    assert wide["params"] - plain["params"] == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert wide["step_s"] > plain["step_s"] and wide["model_tflops_per_gpu"] > plain["model_tflops_per_gpu"]
    model = build_model(dataclasses.replace(EVERY_FEATURE, qk_norm=False), device="meta")
    assert tuple(model.layers["0"].attention.wq.weight.shape) == (4 * 12, 32)
    assert tuple(model.layers["0"].attention.wo.weight.shape) == (32, 4 * 12)


def test_mixtral_experts_stored_fused_are_read(root, tmp_path):
    """transformers 5's Mixtral module holds each layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2F, H],
    ``mlp.experts.down_proj`` [E, H, F], router ``mlp.gate.weight``); a file of that state dict, which transformers
    loads too, reads as the per-expert file ``save_pretrained`` writes; a fused tensor of another shape is one line.
    The export is the per-expert format, which transformers loads (the ZeRO-3 export test above)."""
    from safetensors.torch import save_file

    source = hf_dir("mixtral", root)
    model = _model_class("mixtral").from_pretrained(source, dtype=torch.float32)
    fused = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and fused["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file(fused, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(open(f"{source}/config.json").read())
    cfg, state = load_hf(folder)
    _, expected = load_hf(source)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert _rel(_our_logits(cfg, state), _hf_logits(folder, "mixtral")) < 1e-5
    fused["model.layers.1.mlp.experts.down_proj"] = fused["model.layers.1.mlp.experts.down_proj"][:, :, :3].contiguous()
    save_file(fused, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.experts\.down_proj has shape"):
        load_hf(folder)
