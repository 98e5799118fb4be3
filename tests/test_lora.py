"""LoRA by hand vs PEFT: adapters cross over both ways, B = 0 is a no-op, disable."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import model as M
from lab.policies import adapters

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")   # peft on transformers 5
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def hf_config(tie=False):
    return transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=tie, attn_implementation="eager")


@pytest.fixture
def hf():
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(hf_config()).eval()


def build_ours(hf_model) -> M.Transformer:
    """Our Transformer holding the same weights as the transformers model."""
    d = dict(hf_model.config.to_dict(), architectures=["Qwen2ForCausalLM"])
    ours = M.Transformer(M.Config.from_dict(d))
    ours.load_state_dict(hf_model.state_dict(), strict=True)
    return ours.eval()


def logits(m, ids):
    with torch.no_grad():
        out = m(ids)
        return (out if isinstance(m, M.Transformer) else out.logits).float()


def randomize_lora(m, seed=1):
    # Non-zero B (and a fresh A), so an adapter that is ignored or mis-scaled changes the logits.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


IDS = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2], [1, 2, 3, 4, 5, 6, 7, 8]])


def test_fresh_adapter_layout_and_bit_identical_logits(hf):
    ours = build_ours(hf)
    base = logits(ours, IDS)
    torch.testing.assert_close(base, logits(hf, IDS), atol=1e-5, rtol=0)     # same base model
    M.apply_lora(ours, r=4, alpha=8, dropout=0.05)
    keys = ours.state_dict().keys()
    for proj in ("self_attn.q_proj", "mlp.down_proj"):
        assert {f"model.layers.1.{proj}.weight", f"model.layers.1.{proj}.lora_A.weight",
                f"model.layers.1.{proj}.lora_B.weight"} <= keys
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in M.lora_parameters(ours)}
    assert len(trainable) == 2 * 7 * 2
    q = ours.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q.lora_B.weight) == 0
    # kaiming_uniform(a=sqrt(5)) draws from U(-1/sqrt(d_in), 1/sqrt(d_in)), not all zero.
    assert 0 < q.lora_A.weight.abs().max() <= 32 ** -0.5
    assert q.scaling == 2.0
    assert torch.equal(logits(ours, IDS), base)
    # The adapter follows the model's mode: dropout only while training.
    assert not q.lora_dropout.training
    ours.train()
    assert q.lora_dropout.training


def test_only_adapter_weights_get_gradients(hf):
    ours = M.apply_lora(build_ours(hf), r=4, alpha=8, dropout=0.0)
    randomize_lora(ours)
    ours(IDS).float().square().mean().backward()
    for name, p in ours.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name


def test_disable_gives_the_base_model_and_enables_again(hf):
    ours = build_ours(hf)
    base = logits(ours, IDS)
    M.apply_lora(ours, r=4, alpha=8, dropout=0.1)
    randomize_lora(ours)
    adapted = logits(ours, IDS)
    assert (adapted - base).abs().max() > 1e-2          # the adapter does something
    with M.lora_disabled(ours):
        assert torch.equal(logits(ours, IDS), base)
    assert torch.equal(logits(ours, IDS), adapted)      # re-enabled on exit


def test_our_adapter_loads_in_peft(hf, tmp_path):
    ours = M.apply_lora(build_ours(hf), r=4, alpha=8, dropout=0.05)
    randomize_lora(ours)
    M.save_adapter(ours, tmp_path, base_model_name_or_path="tiny/base")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["bias"] == "none"
    assert sorted(config["target_modules"]) == sorted(M.LORA_TARGETS)
    assert config["base_model_name_or_path"] == "tiny/base"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json",
                                                          "adapter_model.safetensors"]
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path)).eval()
    expected = logits(ours, IDS)
    assert (expected - logits(hf, IDS)).abs().max() > 1e-2
    torch.testing.assert_close(logits(theirs, IDS), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("targets,rslora", [(None, False),
                                            (["q_proj", "v_proj", "down_proj"], True)])
def test_peft_adapter_loads_in_ours(hf, tmp_path, targets, rslora):
    config = peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=targets or list(M.LORA_TARGETS),
                             use_rslora=rslora)
    theirs = peft.get_peft_model(copy.deepcopy(hf), config)
    randomize_lora(theirs, seed=2)
    theirs.save_pretrained(str(tmp_path))
    theirs.eval()
    ours = adapters.load_adapter(build_ours(hf), tmp_path)
    assert ours.lora_settings.use_rslora == rslora
    expected = logits(theirs, IDS)
    assert (expected - logits(hf, IDS)).abs().max() > 1e-2
    torch.testing.assert_close(logits(ours, IDS), expected, atol=1e-5, rtol=0)


def test_round_trip_and_load_errors(hf, tmp_path):
    ours = M.apply_lora(build_ours(hf), r=4, alpha=8, dropout=0.0)
    randomize_lora(ours)
    M.save_adapter(ours, tmp_path)
    again = adapters.load_adapter(build_ours(hf), tmp_path)
    assert torch.equal(logits(again, IDS), logits(ours, IDS))
    weights = tmp_path / "adapter_model.safetensors"
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    from safetensors.torch import load_file, save_file
    tensors = load_file(weights)

    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, weights)
    fresh = build_ours(hf)
    with pytest.raises(ValueError, match=f"{weights}.*{key}.*shape"):
        adapters.load_adapter(fresh, tmp_path)
    assert not any("lora_" in n for n in fresh.state_dict())     # checked before touching it
    del tensors[key]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"{weights}.*missing.*{key}"):
        adapters.load_adapter(build_ours(hf), tmp_path)

    config_file = tmp_path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(dict(config, use_dora=True)))
    with pytest.raises(ValueError, match=f"{config_file}.*use_dora"):
        adapters.load_adapter(build_ours(hf), tmp_path)
    config_file.write_text(json.dumps(dict(config, peft_type="IA3")))
    with pytest.raises(ValueError, match="peft_type"):
        adapters.load_adapter(build_ours(hf), tmp_path)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        M.apply_lora(build_ours(hf), targets=("q_proj", "qkv_proj"))


def test_bfloat16_base_keeps_a_float32_adapter(hf):
    ours = build_ours(hf).to(torch.bfloat16)
    base = logits(ours, IDS)
    M.apply_lora(ours, r=4, alpha=8, dropout=0.0)
    assert all(p.dtype == torch.float32 for _, p in M.lora_parameters(ours))
    assert torch.equal(logits(ours, IDS), base)                 # B = 0, in bfloat16 too
    randomize_lora(ours)
    ours(IDS).float().square().mean().backward()
    q = ours.model.layers[0].self_attn.q_proj
    assert q.lora_B.weight.grad.dtype == torch.float32 and q.lora_B.weight.grad.abs().max() > 0


def test_an_adapter_holding_nan_is_refused_before_the_model_is_touched(hf, tmp_path):
    ours = M.apply_lora(build_ours(hf), r=4, alpha=8, dropout=0.0)
    randomize_lora(ours)
    M.save_adapter(ours, tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    before = {n: p.clone() for n, p in M.lora_parameters(ours)}
    with pytest.raises(ValueError, match=f"{key}.*NaN"):
        adapters.load_adapter(ours, tmp_path)
    assert all(torch.equal(p, before[n]) for n, p in M.lora_parameters(ours))


def test_load_adapter_weights_restores_what_save_adapter_wrote(hf, tmp_path):
    ours = M.apply_lora(build_ours(hf), r=4, alpha=8, dropout=0.0)
    randomize_lora(ours)
    M.save_adapter(ours, tmp_path)
    again = M.load_adapter_weights(M.apply_lora(build_ours(hf), r=4, alpha=8, dropout=0.0),
                                   tmp_path)
    theirs = adapters.load_adapter(build_ours(hf), tmp_path)
    for (n, p), (_, q), (_, t) in zip(M.lora_parameters(ours), M.lora_parameters(again),
                                      M.lora_parameters(theirs)):
        assert torch.equal(p, q) and torch.equal(q, t) and q.dtype == t.dtype, n
    with pytest.raises(ValueError, match="adapter_config.json: not an adapter with the settings"):
        M.load_adapter_weights(M.apply_lora(build_ours(hf), r=4, alpha=16, dropout=0.0), tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    tensors[key][0, 0] = float("nan")
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="q_proj.lora_A.weight .*NaN"):
        M.load_adapter_weights(again, tmp_path)
