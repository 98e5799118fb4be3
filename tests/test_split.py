"""model.split_model, the layers split across devices: same numbers as one device, and every
piece where it belongs."""
import copy

import pytest
import torch

import model as M
from lab.probing import traces
import probes

STATS = M.STATS


def tiny(tie=False, layers=4, seed=0) -> M.Transformer:
    cfg = M.Config.from_dict(dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=tie, eos_token_id=2))
    model = M.Transformer(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    return model.requires_grad_(False)


def devices_of(module):
    return {p.device.type for p in module.parameters()}


def test_balance_layers_by_parameter_count():
    # Qwen2.5-7B: 28 blocks of 233M parameters, 545M in the embedding and 545M in the head.
    d, f, kv = 3584, 18944, 512
    block = 2 * d * d + 2 * d * kv + d + 2 * kv + 3 * d * f + 2 * d
    embed = 152064 * d
    assert M.balance_layers([block] * 28, 2, embed, embed + d) == [14, 14]
    # Loads 545+233k: the first and last device hold the big matrices, so they get fewer blocks.
    assert M.balance_layers([block] * 28, 4, embed, embed + d) == [6, 8, 8, 6]
    assert M.balance_layers([block] * 28, 1, embed, embed) == [28]
    # Uneven blocks: the cut goes where the running load is nearest half of the total (7).
    assert M.balance_layers([1, 1, 1, 1, 10], 2) == [4, 1]
    # Every device keeps at least one layer, even when one block outweighs the rest.
    assert M.balance_layers([100, 1, 1], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="4 layers over 5 devices"):
        M.balance_layers([1] * 4, 5)


def test_placement_on_fake_devices():
    # "meta" stands in for a second accelerator: any tensor left behind on the CPU would meet a
    # meta weight and fail, so the forward below proves that activations follow the blocks.
    model = M.apply_lora(tiny(), r=2, alpha=4, dropout=0.0)
    M.split_model(model, ["cpu", "meta"], layer_counts=[1, 3])
    assert devices_of(model.model.embed_tokens) == {"cpu"}
    assert devices_of(model.model.layers[0]) == {"cpu"}     # LoRA weights included
    for block in model.model.layers[1:]:
        assert devices_of(block) == {"meta"}
    assert devices_of(model.model.norm) == devices_of(model.lm_head) == {"meta"}
    cache = model.new_cache(2, capacity=8)
    assert [c.k.device.type for c in cache] == ["cpu", "meta", "meta", "meta"]
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    with torch.no_grad():
        out = model(ids, cache=cache)
        assert out.device.type == "meta" and out.shape == (2, 5, 64)
        step = model(ids[:, :1], cache=cache)                    # one cached decoding step
        assert step.shape == (2, 1, 64)
        hidden = traces.forward(model, ids, output_hidden_states=True).hidden_states
        assert [h.device.type for h in hidden] == ["cpu", "cpu"] + ["meta"] * 3


def test_decoding_step_on_fake_devices():
    """generate's step on a split model: the logits, hidden states and statistics of the new
    token come back on one device, the head's, where generate keeps each turn's running sums
    (a step that left them on the first device could not be added to those sums)."""
    model = M.split_model(tiny(), ["cpu", "meta"], layer_counts=[2, 2])
    cache = model.new_cache(2, capacity=8)
    M.set_lengths(cache, torch.tensor([3, 5]))
    fed = torch.tensor([True, False])
    with torch.no_grad():
        logits, hidden, stats = probes.decode_one_token(model, cache, torch.tensor([4, 7]), fed,
                                                        torch.tensor([1, 2]))
        assert {logits.device.type, hidden.device.type, stats.device.type} == {"meta"}
        assert hidden.shape == (5, 2, 32) and stats.shape == (2, 4, 4, len(STATS))
        acc = probes.TurnStats.zeros(model.config, 2, logits.device)
        probes.accumulate(acc, stats, hidden, fed.to(logits.device))
    assert cache[0].lengths.tolist() == [4, 5]


def test_default_split_balances_and_three_devices():
    model = M.split_model(tiny(layers=6), ["cpu", "meta", "meta"])
    # Equal blocks, the embedding on the first device and the head on the last: 1 + 4 + 1.
    first = [devices_of(b) == {"cpu"} for b in model.model.layers]
    assert sum(first) == M.balance_layers([1] * 6, 3, 1, 1)[0] >= 1
    assert first == sorted(first, reverse=True)              # a contiguous range from layer 0
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).device.type == "meta"


def test_tied_head_gets_its_own_copy_on_the_last_device():
    model = tiny(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="freeze"):
        M.split_model(copy.deepcopy(model).requires_grad_(True), ["cpu", "meta"])
    M.split_model(model, ["cpu", "meta"], layer_counts=[2, 2])
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert model.lm_head.weight.device.type == "meta"
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 64)
    # On one device the tie stays a tie.
    same = M.split_model(tiny(tie=True), ["cpu", "cpu"])
    assert same.lm_head.weight is same.model.embed_tokens.weight


@pytest.mark.parametrize("counts", [[1, 2], [2, 2, 0], [4, 1], [0, 4]])
def test_bad_layer_counts(counts):
    with pytest.raises(ValueError, match="layer_counts"):
        M.split_model(tiny(), ["cpu"] * len(counts), layer_counts=counts)


@pytest.mark.parametrize("tie,counts", [(False, [1, 3]), (True, None)])
def test_two_cpu_devices_equal_one_device(tie, counts):
    one = M.apply_lora(tiny(tie=tie, seed=1), r=2, alpha=4, dropout=0.0)
    with torch.no_grad():
        for _, p in M.lora_parameters(one):
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    two = M.split_model(copy.deepcopy(one), ["cpu", "cpu"], layer_counts=counts)
    assert two.layer_devices == [torch.device("cpu")] * 4      # split, though on one kind
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))

    def close(a, b):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    with torch.no_grad():
        a, b = (traces.forward(m, ids, (4, 9), output_hidden_states=True, logits=True)
                for m in (one, two))
        close(a.logits, b.logits)
        for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
            close(x, y)
        for name in STATS:
            close(a.attn_stats[name], b.attn_stats[name])
        # Cached decoding: prefill 6, then one token at a time.
        caches = [m.new_cache(2, capacity=4) for m in (one, two)]
        for m, c in zip((one, two), caches):
            m(ids[:, :6], cache=c)
        for t in range(6, 10):
            close(*(m(ids[:, t:t + 1], cache=c) for m, c in zip((one, two), caches)))
    # Generation with sampling and statistics: same tokens, same traces.
    traced = []
    for m in (one, two):
        gen = torch.Generator().manual_seed(3)
        traced.append(probes.generate(m, m.new_cache(2), [[1, 2, 3], [4, 5]], 6, temperature=1.0,
                                      stop_ids=[], generator=gen))
    for x, y in zip(*traced):
        assert x.tokens == y.tokens and x.span == y.span
        close(x.h_last, y.h_last)
        close(x.h_mean, y.h_mean)
        for name in STATS:
            close(x.attn_stats[name], y.attn_stats[name])
